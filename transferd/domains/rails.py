"""A TCP rail's address: the opaque bytes NetAddrs and the peer handshake carry.

Shared by every Domain whose links (or handshake) run over a rail's TCP
address: tcp, and verbs for its connection exchange.
"""

from __future__ import annotations

import functools
import ipaddress

from transferd.protocol.errors import BadRequest
from transferd.protocol.values import tcp_rail

__all__ = ["check_rail", "parse_rail", "rail_bytes"]


def rail_bytes(host: str, port: int) -> bytes:
    """A TCP rail's address as the opaque bytes NetAddrs and the handshake carry."""
    return tcp_rail(host, port)


def parse_rail(raw: bytes) -> tuple[str, int]:
    """The (host, port) of :func:`rail_bytes`; BadRequest unless an IP and a port 1-65535."""
    # Every submit checks its destinations' rails: the same few addresses, parsed once.
    return _parse_rail_cached(raw) if type(raw) is bytes else _parse_rail(raw)


def _parse_rail(raw: bytes) -> tuple[str, int]:
    try:
        text = raw.decode("ascii")
        host, _, port = text.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        return check_rail(host, int(port))
    except (UnicodeDecodeError, ValueError):
        raise BadRequest(f"not a TCP rail address: {raw!r}") from None


# Bounded (the addresses a daemon meets); a refused address is not cached (it raises).
_parse_rail_cached = functools.lru_cache(maxsize=1024)(_parse_rail)


def check_rail(host: str, port: int) -> tuple[str, int]:
    """(host, port) if ``host`` is an IP address and ``port`` in 1-65535, else BadRequest."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise BadRequest(f"rail host {host!r} is not an IP address") from None
    if type(port) is not int or not 1 <= port <= 65535:
        raise BadRequest(f"rail port {port!r} is outside 1-65535")
    return host, port
