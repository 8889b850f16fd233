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
