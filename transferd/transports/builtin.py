"""The built-in transports: tcp, tls (accepted by hand, then the loop's TLS), unix, seqpacket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import stat
from typing import cast

from transferd.fds import AcceptGuard
from transferd.preauth import Admission, Ticket, Why
from transferd.protocol.errors import BadRequest

from .base import Endpoint, Listener, ProtocolFactory, TransportKind, TransportOptions, register
from .carriers import Carrier, FdChannel, MessageCarrier, StreamCarrier, TlsCarrier, no_delay
from .continuation import HELLO_MESSAGE, MIN_MAX_MESSAGE
from .sockets import SocketTransport

log = logging.getLogger("transferd.transports")


class Tcp(TransportKind):
    scheme = "tcp"
    kind = "stream"

    def carrier(self, transport: asyncio.BaseTransport, *, server: bool,
                join_counter: str) -> Carrier:
        no_delay(transport)
        return StreamCarrier(cast(asyncio.Transport, transport), join_counter=join_counter)

    def _ssl(self, opts: TransportOptions, server: bool) -> ssl.SSLContext | None:
        return None

    async def listen(
        self, ep: Endpoint, factory: ProtocolFactory, opts: TransportOptions
    ) -> Listener:
        # Accepted by hand (not the loop's create_server) for both: the accept loop
        # backs off when out of descriptors (uvloop's drops the waiting connections
        # without a word, asyncio's logs a traceback per try), and a tls:// stranger
        # is counted from its TCP accept.
        ctx = self._ssl(opts, server=True)
        try:
            infos = socket.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
            family, _, _, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            raise BadRequest(f"cannot listen on {ep.url}: {exc}") from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(opts.backlog)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            if ctx is None:
                raise  # as the loop's create_server did: the daemon names the errno
            raise BadRequest(f"cannot listen on {ep.url}: {exc.strerror}") from None
        host, port = sock.getsockname()[:2]
        return _TcpListener(self, sock, Endpoint(self.scheme, host, port).url, factory, ctx,
                            opts)

    async def connect(
        self, ep: Endpoint, factory: ProtocolFactory, opts: TransportOptions
    ) -> tuple[asyncio.BaseTransport, asyncio.BufferedProtocol]:
        loop = asyncio.get_running_loop()
        ctx = self._ssl(opts, server=False)
        coro = loop.create_connection(
            factory, ep.host, ep.port, ssl=ctx, server_hostname=ep.host if ctx else None
        )
        return await asyncio.wait_for(coro, opts.timeout)


class Tls(Tcp):
    scheme = "tls"
    private = True

    def carrier(self, transport: asyncio.BaseTransport, *, server: bool,
                join_counter: str) -> Carrier:
        no_delay(transport)
        t = cast(asyncio.Transport, transport)
        # A server's replies go to the SSL layer a chunk at a time (its copies are bounded).
        if server:
            return TlsCarrier(t, join_counter=join_counter)
        return StreamCarrier(t, join_counter=join_counter)

    def _ssl(self, opts: TransportOptions, server: bool) -> ssl.SSLContext | None:
        if opts.ssl_context is not None:
            return opts.ssl_context
        if server:
            if not opts.tls_cert or not opts.tls_key:
                raise BadRequest(
                    "a tls:// listener needs server.tls_cert and server.tls_key (PEM files)"
                )
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                ctx.load_cert_chain(opts.tls_cert, opts.tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise BadRequest(f"cannot load the TLS certificate or key: {exc}") from None
            return ctx
        ctx = ssl.create_default_context(cafile=opts.tls_ca or None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx


class _TcpListener(Listener):
    """A tcp:// or tls:// listener that accepts by hand.

    The loop's own ``create_server(ssl=...)`` hands the protocol its transport
    only once the TLS handshake is done, so a stranger that connects and sends
    nothing escaped the caps on connections not yet authenticated.  Here a
    tls:// socket is judged by ``opts.admission`` by its source address from
    its TCP accept (closed at once over a cap, before a byte is read), and its
    TLS handshake runs with ``opts.handshake_timeout``; the slot is given back
    when the handshake ends, and the protocol's own handshake counts from
    there.  A tcp:// socket goes to the protocol at once (which counts it).
    Both accept under an :class:`~transferd.fds.AcceptGuard`.
    """

    def __init__(self, kind: TransportKind, sock: socket.socket, url: str,
                 factory: ProtocolFactory, ctx: ssl.SSLContext | None,
                 opts: TransportOptions) -> None:
        self.kind = kind
        self.url = url
        self._sock = sock
        self._factory = factory
        self._ctx = ctx
        self._opts = opts
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Future[None]] = set()
        self._guard = AcceptGuard(self._loop, sock, self._accept, f"listener {url}", log)

    def _accept(self) -> None:
        admission: Admission | None = self._opts.admission if self._ctx is not None else None
        for conn, addr in self._guard.accept_burst():
            source = str(addr[0])
            ticket = None
            if admission is not None:
                admitted = admission.admit(source, self._loop.time())
                admission.close(admitted.closed)
                if admitted.ticket is None:
                    conn.close()
                    continue
                ticket = admitted.ticket
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hs = _TlsHandshake(self._loop, self._factory, conn, self._ctx,
                               self._opts.handshake_timeout, admission, ticket, self.url)
            if ticket is not None:
                ticket.owner = hs
            self._tasks.add(hs.task)
            hs.task.add_done_callback(self._tasks.discard)
    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._guard.close()
        self._sock.close()
        for t in list(self._tasks):
            t.cancel()


class _TlsHandshake:
    """One accepted tcp:// or tls:// socket on its way to its protocol.  On tls:// it holds
    a pre-auth ticket through the TLS handshake, and gives way (the task is cancelled, the
    loop closes the socket) when the admission takes the slot back."""

    def __init__(self, loop: asyncio.AbstractEventLoop, factory: ProtocolFactory,
                 conn: socket.socket, ctx: ssl.SSLContext | None, timeout: float,
                 admission: Admission | None, ticket: Ticket | None, url: str) -> None:
        self._admission = admission
        self._ticket = ticket
        self._url = url
        self._conn: socket.socket | None = conn  # until the loop owns it
        self.task = asyncio.ensure_future(self._run(loop, factory, conn, ctx, timeout))

    async def _run(self, loop: asyncio.AbstractEventLoop, factory: ProtocolFactory,
                   conn: socket.socket, ctx: ssl.SSLContext | None, timeout: float) -> None:
        self._conn = None
        try:
            # The loop owns the socket from here and closes it if this fails.
            if ctx is None:
                await loop.connect_accepted_socket(factory, conn)
            else:
                await loop.connect_accepted_socket(factory, conn, ssl=ctx,
                                                   ssl_handshake_timeout=timeout)
        except Exception as exc:  # a failed or timed-out TLS handshake
            log.debug("%s: connection failed: %r", self._url, exc)
        finally:
            if self._admission is not None and self._ticket is not None:
                self._admission.release(self._ticket)
            # The ticket's owner is this handshake: no cycle is left behind.
            self._ticket = None

    def give_way(self, why: Why) -> None:
        log.debug("%s: TLS handshake closed: %s", self._url, why.value)
        if self._conn is not None:  # a task cancelled before it ran never runs its body
            self._conn.close()
        self.task.cancel()


class _UnixListener(Listener):
    kind: UnixKind

    def __init__(
        self, kind: UnixKind, sock: socket.socket, ep: Endpoint, factory: ProtocolFactory,
        opts: TransportOptions,
    ) -> None:
        self.kind = kind
        self.url = ep.url
        self._sock = sock
        self._path = ep.path
        self._factory = factory
        self._opts = opts
        self._loop = asyncio.get_running_loop()
        self._ino = os.stat(ep.path).st_ino
        self._guard = AcceptGuard(self._loop, sock, self._accept, f"listener {ep.url}", log)

    def _accept(self) -> None:
        for conn, _addr in self._guard.accept_burst():
            conn.setblocking(False)
            self.kind.tune(conn, self._opts)
            SocketTransport(
                self._loop, conn, self._factory(), message=self.kind.kind == "message",
                max_message=self._opts.max_message,
                recv_limit=self._opts.first_message or HELLO_MESSAGE,
                keep_fds=False,  # a server takes no descriptors from its clients
            )

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._guard.close()
        self._sock.close()
        # Remove the file only if it is still ours (not a successor's).
        with contextlib.suppress(OSError):
            if os.stat(self._path).st_ino == self._ino:
                os.unlink(self._path)


class UnixKind(TransportKind):
    scheme = "unix"
    kind = "stream"
    fds = True
    private = True
    sock_type = socket.SOCK_STREAM

    def parse(self, url: str) -> Endpoint:
        path = url[len(self.scheme) + 3 :]
        if not path:
            raise BadRequest(f"{url!r}: expected {self.scheme}:///PATH")
        return Endpoint(self.scheme, path=path)

    def tune(self, sock: socket.socket, opts: TransportOptions) -> None:
        pass

    def carrier(self, transport: asyncio.BaseTransport, *, server: bool,
                join_counter: str) -> Carrier:
        t = cast(SocketTransport, transport)
        return StreamCarrier(t, FdChannel(t), join_counter=join_counter)

    def identity(self, transport: asyncio.BaseTransport) -> tuple[str, str]:
        """A Unix peer is its uid (SO_PEERCRED): one local user cannot take another's
        handshake slots or make another's token verdicts wait."""
        cred = cast(SocketTransport, transport).peercred
        if cred is None:
            return "local", "local"
        pid, uid, _gid = cred
        return f"uid {uid}", f"local (pid {pid}, uid {uid})"

    async def listen(
        self, ep: Endpoint, factory: ProtocolFactory, opts: TransportOptions
    ) -> Listener:
        # A socket left at the path (a daemon that died) is replaced; anything else is
        # refused, never removed (a path set wrong would delete whatever is there).
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(ep.path).st_mode):
                raise BadRequest(f"{ep.path} exists and is not a socket: it is not removed "
                                 "to listen there; remove it, or choose another path")
            os.unlink(ep.path)
        sock = socket.socket(socket.AF_UNIX, self.sock_type)
        try:
            sock.bind(ep.path)
            sock.listen(opts.backlog)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise BadRequest(f"cannot listen on {ep.url}: {exc.strerror}") from None
        return _UnixListener(self, sock, ep, factory, opts)

    async def connect(
        self, ep: Endpoint, factory: ProtocolFactory, opts: TransportOptions
    ) -> tuple[asyncio.BaseTransport, asyncio.BufferedProtocol]:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, self.sock_type)
        sock.setblocking(False)
        try:
            self.tune(sock, opts)
            await asyncio.wait_for(loop.sock_connect(sock, ep.path), opts.timeout)
        except BaseException:
            sock.close()
            raise
        protocol = factory()
        transport = SocketTransport(
            loop, sock, protocol, message=self.kind == "message",
            max_message=opts.max_message,
            recv_limit=opts.first_message or MIN_MAX_MESSAGE,
        )
        return transport, protocol


class SeqPacket(UnixKind):
    scheme = "seqpacket"
    kind = "message"
    sock_type = socket.SOCK_SEQPACKET

    def carrier(self, transport: asyncio.BaseTransport, *, server: bool,
                join_counter: str) -> Carrier:
        t = cast(SocketTransport, transport)
        return MessageCarrier(t, FdChannel(t), join_counter=join_counter)

    def tune(self, sock: socket.socket, opts: TransportOptions) -> None:
        # A message must fit the send buffer whole; leave room for a few.
        want = 4 * max(opts.max_message, MIN_MAX_MESSAGE)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                if sock.getsockopt(socket.SOL_SOCKET, opt) < want:
                    sock.setsockopt(socket.SOL_SOCKET, opt, want)


def register_builtins() -> None:
    for kind in (Tcp(), Tls(), UnixKind(), SeqPacket()):
        register(kind)
