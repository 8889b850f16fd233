"""The transport registry: URL parsing, the TransportKind interface, listen and connect."""

from __future__ import annotations

import asyncio
import ssl
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from transferd.preauth import Admission
from transferd.protocol.errors import BadRequest

from .carriers import Carrier, StreamCarrier

ProtocolFactory = Callable[[], asyncio.BufferedProtocol]


@dataclass(frozen=True)
class Endpoint:
    """A parsed transport URL: ``host``/``port`` for network schemes, ``path`` for local."""

    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""

    @property
    def url(self) -> str:
        if self.path:
            return f"{self.scheme}://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


@dataclass
class TransportOptions:
    """What a listener or a connection may need besides its URL."""

    # Server side: the TLS certificate chain and key (PEM files).
    tls_cert: str = ""
    tls_key: str = ""
    # Either side: a ready SSLContext wins over the files.
    ssl_context: ssl.SSLContext | None = None
    # Client side: a CA file to verify the server with (default: the system's).
    tls_ca: str = ""
    # Message transports: the size of a continuation message (server side:
    # what it announces in HELLO) and the largest message accepted at first.
    max_message: int = 256 * 1024
    first_message: int | None = None
    backlog: int = 1024
    # Server side, tls: seconds a client has for the TLS handshake (before
    # the protocol's own handshake timeout starts).
    handshake_timeout: float = 5.0
    # Seconds to wait for a connection (client side).
    timeout: float | None = 10.0
    # Server side, tls: the server's pre-auth admission (transferd/preauth.py), which
    # counts a TLS connection from its TCP accept, through its TLS handshake.
    admission: Admission | None = None


class Listener(ABC):
    """An open listener; ``url`` is what it is reachable at (the port it really got)."""

    url: str
    kind: TransportKind

    @abstractmethod
    async def close(self) -> None: ...


class TransportKind(ABC):
    """One transport: how to listen and connect for its scheme, and what its connections
    are (the :class:`~transferd.transports.carriers.Carrier` frames go out through, who
    a peer is counted as before it authenticates)."""

    scheme: str
    # "stream" (frames back to back) or "message" (one frame one message).
    kind: str
    # Whether connections carry file descriptors (SCM_RIGHTS).
    fds: bool = False
    # Whether the bytes are private on the wire (TLS, a local socket).
    private: bool = False

    def carrier(self, transport: asyncio.BaseTransport, *, server: bool,
                join_counter: str) -> Carrier:
        """How this kind's connection writes frames (default: a stream, no descriptors)."""
        return StreamCarrier(cast(asyncio.Transport, transport), join_counter=join_counter)

    def identity(self, transport: asyncio.BaseTransport) -> tuple[str, str]:
        """(source, label): who a connection is counted as before it authenticates
        (transferd/preauth.py) and how logs name it.  Default: the peer's IP address."""
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            host, port = peer[0], peer[1] if len(peer) > 1 else 0
            return str(host), f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
        return "local", "local"

    def parse(self, url: str) -> Endpoint:
        """Default: ``scheme://HOST:PORT``."""
        rest = url[len(self.scheme) + 3 :]
        host, sep, port = rest.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise BadRequest(f"{url!r}: expected {self.scheme}://HOST:PORT")
        return Endpoint(self.scheme, host=host, port=int(port))

    @abstractmethod
    async def listen(
        self, ep: Endpoint, factory: ProtocolFactory, opts: TransportOptions
    ) -> Listener: ...

    @abstractmethod
    async def connect(
        self, ep: Endpoint, factory: ProtocolFactory, opts: TransportOptions
    ) -> tuple[asyncio.BaseTransport, asyncio.BufferedProtocol]: ...


REGISTRY: dict[str, TransportKind] = {}


def register(kind: TransportKind) -> None:
    REGISTRY[kind.scheme] = kind


def schemes() -> list[str]:
    return sorted(REGISTRY)


def get(url: str) -> TransportKind:
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise BadRequest(f"{url!r}: not a URL (expected SCHEME://..., one of {schemes()})")
    kind = REGISTRY.get(scheme)
    if kind is None:
        raise BadRequest(f"{url!r}: unknown transport {scheme!r} (known: {', '.join(schemes())})")
    return kind


def parse(url: str) -> Endpoint:
    return get(url).parse(url)


async def listen(url: str, factory: ProtocolFactory, opts: TransportOptions | None = None) -> Any:
    kind = get(url)
    return await kind.listen(kind.parse(url), factory, opts or TransportOptions())


async def connect(
    url: str, factory: ProtocolFactory, opts: TransportOptions | None = None
) -> tuple[asyncio.BaseTransport, asyncio.BufferedProtocol]:
    kind = get(url)
    return await kind.connect(kind.parse(url), factory, opts or TransportOptions())
