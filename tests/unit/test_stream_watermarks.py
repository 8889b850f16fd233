"""FramedStream's watermarks and the peer link that obeys them."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from transferd.domains import stream as stream_mod
from transferd.domains.rails import rail_bytes
from transferd.domains.stream import FramedStream
from transferd.domains.tcp import LinkState, PeerLink
from transferd.engine.plan import SendPart
from transferd.engine.transfer import Transfer
from transferd.fds import LinkBudget
from transferd.protocol.errors import PeerUnreachable
from transferd.protocol.frames import FrameDecoder, encode_frame
from transferd.protocol.peer import PeerCommand
from transferd.protocol.peer_handshake import PeerHandshake, PeerIdentity, Role
from transferd.protocol.values import NetAddr

SECRET = b"unit test secret"


def _drain(loop: asyncio.AbstractEventLoop, sock: socket.socket, until: Any) -> None:
    sock.setblocking(False)

    async def read() -> None:
        while not until():
            await asyncio.sleep(0.001)
            try:
                while sock.recv(1 << 20):
                    pass
            except BlockingIOError:
                continue

    loop.run_until_complete(asyncio.wait_for(read(), 10))


def test_pause_above_high_and_resume_below_low(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_mod, "HIGH_WATER", 256 * 1024)
    monkeypatch.setattr(stream_mod, "LOW_WATER", 64 * 1024)
    loop = asyncio.new_event_loop()
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    events: list[str] = []
    s = FramedStream(loop, a, on_frame=lambda f: None, on_close=lambda e: None)
    s.on_pause = lambda: events.append("pause")
    s.on_resume = lambda: events.append("resume")
    s.send(0x41, 0, 1, None, [memoryview(bytes(1 << 20))])
    assert events == ["pause"] and s.queued > 256 * 1024
    _drain(loop, b, lambda: "resume" in events)
    assert events == ["pause", "resume"]
    assert s.queued <= 64 * 1024
    s.close()
    b.close()
    loop.close()


class _Domain:
    """What a PeerLink needs of its TcpDomain, without listening anywhere."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.rail = 0
        self.host = "127.0.0.1"
        self.forgotten: list[Any] = []
        self.group = _Group()
        self.budget = LinkBudget(16)
        self.rail_timeout_s = 10.0
        self.dials: list[tuple[bytes, Any]] = []

    def forget(self, link: Any) -> None:
        self.forgotten.append(link)

    def dial_failed(self, addr: bytes, error: Any) -> None:
        self.dials.append((addr, error))

    def dial_worked(self, addr: bytes) -> None:
        self.dials.append((addr, None))

    def expect_probe(self, nonce: bytes, link: Any) -> None:
        pass

    def forget_probe(self, link: Any) -> None:
        pass


class _Group:
    """What a link asks of its group: who we are, the secret, the peer book."""

    identity = PeerIdentity(0xA, 0, (b"127.0.0.1:1",))
    secret = SECRET
    handshake_timeout_s = 5.0

    def bind_peer(self, peer: PeerIdentity) -> None:
        pass


def test_paused_link_holds_parts_until_resumed() -> None:
    loop = asyncio.new_event_loop()
    domain = _Domain(loop)
    # Port 1 on loopback refuses at once; the link is driven by hand below.
    link = PeerLink(domain, NetAddr(7, 0, (("127.0.0.1", 1),)))  # type: ignore[arg-type]
    link._task.cancel()
    a, b = socket.socketpair()
    link.stream = FramedStream(loop, a, on_frame=lambda f: None, on_close=lambda e: None)
    link.state = LinkState.READY
    done: list[Any] = []
    transfers = [Transfer(i, 1, 0, done.append) for i in range(3)]

    link._pause()
    assert link.state is LinkState.PAUSED
    for i, t in enumerate(transfers):
        link.submit(SendPart(0, link.dst, b"m%d" % i, op=i), t)
    assert len(link._waiting) == 3 and not link._pending  # nothing went out while paused

    link._resume()
    assert link.state is LinkState.READY and not link._waiting
    assert sorted(link._pending) == [(0, 0), (1, 0), (2, 0)]
    link.close(PeerUnreachable("test over"))
    assert len(done) == 3  # every transfer told, none left hanging
    b.close()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()


def test_link_breaks_on_a_reply_that_claims_a_payload() -> None:
    """An ACK claiming a terabyte of payload closes the link; nothing is allocated."""
    loop = asyncio.new_event_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    domain = _Domain(loop)
    link = PeerLink(domain, NetAddr(7, 0, (("127.0.0.1", port),)))  # type: ignore[arg-type]
    done: list[Any] = []
    link.submit(SendPart(0, link.dst, b"hi", op=1), Transfer(1, 1, 0, done.append))

    async def peer() -> None:
        # A real responder (it has the secret), then an ACK claiming a terabyte.
        conn, _ = await loop.sock_accept(listener)
        me = PeerIdentity(7, 0, (rail_bytes("127.0.0.1", port),))
        hs = PeerHandshake(Role.RESPONDER, me, 0, SECRET, loop.time())
        dec = FrameDecoder()
        while not hs.done:
            for f in dec.feed(await loop.sock_recv(conn, 4096)):
                hs.receive(f, loop.time())
            await loop.sock_sendall(conn, hs.data_to_send())
        await asyncio.sleep(0.05)
        await loop.sock_sendall(conn, encode_frame(PeerCommand.ACK, 0, 0, {"op": 1}, 1 << 40))
        for _ in range(200):
            if done:
                break
            await asyncio.sleep(0.01)
        conn.close()

    listener.setblocking(False)
    loop.run_until_complete(asyncio.wait_for(peer(), 10))
    assert link.state is LinkState.CLOSED
    assert len(done) == 1 and isinstance(done[0], PeerUnreachable), done
    listener.close()
    loop.close()
