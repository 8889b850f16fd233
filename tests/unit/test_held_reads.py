"""A READ whose memory side is not ready (a long checksum, a device's staging copy)
while its link closes: what waits is abandoned once, and nothing is done for nobody.

Three pieces: the sans-IO responder (it abandons what it holds for such READs at its
close, and a staged() coming after is for nobody), the engine port's ChecksummedSource
(a checksum not begun is not taken, one begun stops within a piece, either let go
once, ``done`` never called), and the tcp links' HangupWatch (a held link's socket is
seen hung up, by FIN or reset, without its pending frames being read).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import Any

import pytest

from tests.peerlink import HostMemory, HostRegion, _Placement, feed, identity, link_pair
from transferd.domains.link_io import HangupWatch
from transferd.engine import port as port_mod
from transferd.engine.immcounter import ImmCounter
from transferd.engine.port import CRC_INLINE_MAX, EnginePort, Turn
from transferd.engine.regions import RegionTable
from transferd.memory import Buffer
from transferd.protocol.errors import TransferdError
from transferd.protocol.peer_landing import Landing
from transferd.protocol.peer_link import LinkState, StageRead
from transferd.protocol.peer_wire import READ_DATA_HEAD, encode_read

# -- the responder ------------------------------------------------------------------


class _Deferred(_Placement):
    """A READ's source whose memory side answers later (as staging or a checksum)."""

    def __init__(self, region: HostRegion, views: list[memoryview]) -> None:
        super().__init__(region, views, deferred=True)
        self.abandoned = 0
        self.landed = 0

    def land(self, done: Any) -> None:
        self.landed += 1  # (done is the test's to call)

    def abandon(self) -> None:
        self.abandoned += 1
        super().abandon()


class _DeferredReads(HostMemory):
    def __init__(self) -> None:
        super().__init__(rails=1)
        self.sources: list[_Deferred] = []

    def source(self, rkey: int, rail: int, addrs: list[int], lens: list[int],
               abort: Any, checksum: bool = False, peer: Any = None) -> _Deferred:
        r = self._open(rkey, rail, "r")
        src = _Deferred(r, self._views(r, addrs, lens))
        self.sources.append(src)
        return src


def _held_read() -> tuple[Any, _DeferredReads, HostRegion, StageRead]:
    mem = _DeferredReads()
    region = mem.region(1 << 16, "r")
    p = link_pair(Landing(mem, 1), identity(1), identity(1))
    feed(p.inb, encode_read(1, 0, region.rkeys[0], [region.ptr], [4096], crc=True)
         # (and a frame after it, left unread while the READ waits)
         + encode_read(2, 0, region.rkeys[0], [region.ptr], [4096]))
    stage = [e for e in p.inb.events if isinstance(e, StageRead)]
    assert len(stage) == 1 and len(mem.sources) == 1
    assert not p.inb.reading and p.inb.staging
    return p, mem, region, stage[0]


def test_a_link_closed_while_its_read_waits_abandons_it_once() -> None:
    p, mem, region, stage = _held_read()
    src = mem.sources[0]
    p.inb.close(None)
    assert src.abandoned == 1 and src.released and region.admitted == 0
    assert not p.inb.staging
    # Its memory side reports after (a checksum that was running, a copy that ended):
    # for nobody; nothing let go again (the placement asserts it), nothing queued.
    p.inb.staged(stage, None)
    p.inb.close(None)
    assert src.abandoned == 1 and region.admitted == 0
    assert p.inb.state is LinkState.CLOSED and not p.inb.out.queued
    assert len(mem.sources) == 1  # (the READ after it was never taken in)


def test_a_read_whose_memory_side_reports_first_is_answered_not_abandoned() -> None:
    p, mem, region, stage = _held_read()
    src = mem.sources[0]
    p.inb.events.clear()
    p.inb.staged(stage, None)
    # Reading again: the READ after it is taken in, and waits in its turn.
    assert len(mem.sources) == 2 and p.inb.staging and not p.inb.reading
    head = READ_DATA_HEAD.unpack(bytes(p.inb.out.views()[0][:READ_DATA_HEAD.size]))
    assert head[1] == 0 and head[4] == 1, head
    p.inb.close(None)
    # Answered (its bytes never sent: let go at the close as an answer); the second
    # READ, staging at the close, abandoned.
    assert src.abandoned == 0 and src.released
    assert mem.sources[1].abandoned == 1 and region.admitted == 0


# -- the port's checksum thread -------------------------------------------------------

