"""The staging pool, the pipeline and event-gated counting, on the host stand-in stream."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.helpers import wait_until
from tests.standin_stream import StandinDeviceMemory, StandinStream
from transferd.engine.immcounter import ImmCounter
from transferd.memory.staging import (
    Claim,
    DeviceIO,
    GatedLanding,
    StagingPool,
    device_to_wire,
    wire_to_device,
)
from transferd.memory.streams import DeviceFault, EventWaiter
from transferd.protocol.errors import BadRequest

CHUNK = 64 * 1024


@pytest.fixture
def stream() -> Iterator[StandinStream]:
    s = StandinStream()
    yield s
    s.close()


@pytest.fixture
def waiter(stream: StandinStream) -> Iterator[EventWaiter]:
    w = EventWaiter(stream)
    yield w
    w.close()


def _run(coro: object, timeout: float = 20) -> object:
    async def main() -> object:
        return await asyncio.wait_for(coro, timeout)  # type: ignore[arg-type]
    return asyncio.run(main())


def test_pool_is_bounded_reused_and_waits() -> None:
    pool = StagingPool(CHUNK, 2)

    async def main() -> None:
        a = await pool.acquire()
        b = await pool.acquire()
        assert pool.free == 0 and pool.try_acquire() is None
        third = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.01)
        assert not third.done()  # back-pressure: nothing was allocated for it
        pool.release(a)
        c = await asyncio.wait_for(third, 5)
        assert c is a  # the same pinned chunk, reused
        pool.release(b)
        pool.release(c)
        assert pool.free == 2 and pool.max_in_use == 2 and pool.waited == 1

    _run(main())
    assert len({id(ch) for ch in pool._chunks}) == 2


def test_pool_release_from_another_thread_wakes_the_waiter() -> None:
    pool = StagingPool(CHUNK, 1)

    async def main() -> None:
        a = await pool.acquire()
        t = threading.Timer(0.02, pool.release, (a,))
        t.start()
        got = await asyncio.wait_for(pool.acquire(), 5)
        assert got is a
        t.join()

    _run(main())


def test_pool_cancelled_waiter_loses_no_chunk() -> None:
    pool = StagingPool(CHUNK, 1)

    async def main() -> None:
        a = await pool.acquire()
        w = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0)
        w.cancel()
        pool.release(a)
        await asyncio.sleep(0.01)
        assert pool.free == 1
        assert (await asyncio.wait_for(pool.acquire(), 5)) is a

    _run(main())


def test_pool_refuses_nonsense_sizes() -> None:
    with pytest.raises(BadRequest):
        StagingPool(0, 1)


def _device_with(data: bytes) -> StandinDeviceMemory:
    dev = StandinDeviceMemory(len(data))
    dev.host_array()[:] = np.frombuffer(data, dtype=np.uint8)
    return dev


def test_get_pipeline_overlaps_copy_and_send(waiter: EventWaiter) -> None:
    stream = waiter.stream
    assert isinstance(stream, StandinStream)
    stream.delay_s = 0.01
    data = os.urandom(CHUNK * 6 + 1234)
    dev = _device_with(data)
    pool = StagingPool(CHUNK, 3)
    a, b = socket.socketpair()
    received = bytearray()

    def reader() -> None:
        while len(received) < len(data):
            chunk = b.recv(1 << 20)
            if not chunk:
                return
            received.extend(chunk)

    t = threading.Thread(target=reader)
    t.start()
    sends: list[tuple[float, float, int]] = []

    async def main() -> int:
        loop = asyncio.get_running_loop()
        a.setblocking(False)

        async def send(view: memoryview) -> None:
            start = time.monotonic()
            copies_enqueued = stream._q.qsize() + len(stream.log)
            await loop.sock_sendall(a, view)
            await asyncio.sleep(0.015)  # a slow wire
            sends.append((start, time.monotonic(), copies_enqueued))

        return await device_to_wire(DeviceIO(stream, waiter, pool), dev.ptr, len(data), send)

    n = _run(main())
    a.close()
    t.join(10)
    b.close()
    assert n == 7
    assert hashlib.sha256(received).digest() == hashlib.sha256(data).digest()
    copies = [e for e in stream.log if e.op == "d2h"]
    assert len(copies) == 7
    for k in range(len(copies) - 1):
        # Copy k+1 was on the stream, and ran, while chunk k was being sent.
        assert copies[k + 1].start < sends[k][1], k
    assert pool.free == pool.capacity


def test_get_pipeline_waits_for_staging_never_grows(waiter: EventWaiter) -> None:
    # Two GETs share a pool of one chunk: one waits for the other's chunk.
    data = [os.urandom(CHUNK * 5), os.urandom(CHUNK * 3 + 5)]
    devs = [_device_with(d) for d in data]
    pool = StagingPool(CHUNK, 1)
    outs = [bytearray(), bytearray()]

    def sender(out: bytearray):  # type: ignore[no-untyped-def]
        async def send(view: memoryview) -> None:
            out.extend(view)
            await asyncio.sleep(0.001)
        return send

    async def main() -> list[int]:
        return list(await asyncio.gather(*(
            device_to_wire(DeviceIO(waiter.stream, waiter, pool), d.ptr, d.size, sender(o),
                           depth=4)
            for d, o in zip(devs, outs, strict=True))))

    assert _run(main()) == [5, 4]
    assert [bytes(o) for o in outs] == data
    assert pool.max_in_use == 1 and pool.waited >= 1 and pool.free == 1


def test_get_pipeline_failed_send_returns_every_chunk(waiter: EventWaiter) -> None:
    dev = _device_with(os.urandom(CHUNK * 4))
    pool = StagingPool(CHUNK, 3)

    async def send(view: memoryview) -> None:
        raise ConnectionResetError("client went away")

    async def main() -> None:
        with pytest.raises(ConnectionResetError):
            await device_to_wire(DeviceIO(waiter.stream, waiter, pool), dev.ptr, dev.size, send,
                                 depth=3)
        for _ in range(100):
            if pool.free == pool.capacity:
                return
            await asyncio.sleep(0.01)

    _run(main())
    assert pool.free == pool.capacity


def test_set_pipeline_lands_on_the_device(waiter: EventWaiter) -> None:
    data = os.urandom(CHUNK * 3 + 77)
    dev = StandinDeviceMemory(len(data))
    pool = StagingPool(CHUNK, 2)
    a, b = socket.socketpair()
    t = threading.Thread(target=a.sendall, args=(data,))
    t.start()

    async def main() -> int:
        loop = asyncio.get_running_loop()
        b.setblocking(False)

        async def receive(view: memoryview) -> None:
            got = 0
            while got < len(view):
                n = await loop.sock_recv_into(b, view[got:])
                assert n, "sender closed early"
                got += n

        return await wire_to_device(DeviceIO(waiter.stream, waiter, pool), dev.ptr, len(data),
                                    receive)

    n = _run(main())
    t.join(10)
    a.close()
    b.close()
    assert n == 4
    assert hashlib.sha256(dev.host_array().tobytes()).digest() == hashlib.sha256(data).digest()
    assert pool.free == pool.capacity


def test_immediate_counted_only_after_the_device_copy(waiter: EventWaiter) -> None:
    stream = waiter.stream
    assert isinstance(stream, StandinStream)
    pool = StagingPool(CHUNK, 1)
    dev = StandinDeviceMemory(CHUNK)
    counter = ImmCounter()
    fired = threading.Event()
    counter.expect(7, 1, fired.set)
    chunk = pool.try_acquire()
    assert chunk is not None
    chunk.view[:100] = b"k" * 100  # the peer's bytes reached staging
    stream.hold()
    landing = GatedLanding(DeviceIO(stream, waiter, pool))
    landing.land(chunk, [(dev.ptr + 10, 0, 100)], lambda fault: counter.add(7))
    time.sleep(0.05)
    # In staging, not on the device: nothing is counted, the chunk is still held.
    assert counter.value(7) == 0 and not fired.is_set() and pool.free == 0
    assert landing.landing == 1
    stream.resume()
    assert fired.wait(5)
    assert bytes(dev.host_array()[10:110]) == b"k" * 100
    for _ in range(100):
        if pool.free == 1:
            break
        time.sleep(0.01)
    assert pool.free == 1 and landing.landing == 0


def test_gated_landing_checks_pieces_against_the_chunk(waiter: EventWaiter) -> None:
    pool = StagingPool(CHUNK, 1)
    chunk = pool.try_acquire()
    assert chunk is not None
    with pytest.raises(BadRequest):
        GatedLanding(DeviceIO(waiter.stream, waiter, pool)).land(
            chunk, [(0, CHUNK - 4, 8)], lambda fault: None)


def test_event_waiter_survives_a_failing_callback(waiter: EventWaiter) -> None:
    done = threading.Event()

    def boom(_fault: object) -> None:
        raise RuntimeError("callback bug")

    waiter.watch(waiter.stream.record(), boom)
    waiter.watch(waiter.stream.record(), lambda _fault: done.set())
    assert done.wait(5)



def test_a_cancelled_get_keeps_its_staging_until_the_copies_ended(waiter: EventWaiter) -> None:
    # Issue 24.1: a GET cancelled while its D2H copies are queued must not hand
    # their chunks to the next user: the device would still write into them.
    stream = waiter.stream
    assert isinstance(stream, StandinStream)
    dev = _device_with(os.urandom(CHUNK * 4))
    pool = StagingPool(CHUNK, 2)
    io = DeviceIO(stream, waiter, pool)

    async def send(view: memoryview) -> None:
        pass

    async def main() -> None:
        stream.hold()  # the copies are on the stream, not done
        task = asyncio.ensure_future(device_to_wire(io, dev.ptr, dev.size, send, depth=2))
        for _ in range(200):
            if pool.free == 0:
                break
            await asyncio.sleep(0.005)
        assert pool.free == 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert pool.free == 0, "staging went back while its copies were still queued"
        assert pool.try_acquire() is None
        stream.resume()

    _run(main())
    assert wait_until(lambda: pool.free == pool.capacity)


def test_a_cancelled_set_keeps_its_staging_until_the_copy_ended(waiter: EventWaiter) -> None:
    stream = waiter.stream
    assert isinstance(stream, StandinStream)
    dev = StandinDeviceMemory(CHUNK)
    pool = StagingPool(CHUNK, 1)
    io = DeviceIO(stream, waiter, pool)

    async def receive(view: memoryview) -> None:
        view[:] = b"s" * len(view)

    async def main() -> None:
        stream.hold()
        task = asyncio.ensure_future(wire_to_device(io, dev.ptr, CHUNK, receive))
        await asyncio.sleep(0.05)  # received, its H2D copy queued and waited on
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert pool.free == 0, "staging went back while the device still read it"
        stream.resume()

    _run(main())
    assert wait_until(lambda: pool.free == 1)
    assert bytes(dev.host_array()) == b"s" * CHUNK


def test_a_claim_goes_back_after_its_fence_only(waiter: EventWaiter) -> None:
    stream = waiter.stream
    assert isinstance(stream, StandinStream)
    pool = StagingPool(CHUNK, 2)
    claim = Claim(DeviceIO(stream, waiter, pool))

    async def main() -> None:
        await claim.take(2)
        stream.hold()
        claim.fence()
        claim.release()
        claim.release()  # idempotent
        await asyncio.sleep(0.05)
        assert pool.free == 0
        stream.resume()

    _run(main())
    assert wait_until(lambda: pool.free == 2)
    # Ended before its fence (a copy may be on the stream already): the event recorded
    # at release covers it.
    unfenced = Claim(DeviceIO(stream, waiter, pool))
    assert unfenced.try_take() is not None
    stream.hold()
    unfenced.release()
    time.sleep(0.05)
    assert pool.free == 1
    stream.resume()
    assert wait_until(lambda: pool.free == 2)


def test_a_device_fault_fails_the_wait_and_lands_nothing(waiter: EventWaiter) -> None:
    # Issue 24.2: a failed device copy is never counted, acknowledged or sent.
    stream = waiter.stream
    assert isinstance(stream, StandinStream)
    pool = StagingPool(CHUNK, 2)
    io = DeviceIO(stream, waiter, pool)
    counter = ImmCounter()
    told: list[object] = []
    got = threading.Event()
    dev = _device_with(b"d" * CHUNK)
    chunk = pool.try_acquire()
    assert chunk is not None
    chunk.view[:8] = b"k" * 8
    stream.fail()

    def then(fault: object) -> None:
        told.append(fault)
        if fault is None:
            counter.add(9)
        got.set()

    GatedLanding(io).land(chunk, [(dev.ptr, 0, 8)], then)
    assert got.wait(5)
    assert isinstance(told[0], DeviceFault) and counter.value(9) == 0
    assert bytes(dev.host_array()[:8]) == b"d" * 8  # the copy never ran
    assert wait_until(lambda: pool.free == 2)
    sent: list[bytes] = []

    async def send(view: memoryview) -> None:
        sent.append(bytes(view))

    async def main() -> None:
        stream.fill(dev.ptr, 0, 8)
        with pytest.raises(DeviceFault):
            await waiter.wait(stream.record())
        with pytest.raises(DeviceFault):
            await device_to_wire(io, dev.ptr, CHUNK, send)

    _run(main())
    assert sent == []  # stale staging was never sent for it
    assert wait_until(lambda: pool.free == 2)
    stream.heal()

    async def healed() -> None:
        await waiter.wait(stream.record())
        await device_to_wire(io, dev.ptr, CHUNK, send)

    _run(healed())
    assert sent == [b"d" * CHUNK]
