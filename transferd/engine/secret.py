"""The cluster secret the peer plane proves, and whether a host is this machine's alone."""

from __future__ import annotations

import ipaddress

from transferd.config import ConfigError, EngineConfig


def load_secret(config: EngineConfig) -> bytes | None:
    """The cluster secret: the file's contents (or engine.secret), whitespace stripped."""
    if config.secret_file:
        try:
            with open(config.secret_file, "rb") as f:
                data = f.read(65536).strip()
        except OSError as exc:
            raise ConfigError(f"engine.secret_file: cannot read {config.secret_file}: "
                              f"{exc.strerror}") from None
        if not data:
            raise ConfigError(f"engine.secret_file: {config.secret_file} is empty")
        return data
    if config.secret.strip():
        return config.secret.strip().encode()
    return None


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