SIZE = CRC_INLINE_MAX + 4096


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The CRC32C held at its first piece until ``gate`` is set; ``taken`` counts pieces."""
    state = type("Gated", (), {})()
    state.gate, state.began = threading.Event(), threading.Event()
    state.taken = []
    real = port_mod.crc32c.crc_of

    def slow(views: list[memoryview], value: int = 0) -> int:
        state.taken.append(sum(len(v) for v in views))
        state.began.set()
        assert state.gate.wait(10)
        return real(views, value)

    monkeypatch.setattr(port_mod.crc32c, "crc_of", slow)
    monkeypatch.setattr(port_mod, "CRC_PIECE", 4096)  # (a piece a page: many of them)
    return state


def test_checksums_abandoned_are_dropped_or_stopped_and_let_go_once(gated: Any) -> None:
    buf = Buffer.host(1, SIZE)
    table = RegionTable()
    region = table.register(buf, 1, "r")
    port = EnginePort(table, ImmCounter(), lambda *a: None, lambda s: None)
    try:
        got: list[TransferdError | None] = []
        ended = threading.Semaphore(0)

        def done(err: TransferdError | None) -> None:
            got.append(err)
            ended.release()

        srcs = [port.source(region.rkeys[0], 0, [region.ptr], [SIZE], None, checksum=True)
                for _ in range(4)]
        for s in srcs[:3]:
            s.land(done)
        assert gated.began.wait(10)  # the first is being taken, two wait their turn
        assert region.admitted == 4
        srcs[1].abandon()  # not begun: let go now, never taken
        assert srcs[1].turn is Turn.DROPPED and region.admitted == 3
        srcs[0].abandon()  # begun: it stops at its next piece, let go by the thread
        assert srcs[0].turn is Turn.LEFT and region.admitted == 3
        srcs[3].abandon()  # never handed on (its link closed first): let go now
        srcs[3].land(done)  # (and nothing taken for it after)
        assert region.admitted == 2
        for s in srcs[:2]:
            s.abandon()  # (twice: nothing let go twice)
        gated.gate.set()
        assert ended.acquire(timeout=10)  # the third, taken whole
        assert got == [None] and srcs[2].crc is not None
        srcs[2].release()
        # The first stopped within its first piece; the second and fourth never began.
        assert gated.taken[0] == 4096
        assert sum(gated.taken) == 4096 + SIZE, gated.taken
        for _ in range(100):  # (the thread lets go of the first once it stopped)
            if region.admitted == 0:
                break
            ended.acquire(timeout=0.05)
        assert region.admitted == 0 and srcs[0].crc is None
        assert not ended.acquire(timeout=0.1), "done called for an abandoned checksum"
        assert got == [None]
    finally:
        port.close()
        buf.release()


def test_a_checksum_handed_on_then_abandoned_is_let_go_once() -> None:
    """Its ``done`` ran (the link's staged() is queued on its loop) when the link closed."""
    buf = Buffer.host(1, SIZE)
    table = RegionTable()
    region = table.register(buf, 1, "r")
    port = EnginePort(table, ImmCounter(), lambda *a: None, lambda s: None)
    try:
        ended = threading.Event()
        src = port.source(region.rkeys[0], 0, [region.ptr], [SIZE], None, checksum=True)
        src.land(lambda err: ended.set())
        assert ended.wait(10) and src.turn is Turn.HANDED
        src.abandon()
        src.abandon()
        assert region.admitted == 0
    finally:
        port.close()
        buf.release()


# -- the watch on a held link's socket -------------------------------------------------


class _Held:
    """What HangupWatch asks of a link: its socket's descriptor, and hung_up."""

    def __init__(self, sock: socket.socket, ended: asyncio.Event) -> None:
        self.fileno = sock.fileno()
        self.sock = sock
        self.ended = ended
        self.events: list[int] = []

    def hung_up(self, events: int) -> None:
        self.events.append(events)
        self.ended.set()


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as ls:
        peer = socket.create_connection(ls.getsockname())
        ours, _ = ls.accept()
    ours.setblocking(False)
    return ours, peer


@pytest.mark.parametrize("how", ["fin", "reset"])
def test_a_held_sockets_hangup_is_seen_without_reading_its_frames(how: str) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        watch = HangupWatch(loop)
        ours, peer = _pair()
        quiet, quiet_peer = _pair()
        try:
            ended, calm = asyncio.Event(), asyncio.Event()
            link, other = _Held(ours, ended), _Held(quiet, calm)
            assert watch.watch(link) and watch.watch(other)  # type: ignore[arg-type]
            # Frames sent while held stay in the kernel: no wake-up, nothing read.
            peer.sendall(b"x" * 65536)
            quiet_peer.sendall(b"y" * 65536)
            await asyncio.sleep(0.05)  # (a wake-up would come at once)
            assert not link.events and not other.events
            if how == "reset":
                peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            peer.close()
            await asyncio.wait_for(ended.wait(), 5)
            watch.unwatch(link)  # type: ignore[arg-type]
            assert not other.events
            if how == "fin":  # (its frames still there to read: none was taken)
                assert len(ours.recv(1 << 20)) > 0
            assert len(quiet.recv(1 << 20)) > 0
        finally:
            watch.close()
            for s in (ours, quiet, quiet_peer, peer):
                s.close()

    asyncio.run(main())
