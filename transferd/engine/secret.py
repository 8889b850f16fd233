"""The cluster secret the peer plane proves, and whether a host is this machine's alone."""

from __future__ import annotations

import ipaddress

from transferd.config import EngineConfig
from transferd.protocol.keyring import Keyring
from transferd.secret_files import cluster_keyring


def load_secret(config: EngineConfig, insecure: bool = False) -> Keyring | None:
    """The cluster secret: engine.secret_file's contents (or engine.secret), whitespace
    stripped, with engine.previous_secret_file during a rotation; None without one.
    ConfigError for a file that cannot be read or that another user could read."""
    return cluster_keyring(config, insecure)


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
