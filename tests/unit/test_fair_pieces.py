"""The port's checksum thread shared fairly: round-robin across peers, FIFO within one.

Before, the thread was a FIFO executor: one peer's verified READ of 4096 overlapping
pages of a large region (terabytes of CRC32C) held every other peer's verified READ
behind it for its whole checksum.  First :class:`FairPieces` alone (which piece comes
next: no thread), then the port's thread with real ChecksummedSources of a region.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from transferd.engine import port as port_mod
from transferd.engine.fair_pieces import FairPieces, Shift
from transferd.engine.immcounter import ImmCounter
from transferd.engine.port import CRC_INLINE_MAX, EnginePort, Turn
from transferd.engine.regions import RegionTable
from transferd.memory import Buffer
from transferd.protocol.crc import crc_of
from transferd.protocol.errors import OutOfMemory, PeerUnreachable, TransferdError

# -- which piece next -----------------------------------------------------------------


def _run(p: FairPieces[str], left: dict[str, int], steps: int) -> list[str]:
    """Take ``steps`` pieces (``left``: pieces each job has); the jobs in turn."""
    order = []
    for _ in range(steps):
        turn = p.next()
        if turn is None:
            break
        lane, job = turn
        left[job] -= 1
        order.append(job)
        p.took(lane, job, left[job] > 0)
    return order


def test_a_small_job_of_another_peer_interleaves_with_a_huge_one() -> None:
    p: FairPieces[str] = FairPieces(limit=8)
    left = {"huge": 10_000, "small": 3}
    p.add("attacker", "huge")
    assert _run(p, left, 5) == ["huge"] * 5  # alone: the thread is all its own
    p.add("honest", "small")
    # Every other piece is the small one's until it is done: its wait is one piece of
    # the huge one per piece of its own, whatever the huge one's length.
    assert _run(p, left, 8) == ["huge", "small"] * 3 + ["huge", "huge"]
    assert left["small"] == 0 and len(p) == 1 and p.lanes == 1


def test_one_peers_jobs_go_in_order_and_a_new_peer_waits_its_turn() -> None:
    p: FairPieces[str] = FairPieces(limit=8)
    left = {"a1": 3, "a2": 2, "b1": 2, "c1": 1}
    p.add("a", "a1")
    p.add("a", "a2")  # (the same peer on another link: after its first, not beside it)
    p.add("b", "b1")
    assert _run(p, left, 2) == ["a1", "b1"]
    p.add("c", "c1")  # comes after the lanes waiting now (a's, then b's)
    assert _run(p, left, 20) == ["a1", "b1", "c1", "a1", "a2", "a2"]
    assert len(p) == 0 and p.next() is None


def test_withdrawn_drained_and_bounded() -> None:
    p: FairPieces[str] = FairPieces(limit=3)
    p.add("a", "a1")
    p.add("a", "a2")
    p.add("b", "b1")
    with pytest.raises(OutOfMemory):
        p.add("c", "c1")  # (refused typed, nothing queued for it)
    assert p.withdraw("a", "a1") and not p.withdraw("a", "a1") and len(p) == 2
    turn = p.next()
    assert turn == ("a", "a2")
    # Withdrawn while its piece was taken: the lane had its turn all the same.
    assert p.withdraw("a", "a2")
    p.took("a", "a2", True)
    assert p.next() == ("b", "b1") and p.lanes == 1
    p.add("c", "c1")
    assert p.drain() == ["b1", "c1"] and len(p) == 0 and p.next() is None


# -- the port's thread ------------------------------------------------------------------

PAGE = 8 << 20  # the huge READ's pages: all of its region, 4096 times (32 GiB)
SMALL = CRC_INLINE_MAX + (1 << 20)


@pytest.fixture
def port() -> Any:
    table = RegionTable()
    port = EnginePort(table, ImmCounter(), lambda *a: None, lambda s: None)
    bufs = [Buffer.host(1, PAGE), Buffer.host(2, SMALL)]
    bufs[1].view(0, SMALL)[:] = bytes(range(256)) * (SMALL // 256)
    regions = [table.register(b, 1, "r") for b in bufs]
    yield port, regions, bufs
    port.close()
    for b in bufs:
        b.release()


def _done() -> tuple[list[TransferdError | None], threading.Event, Any]:
    got: list[TransferdError | None] = []
    ended = threading.Event()

    def done(err: TransferdError | None) -> None:
        got.append(err)
        ended.set()

    return got, ended, done


def _small(port: EnginePort, small: Any) -> tuple[float, Any]:
    """Peer 2's small verified READ, answered: how long its checksum took, and it (not
    yet released)."""
    got, ended, done = _done()
    src = port.source(small.rkeys[0], 0, [small.ptr], [SMALL], None, checksum=True,
                      peer=(2, 0))
    t0 = time.monotonic()
    src.land(done)
    assert ended.wait(10) and got == [None]
    return time.monotonic() - t0, src


def _small_alone(port: EnginePort, small: Any) -> float:
    took, src = _small(port, small)
    src.release()
    return took


def test_an_honest_read_is_not_held_behind_a_huge_one(port: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 1 MiB: the small READ's 17 come between the huge one's."""
    monkeypatch.setattr(port_mod, "CRC_PIECE", 1 << 20)
    port, (big, small), bufs = port
    alone = min(_small_alone(port, small) for _ in range(3))
    huge = port.source(big.rkeys[0], 0, [big.ptr] * 4096, [PAGE] * 4096, None,
                       checksum=True, peer=(1, 0))
    _, hended, hdone = _done()
    huge.land(hdone)
    time.sleep(0.05)  # (the huge one has the thread to itself a while)
    assert huge.turn in (Turn.TAKING, Turn.QUEUED)
    took, src = _small(port, small)
    assert src.crc == crc_of([bufs[1].view(0, SMALL)])
    src.release()
    # The huge one is far from done (32 GiB of CRC32C: seconds), and the small one took
    # about twice its own time (a piece of the huge one per piece of its own); before,
    # it waited for all of the huge one's.
    assert huge.turn in (Turn.TAKING, Turn.QUEUED) and not hended.is_set()
    print(f"small alone {alone * 1e3:.1f} ms, beside the huge one {took * 1e3:.1f} ms")
    assert took < 4 * alone + 0.05, (took, alone)
    # Its link goes: let go once (now, or by the thread after its piece), no answer.
    huge.abandon()
    huge.abandon()
    for _ in range(100):
        if big.admitted == 0 and port.checksums.shift is Shift.IDLE:
            break
        time.sleep(0.01)
    assert big.admitted == 0 and small.admitted == 0 and not hended.is_set()
    assert port.checksums.waiting() == (0, 0)


