"""A device READ's (or write's) staging let go once when its copy reports after its
link's loop closed.

StagedSource.land enqueues the D2H copies and hands ``done`` to the event waiter; the
tcp link's ``done`` is ``loop.call_soon_threadsafe``, which raises RuntimeError once
that loop is closed (the engine stopping).  The waiter only logged it: nobody gave the
staging chunks back nor let go of the region's admission (the region could never be
deregistered cleanly, the pool was short of those chunks for good).  StagedPlacement
(a write into device memory) the same.  Now either is let go there, once: not again
by the link, nor by an abandon racing the copy's end.  On the host stand-in stream
(tests/standin_stream.py), as every staging test.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.helpers import wait_until
from tests.standin_stream import StandinDeviceMemory, StandinStream
from transferd.engine.port import Hold, StagedPlacement, StagedSource
from transferd.engine.regions import Region, RegionTable
from transferd.memory import Buffer
from transferd.memory.staging import DeviceIO, StagingPool
from transferd.memory.streams import EventWaiter
from transferd.protocol.errors import TransferdError

CHUNK = 64 * 1024
CHUNKS = 2


@pytest.fixture
def io() -> Iterator[DeviceIO]:
    stream = StandinStream()
    waiter = EventWaiter(stream)
    yield DeviceIO(stream, waiter, StagingPool(CHUNK, CHUNKS))
    waiter.close()
    stream.close()


@pytest.fixture
def region() -> Iterator[Region]:
    """What the READ or write admits (a region's admission, let go once)."""
    buf = Buffer.host(1, 4096)
    yield RegionTable().register(buf, 1, "rw")
    buf.release()


def _closed_loop_done(calls: list[TransferdError | None]) -> Callable[[Any], None]:
    """A link's ``done`` whose loop is closed: what the tcp domain hands ``land``."""
    loop = asyncio.new_event_loop()
    loop.close()

    def done(err: TransferdError | None) -> None:
        calls.append(err)
        loop.call_soon_threadsafe(lambda: None)  # RuntimeError: Event loop is closed

    return done



def _settled(io: DeviceIO, region: Region) -> bool:
    return io.pool.free == CHUNKS and region.admitted == 0


def _source(io: DeviceIO, region: Region, dev: StandinDeviceMemory) -> StagedSource:
    chunks = [io.pool.try_acquire() for _ in range(CHUNKS)]
    assert all(c is not None for c in chunks)
    return StagedSource(io, chunks, [(dev.ptr, CHUNK * CHUNKS)], region.admit(None),
                        CHUNK * CHUNKS)


def _exactly_once(io: DeviceIO, region: Region) -> None:
    """Let go, and only once: every chunk back, none twice (a chunk in the free list
    twice would be handed to two READs at once), the admission let go."""
    assert wait_until(lambda: _settled(io, region)), (io.pool.free, region.admitted)
    time.sleep(0.02)  # (a second let-go would come from the waiter's thread now)
    assert io.pool.free == CHUNKS and io.pool.in_use == 0
    got = [io.pool.try_acquire() for _ in range(CHUNKS + 1)]
    assert got[-1] is None and len({id(c) for c in got[:-1]}) == CHUNKS
    for c in got[:-1]:
        assert c is not None
        io.pool.release(c)


def test_a_device_reads_copy_reporting_to_a_closed_loop_lets_go_once(
        io: DeviceIO, region: Region) -> None:
    stream = io.stream
    assert isinstance(stream, StandinStream)
    dev = StandinDeviceMemory(CHUNK * CHUNKS)
    src = _source(io, region, dev)
    calls: list[TransferdError | None] = []
    stream.hold()
    src.land(_closed_loop_done(calls))
    time.sleep(0.02)
    assert calls == [] and region.admitted == 1 and io.pool.free == 0  # (copy pending)
    stream.resume()
    # Before: the waiter logged the RuntimeError and nobody let go (admitted stayed 1).
    _exactly_once(io, region)
    assert calls == [None] and src.hold is Hold.LET_GO
    src.release()  # (a link that did come back to it: nothing let go twice)
    src.abandon()
    _exactly_once(io, region)


def test_an_abandon_racing_the_copys_end_lets_go_once(io: DeviceIO, region: Region) -> None:
    """The link's loop abandons it (its peer hung up) just as the copy ends and ``done``
    meets the loop closed: two let-goes race (the abandon's watch on the copy, and the
    refused ``done``), one happens."""
    stream = io.stream
    assert isinstance(stream, StandinStream)
    dev = StandinDeviceMemory(CHUNK * CHUNKS)
    for k in range(200):
        src = _source(io, region, dev)
        calls: list[TransferdError | None] = []
        stream.hold()
        src.land(_closed_loop_done(calls))
        go = threading.Barrier(2)

        def abandon(src: StagedSource = src, go: threading.Barrier = go) -> None:
            go.wait(5)
            src.abandon()

        t = threading.Thread(target=abandon)
        t.start()
        go.wait(5)
        if k % 2:
            time.sleep(0.0005)  # (every other time, the copy a little ahead)
        stream.resume()
        t.join(5)
        _exactly_once(io, region)
        assert src.hold is Hold.LET_GO


def test_a_device_writes_copy_reporting_to_a_closed_loop_lets_go_once(
        io: DeviceIO, region: Region) -> None:
    stream = io.stream
    assert isinstance(stream, StandinStream)
    dev = StandinDeviceMemory(CHUNK * CHUNKS)
    chunks = [io.pool.try_acquire() for _ in range(CHUNKS)]
    n = CHUNK + 100  # (one chunk and a bit of the other: both handed to copies)
    place = StagedPlacement(io, chunks, [(dev.ptr, n)], region.admit(None), n)
    place.views[0][:] = b"d" * CHUNK
    calls: list[TransferdError | None] = []
    stream.hold()
    place.land(_closed_loop_done(calls))
    time.sleep(0.02)
    assert calls == [] and region.admitted == 1
    stream.resume()
    _exactly_once(io, region)
    assert calls == [None] and place.hold is Hold.LET_GO
    assert bytes(dev.host_array()[:CHUNK]) == b"d" * CHUNK  # (its copy did land)
    place.release()  # (nothing twice)
    _exactly_once(io, region)
