"""A peer link's I/O loop (transferd/domains/link_io.py) over real sockets: the send
watermarks, parts held while paused, partial sends, and a peer whose ACK lies."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from tests.peerlink import SECRET, HostMemory, feed, identity, link_pair
from transferd.domains.group import DomainGroup
from transferd.domains.link_io import SocketLink
from transferd.domains.rails import rail_bytes
from transferd.engine.immcounter import ImmCounter
from transferd.engine.port import EnginePort
from transferd.engine.regions import RegionTable
from transferd.parts import SendPart, Transfer
from transferd.protocol.errors import PeerUnreachable, TransferdError
from transferd.protocol.frames import FrameDecoder
from transferd.protocol.peer_handshake import PeerHandshake, PeerIdentity, Role
from transferd.protocol.peer_landing import Landing
from transferd.protocol.peer_link import LinkState
from transferd.protocol.peer_outbound import OutboundLink
from transferd.protocol.peer_wire import ACK_HEAD
from transferd.protocol.values import NetAddr


class _Owner:
    def __init__(self) -> None:
        self.closed: list[Any] = []

    def link_event(self, link: SocketLink, event: Any) -> None:
        pass

    def link_closed(self, link: SocketLink, error: TransferdError | None) -> None:
        self.closed.append(error)


def _ready_link(high: int = 64 << 20, low: int = 16 << 20) -> tuple[Any, Any, Any]:
    """Our outbound core, through its handshake in memory, and the peer's region."""
    mem = HostMemory(1)
    p = link_pair(Landing(mem, 1), identity(1), identity(1))
    p.out.high_water, p.out.low_water = high, low
    return p, mem, mem.region(4 << 20)


def _read_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, inb: Any,
               until: Any) -> None:
    """The peer's side: what comes on ``sock`` goes into its inbound core."""
    sock.setblocking(False)

    async def read() -> None:
        while not until():
            await asyncio.sleep(0.001)
            try:
                while data := sock.recv(1 << 20):
                    feed(inb, data)
            except BlockingIOError:
                continue

    loop.run_until_complete(asyncio.wait_for(read(), 10))


def test_pause_above_high_and_resume_below_low() -> None:
    loop = asyncio.new_event_loop()
    p, mem, r = _ready_link(high=256 * 1024, low=64 * 1024)
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    io = SocketLink(loop, a, p.out, _Owner())
    done: list[Any] = []
    data = bytes(range(256)) * 4096
    p.out.write(Transfer(1, 1, 0, done.append), 1, 0, r.rkeys[0], [r.ptr], [len(data)],
                [memoryview(data)], 3)
    io.flush()
    assert p.out.state is LinkState.PAUSED and io.queued > 256 * 1024
    _read_into(loop, b, p.inb, lambda: p.out.state is LinkState.READY)
    assert io.queued <= 64 * 1024
    _read_into(loop, b, p.inb, lambda: bytes(r.data[:len(data)]) == data)
    assert mem.counts[3] == 1
    io.close(None)
    b.close()
    loop.close()


def test_paused_link_holds_parts_until_resumed() -> None:
    loop = asyncio.new_event_loop()
    p, _, r = _ready_link(high=100_000, low=10_000)
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    io = SocketLink(loop, a, p.out, _Owner())
    done: list[Any] = []
    big = bytes(300_000)
    p.out.write(Transfer(0, 1, 0, done.append), 9, 0, r.rkeys[0], [r.ptr], [len(big)],
                [memoryview(big)], None)
    io.flush()
    assert p.out.state is LinkState.PAUSED
    transfers = [Transfer(i, 1, 0, done.append) for i in range(3)]
    for i, t in enumerate(transfers):
        p.out.send(t, i, 0, b"m%d" % i)
    assert p.out.waiting == 3 and p.out.in_flight == 1  # nothing went out while paused
    _read_into(loop, b, p.inb, lambda: len(p.delivered) == 3 or len(p.inb.events) >= 3)
    assert p.out.state is LinkState.READY and p.out.waiting == 0 and p.out.in_flight == 4
    io.close(PeerUnreachable("test over"))
    assert len(done) == 4 and all(isinstance(e, PeerUnreachable) for e in done)
    b.close()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()


def test_partial_sends_keep_the_order_of_hundreds_of_views() -> None:
    """Hundreds of small views through a tiny send buffer land whole and in order."""
    loop = asyncio.new_event_loop()
    p, mem, r = _ready_link()
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    io = SocketLink(loop, a, p.out, _Owner())
    data = [bytes([i % 251]) * (100 + i % 700) for i in range(900)]
    addrs, pos = [], 0
    for d in data:
        addrs.append(r.ptr + pos)
        pos += len(d)
    # Empty views in between go nowhere.
    views = [v for d in data for v in (memoryview(d), memoryview(b""))]
    lens = [len(d) for d in data]
    p.out.write(Transfer(1, 1, 0, lambda e: None), 1, 0, r.rkeys[0], addrs, lens,
                views, 5)
    io.flush()
    assert io.queued > 0  # the send buffer cannot take it all at once
    _read_into(loop, b, p.inb, lambda: mem.counts[5] == 900)
    assert bytes(r.data[:pos]) == b"".join(data) and io.queued == 0
    io.close(None)
    b.close()
    loop.close()


def test_link_breaks_on_an_ack_that_claims_a_long_message() -> None:
    """An ACK announcing a 60,000-byte error message closes the link (an ACK's message
    is at most 4 KiB): nothing waits for those bytes, the part fails PEER_UNREACHABLE."""
    loop = asyncio.new_event_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    group = DomainGroup(0, 0xA, loop, EnginePort(RegionTable(), ImmCounter(),
                                                   lambda *a: None, lambda s: None),
                        secret=SECRET)

    async def main() -> list[Any]:
        group.bind(["127.0.0.1"])
        done: list[Any] = []
        dst = NetAddr(7, 0, (rail_bytes("127.0.0.1", port),))
        t = Transfer(1, 1, 0, done.append)
        group.execute(t, [SendPart(0, dst, b"hi", op=1)])
        # A real responder (it has the secret), then an ACK that lies about its size.
        listener.setblocking(False)
        conn, _ = await loop.sock_accept(listener)
        me = PeerIdentity(7, 0, (rail_bytes("127.0.0.1", port),))
        hs = PeerHandshake(Role.RESPONDER, me, 0, SECRET, loop.time())
        dec = FrameDecoder()
        while not hs.done:
            for f in dec.feed(await loop.sock_recv(conn, 4096)):
                hs.receive(f, loop.time())
            await loop.sock_sendall(conn, hs.data_to_send())
        await asyncio.sleep(0.05)
        await loop.sock_sendall(conn, ACK_HEAD.pack(0x42, 1, 60000, 0, 1))
        for _ in range(200):
            if done:
                break
            await asyncio.sleep(0.01)
        conn.close()
        return done

    done = loop.run_until_complete(asyncio.wait_for(main(), 10))
    assert len(done) == 1 and isinstance(done[0], PeerUnreachable), done
    assert "ACK" in done[0].message
    group.close()
    listener.close()
    loop.run_until_complete(asyncio.sleep(0.01))
    loop.close()


def test_an_outbound_core_refuses_parts_once_closed() -> None:
    link = OutboundLink(identity(1), 0, SECRET, 0.0, timeout=5.0,
                        expect=(1, 0, b"10.0.1.0:1"), label="link to X rail 0")
    link.close(PeerUnreachable("link to X rail 0: gone"))
    link.send("t", 1, 0, b"x")
    assert link.completions == [("t", link.error)]