def test_a_read_abandoned_between_its_pieces_goes_at_once(port: Any,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Waiting for its next turn, it is withdrawn and let go on the link's loop: its place
    in the queue is not held (the bound) until the thread comes round to it."""
    gate, began = threading.Event(), threading.Event()
    real = port_mod.crc32c.crc_of

    def held(views: list[memoryview], value: int = 0) -> int:
        if sum(len(v) for v in views) == 4096:  # (the small one's pieces are held)
            began.set()
            assert gate.wait(10)
        return real(views, value)

    monkeypatch.setattr(port_mod, "CRC_PIECE", 4096)
    monkeypatch.setattr(port_mod.crc32c, "crc_of", held)
    port, (_, small), _ = port
    a = port.source(small.rkeys[0], 0, [small.ptr], [SMALL], None, checksum=True, peer=(1, 0))
    b = port.source(small.rkeys[0], 0, [small.ptr], [SMALL], None, checksum=True, peer=(2, 0))
    agot, _, adone = _done()
    bgot, _, bdone = _done()
    a.land(adone)
    assert began.wait(10)  # a's first piece is being taken
    b.land(bdone)
    assert port.checksums.waiting() == (2, 2)
    b.abandon()  # b waits its turn: withdrawn, let go now
    assert b.turn is Turn.DROPPED and small.admitted == 1
    assert port.checksums.waiting() == (1, 1)
    a.abandon()  # a's piece is being taken: let go by the thread after it
    assert a.turn is Turn.LEFT and small.admitted == 1
    gate.set()
    for _ in range(100):
        if small.admitted == 0 and port.checksums.shift is Shift.IDLE:
            break
        time.sleep(0.01)
    assert small.admitted == 0 and agot == bgot == []


def test_the_close_stops_a_read_between_its_pieces(port: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A READ of many pieces at the close: refused (PeerUnreachable) after the piece in
    hand, not taken to its end (before: a 4096-page READ went on for minutes)."""
    gate, began = threading.Event(), threading.Event()
    real = port_mod.crc32c.crc_of

    def held(views: list[memoryview], value: int = 0) -> int:
        began.set()
        assert gate.wait(10)
        return real(views, value)

    monkeypatch.setattr(port_mod.crc32c, "crc_of", held)
    port, (big, _), _ = port
    huge = port.source(big.rkeys[0], 0, [big.ptr] * 4096, [PAGE] * 4096, None,
                       checksum=True, peer=(1, 0))
    got, ended, done = _done()
    huge.land(done)
    assert began.wait(10)
    port.close()
    gate.set()
    assert ended.wait(10) and len(got) == 1 and isinstance(got[0], PeerUnreachable), got
    huge.release()  # (refused: the link lets go of it, once)
    assert big.admitted == 0
    for _ in range(100):
        if not [t for t in threading.enumerate() if t.name == "read-crc"]:
            break
        time.sleep(0.01)
    assert port.checksums.shift is Shift.CLOSED
    assert not [t for t in threading.enumerate() if t.name == "read-crc"]
