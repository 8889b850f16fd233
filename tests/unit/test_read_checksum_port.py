"""The engine port's checksum thread (ChecksummedSource: a peer's verified READ past
CRC_INLINE_MAX of host memory) once the engine has closed it.

EnginePort.close shut the thread down and forgot it; the next long verified READ (a
link still open while the engine's groups close) made a new one that nobody shut down
(one thread left per closed engine: an inproc node's process kept it), and a READ whose
submit raced the shutdown raised RuntimeError, not a TransferdError, out of the link's
event handling (its placement never let go).  Now a closed port takes no checksum: the
READ's ``land`` raises PeerUnreachable (the tcp link refuses the READ and lets go of
its placement once, as for a device READ whose staging fails), and no thread starts.
"""

from __future__ import annotations

import threading

import pytest

from transferd.engine.immcounter import ImmCounter
from transferd.engine.port import CRC_INLINE_MAX, EnginePort
from transferd.engine.regions import RegionTable
from transferd.memory import Buffer
from transferd.protocol.errors import TransferdError

SIZE = CRC_INLINE_MAX + 4096  # one page past the inline limit


def _crc_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("read-crc")]


def test_a_closed_port_takes_no_checksum_and_starts_no_thread() -> None:
    buf = Buffer.host(1, SIZE)
    table = RegionTable()
    region = table.register(buf, 1, "r")
    port = EnginePort(table, ImmCounter(), lambda *a: None, lambda s: None)
    try:
        # Open: the checksum is taken on the port's thread.
        src = port.source(region.rkeys[0], 0, [region.ptr], [SIZE], None, checksum=True)
        assert src.deferred
        got: list[TransferdError | None] = []
        ended = threading.Event()

        def done(err: TransferdError | None) -> None:
            got.append(err)
            ended.set()

        src.land(done)
        assert ended.wait(10) and got == [None] and src.crc is not None
        src.release()
        port.close()
        for t in _crc_threads():
            t.join(5)
        before = len(_crc_threads())
        # Closed: refused at once, typed, on no new thread.
        src = port.source(region.rkeys[0], 0, [region.ptr], [SIZE], None, checksum=True)
        got.clear()
        ended.clear()
        try:
            src.land(done)
        except TransferdError as exc:  # (or raised: the link answers it the same way)
            done(exc)
        assert ended.wait(10)
        assert len(got) == 1 and isinstance(got[0], TransferdError), got
        assert len(_crc_threads()) == before == 0, _crc_threads()
        src.release()
        assert region.admitted == 0
    finally:
        port.close()
        buf.release()


def test_checksums_queued_at_the_close_are_not_taken_and_let_go_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: each queued checksum was taken after the close all the same (a 4 GiB
    READ's is seconds of a core, for a link already gone), and one whose link's loop
    had closed (its ``done`` raising RuntimeError) was never let go."""
    from transferd.engine import port as port_mod

    gate, began = threading.Event(), threading.Event()
    taken: list[int] = []
    real = port_mod.crc32c.crc_of

    def slow(views: list[memoryview], value: int = 0) -> int:
        taken.append(1)
        began.set()
        assert gate.wait(10)
        return real(views, value)

    monkeypatch.setattr(port_mod.crc32c, "crc_of", slow)
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

        def gone(err: TransferdError | None) -> None:  # a closed loop's call_soon_threadsafe
            got.append(err)
            ended.release()
            raise RuntimeError("Event loop is closed")

        srcs = [port.source(region.rkeys[0], 0, [region.ptr], [SIZE], None, checksum=True)
                for _ in range(3)]
        srcs[0].land(done)
        assert began.wait(10)  # the first is being taken; two wait their turn
        srcs[1].land(done)
        srcs[2].land(gone)
        port.close()
        gate.set()
        for _ in range(3):
            assert ended.acquire(timeout=10)
        assert taken == [1], "a checksum queued at the close was taken"
        assert got[0] is None
        assert all(isinstance(e, TransferdError) for e in got[1:]), got
        srcs[0].release()
        srcs[1].release()  # (srcs[2]: let go by the port, its done having raised)
        assert region.admitted == 0
    finally:
        port.close()
        buf.release()
