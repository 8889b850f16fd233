"""``rdma://HOST:PORT``: the message transport over an RDMA RC queue pair.

Frames travel as PROTOCOL.md's "Transports" says for a message transport: header and
body one message, a payload as ``ceil(payload_len / max_message)`` continuation messages
of exactly ``max_message`` bytes (the last holds the rest); every message is received
whole into a posted receive and then scattered into the protocol's buffers; a short,
long or merged message is BAD_FRAME.  The framing is :mod:`.continuation` (shared with
seqpacket), and :class:`.msgtransport.MessageTransport` drives the protocol with it over
any carrier of whole messages: here the RC SEND/RECV channel
(``transferd.rdma.channel.RcChannel``), in the tests a SOCK_SEQPACKET socket.

Connection set-up goes over TCP at HOST:PORT: the server sends its
:class:`~transferd.rdma.exchange.ChannelSetup` (its queue pair, its receive
depth, and its max_message as the size of every receive), the client creates its queue
pair with receives of that size and answers with its own, the server connects and
sends one byte, the client connects.  The TCP connection stays open as long as the
queue pair; its end is the connection's end.  HELLO and authentication then run over the
queue pair exactly as over any transport.

A connection is opened only by ``connect`` (``Client.connect``), never from an
asynchronous read or copy: those use the connection they were given (the seed's first
hazard).  File descriptors do not travel (``transferd_fds`` is false).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

from transferd.protocol.errors import BadRequest, TransferdError

from .base import Endpoint, Listener, ProtocolFactory, TransportKind, TransportOptions
from .carriers import Carrier, MessageCarrier
from .continuation import HELLO_MESSAGE
from .msgtransport import MessageTransport

log = logging.getLogger("transferd.transports")

SETUP_TIMEOUT = 5.0
MAX_PENDING_SETUPS = 64


# -- set-up over TCP, and the registry entry -------------------------------------------------


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise ConnectionError("rdma:// set-up connection closed")
        buf += chunk
    return bytes(buf)


def _watch_setup_socket(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                        carrier: Any) -> Callable[[], None]:
    """The TCP connection lives as long as the queue pair: its end closes the channel."""
    from transferd.protocol.errors import PeerUnreachable

    fd = sock.fileno()

    def readable() -> None:
        try:
            data = sock.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            stop()
            carrier.fail(PeerUnreachable("rdma:// set-up connection closed"))

    def stop() -> None:
        with contextlib.suppress(Exception):
            loop.remove_reader(fd)
        sock.close()

    loop.add_reader(fd, readable)
    return stop


class _RdmaListener(Listener):
    def __init__(self, kind: RdmaKind, sock: socket.socket, url: str,
                 factory: ProtocolFactory, opts: TransportOptions) -> None:
        self.kind = kind
        self.url = url
        self._sock = sock
        self._factory = factory
        self._opts = opts
        self._loop = asyncio.get_running_loop()
        self._setups: set[asyncio.Task[None]] = set()
        self._loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if len(self._setups) >= MAX_PENDING_SETUPS:
                conn.close()  # set-ups cost a queue pair each: a bounded number at once
                continue
            conn.setblocking(False)
            task = self._loop.create_task(self._setup(conn))
            self._setups.add(task)
            task.add_done_callback(self._setups.discard)

    async def _setup(self, conn: socket.socket) -> None:
        from transferd.rdma.channel import RcChannel, hub_for
        from transferd.rdma.exchange import ChannelSetup

        loop = self._loop
        ch = None
        try:
            host = conn.getsockname()[0]
            hub = hub_for(loop, host)
            slot = max(self._opts.max_message, HELLO_MESSAGE)
            ch = RcChannel(hub, slot, on_message=lambda m: None, on_close=lambda e: None)
            await loop.sock_sendall(conn, ch.setup.to_bytes())
            theirs = ChannelSetup.from_bytes(await asyncio.wait_for(
                _recv_exact(loop, conn, ChannelSetup.SIZE), SETUP_TIMEOUT))
            ch.connect(theirs)
            await loop.sock_sendall(conn, b"\x01")
        except (OSError, TimeoutError, ConnectionError, TransferdError) as exc:
            log.info("rdma:// set-up from %s failed: %s", _peer(conn), exc)
            if ch is not None:
                ch.close()
            conn.close()
            return
        stop = _watch_setup_socket(loop, conn, ch)
        MessageTransport(loop, ch, self._factory(), max_message=self._opts.max_message,
                         recv_limit=self._opts.first_message or HELLO_MESSAGE,
                         extra={"peername": _peer(conn), "sockname": conn.getsockname()},
                         on_lost=stop)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        for t in list(self._setups):
            t.cancel()


def _peer(sock: socket.socket) -> Any:
    try:
        return sock.getpeername()
    except OSError:
        return "?"


class RdmaKind(TransportKind):
    scheme = "rdma"
    kind = "message"

    def carrier(self, transport: asyncio.BaseTransport, *, server: bool,
                join_counter: str) -> Carrier:
        return MessageCarrier(transport, join_counter=join_counter)

    async def listen(self, ep: Endpoint, factory: ProtocolFactory,
                     opts: TransportOptions) -> Listener:
        from transferd.rdma.channel import device_for
        from transferd.rdma.devices import rdma_problem
        from transferd.rdma.loader import VerbsUnavailable

        if (why := rdma_problem(ep.url)) is not None:
            raise VerbsUnavailable(why)
        device_for(ep.host)
        family = socket.AF_INET6 if ":" in ep.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ep.host, ep.port))
            sock.listen(opts.backlog)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise BadRequest(f"cannot listen on {ep.url}: {exc.strerror}") from None
        host, port = sock.getsockname()[:2]
        return _RdmaListener(self, sock, Endpoint(self.scheme, host, port).url, factory, opts)

    async def connect(self, ep: Endpoint, factory: ProtocolFactory, opts: TransportOptions
                      ) -> tuple[asyncio.BaseTransport, asyncio.BufferedProtocol]:
        from transferd.rdma.channel import RcChannel, hub_for
        from transferd.rdma.devices import rdma_problem
        from transferd.rdma.exchange import ChannelSetup
        from transferd.rdma.loader import VerbsUnavailable

        if (why := rdma_problem(ep.url)) is not None:
            raise VerbsUnavailable(why)
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in ep.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        ch = None
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (ep.host, ep.port)), opts.timeout)
            theirs = ChannelSetup.from_bytes(await asyncio.wait_for(
                _recv_exact(loop, sock, ChannelSetup.SIZE), SETUP_TIMEOUT))
            hub = hub_for(loop, sock.getsockname()[0])
            # Our receives take the server's max_message: what it cuts its payloads at.
            ch = RcChannel(hub, theirs.slot_len, on_message=lambda m: None,
                           on_close=lambda e: None)
            await loop.sock_sendall(sock, ch.setup.to_bytes())
            ready = await asyncio.wait_for(_recv_exact(loop, sock, 1), SETUP_TIMEOUT)
            if ready != b"\x01":
                raise BadRequest("rdma:// set-up: the server did not confirm")
            ch.connect(theirs)
        except BaseException:
            if ch is not None:
                ch.close()
            sock.close()
            raise
        stop = _watch_setup_socket(loop, sock, ch)
        protocol = factory()
        transport = MessageTransport(
            loop, ch, protocol, max_message=theirs.slot_len, recv_limit=theirs.slot_len,
            extra={"peername": (ep.host, ep.port), "sockname": sock.getsockname()},
            on_lost=stop)
        return transport, protocol
