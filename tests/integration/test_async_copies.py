"""The seed's async split copies (client/copies.py), with the host stand-in as the GPU.

The producer's stream is a :class:`StandinStream`; holding it plays "a kernel
still running on the producer's stream".  The remote tensors are on a real
daemon.  What is checked: the call returns while the producer is busy (never
synchronized), the SET leaves only after the copy's event, the queue's order
holds around it, and TRANSFERD_NO_ASYNC_COPY=1 falls back to synchronizing.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from client import Client
from tests.helpers import DaemonProcess, async_test
from tests.standin_stream import StandinDeviceMemory, StandinStream
from transferd.memory.staging import StagingPool

KiB = 1024


@pytest.fixture
def stream() -> Iterator[StandinStream]:
    s = StandinStream("producer")
    yield s
    s.close()


def _dev(data: bytes) -> StandinDeviceMemory:
    d = StandinDeviceMemory(len(data))
    d.host_array()[:] = np.frombuffer(data, dtype=np.uint8)
    return d


def _sha(b: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(b).hexdigest()


async def _until(pred, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pred():
            return True
        await asyncio.sleep(0.01)
    return False


@async_test(timeout=60)
async def test_device_to_remote_never_synchronizes_the_producer(
        daemon: DaemonProcess, stream: StandinStream) -> None:
    data = os.urandom(300 * KiB)
    dev = _dev(data)
    async with await Client.connect(daemon.url) as c, await Client.connect(daemon.url) as peek:
        c.use_copy_staging(StagingPool(128 * KiB, 4))
        buf = await c.alloc_buffer(len(data))
        stream.hold()  # a kernel still running on the producer's stream
        t0 = time.monotonic()
        await c.copy_from_device(buf.tensor(), (dev.ptr, dev.size), stream=stream)
        took = time.monotonic() - t0
        assert took < 1.0  # returned at once: nothing waited for the device
        await asyncio.sleep(0.05)
        sent = c.stats()["commands"]
        assert not sent.get("SET_TENSORS") and not sent.get("SET_TENSOR")
        assert bytes(await peek.get_tensor(buf.tensor(0, 64))) == bytes(64)
        stream.resume()  # the producer finishes; the dispatcher sends the SET

        async def landed() -> bool:
            return _sha(await peek.get_tensor(buf.tensor())) == _sha(data)

        assert await _until(landed)
        assert c.stats()["commands"].get("SET_TENSORS", 0) >= 1
        await c.synchronize()


@async_test(timeout=60)
async def test_queue_order_holds_around_a_copy(
        daemon: DaemonProcess, stream: StandinStream) -> None:
    data = os.urandom(200 * KiB)
    dev = _dev(data)
    async with await Client.connect(daemon.url) as c:
        c.use_copy_staging(StagingPool(64 * KiB, 2))  # smaller than the copy: back-pressure
        buf = await c.alloc_buffer(len(data) + 4096)
        stream.hold()
        c.set_tensor_async(buf.tensor(len(data), 8), b"before!!")
        # The copy needs 4 chunks of a pool of 2: it returns once 2 are free again,
        # so the stream is released from another thread while it waits.
        threading.Timer(0.1, stream.resume).start()
        await c.copy_from_device(buf.tensor(0, len(data)), (dev.ptr, dev.size), stream=stream)
        read = c.get_tensor_async(buf.tensor(0, len(data)))       # queued after the copy
        c.set_tensor_async(buf.tensor(0, 8), b"after!!!")           # a later write wins
        await c.synchronize()  # a flush point: waits for the copy queued before it
        assert _sha(read.result()) == _sha(data)  # the read saw the copy
        got = bytes(await c.get_tensor(buf.tensor()))
        assert got[:8] == b"after!!!" and got[8:len(data)] == data[8:]
        assert got[len(data):len(data) + 8] == b"before!!"


@async_test(timeout=60)
async def test_flush_point_waits_for_a_held_copy(
        daemon: DaemonProcess, stream: StandinStream) -> None:
    data = os.urandom(50 * KiB)
    dev = _dev(data)
    async with await Client.connect(daemon.url) as c:
        c.use_copy_staging(StagingPool(64 * KiB, 2))
        buf = await c.alloc_buffer(len(data))
        stream.hold()
        await c.copy_from_device(buf.tensor(), (dev.ptr, dev.size), stream=stream)
        threading.Timer(0.05, stream.resume).start()
        # A synchronous call is a flush point: the copy goes first, so it reads it.
        assert _sha(await c.get_tensor(buf.tensor())) == _sha(data)


@async_test(timeout=60)
async def test_remote_to_device_enqueues_on_the_consumer_stream(
        daemon: DaemonProcess, stream: StandinStream) -> None:
    data = os.urandom(150 * KiB)
    dev = StandinDeviceMemory(len(data))
    async with await Client.connect(daemon.url) as c:
        pool = StagingPool(64 * KiB, 4)
        c.use_copy_staging(pool)
        buf = await c.alloc_buffer(len(data))
        await c.set_tensor(buf.tensor(), data)
        stream.hold()  # the consumer is busy
        await c.copy_to_device((dev.ptr, dev.size), buf.tensor(), stream=stream)
        # Read into staging, H2D enqueued, not done: the consumer was not synchronized.
        assert not dev.host_array().any()
        stream.resume()
        stream.synchronize()
        assert _sha(dev.host_array().tobytes()) == _sha(data)
        for _ in range(100):
            if pool.free == pool.capacity:
                break
            await asyncio.sleep(0.01)
        assert pool.free == pool.capacity


@async_test(timeout=60)
async def test_no_async_copy_switch_synchronizes(
        daemon: DaemonProcess, stream: StandinStream, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSFERD_NO_ASYNC_COPY", "1")
    data = os.urandom(100 * KiB)
    dev = _dev(data)
    async with await Client.connect(daemon.url) as c:
        assert not c.switches.async_copy
        buf = await c.alloc_buffer(len(data))
        stream.hold()
        threading.Timer(0.2, stream.resume).start()
        t0 = time.monotonic()
        await c.copy_from_device(buf.tensor(), (dev.ptr, dev.size), stream=stream)
        assert time.monotonic() - t0 >= 0.15  # it waited for the producer
        assert c.stats()["commands"].get("SET_TENSOR") == 1
        assert _sha(await c.get_tensor(buf.tensor())) == _sha(data)
        back = StandinDeviceMemory(len(data))
        await c.copy_to_device((back.ptr, back.size), buf.tensor(), stream=stream)
        assert _sha(back.host_array().tobytes()) == _sha(data)  # done when it returns


def test_sync_client_copies_on_the_callers_current_stream(
        daemon: DaemonProcess, stream: StandinStream) -> None:
    """Issue 24.5: SyncClient runs calls on its own thread; the stream a copy without
    ``stream=`` goes on is the caller's current one, taken in the caller's thread (the
    client's thread has none: there the copy would go elsewhere)."""
    from client import SyncClient

    data = os.urandom(100 * KiB)
    dev = _dev(data)
    back = StandinDeviceMemory(len(data))
    with SyncClient.connect(daemon.url) as c:
        c.use_copy_staging(StagingPool(64 * KiB, 4))
        buf = c.alloc_buffer(len(data))
        with stream:  # this thread's current stream
            c.copy_from_device(buf.tensor(), (dev.ptr, dev.size))
            c.synchronize()
            c.copy_to_device((back.ptr, back.size), buf.tensor())
        assert _sha(c.get_tensor(buf.tensor())) == _sha(data)
    stream.synchronize()
    assert _sha(back.host_array().tobytes()) == _sha(data)
    ops = [e.op for e in stream.log]
    assert ops.count("d2h") == 2 and ops.count("h2d") == 2  # both copies, on that stream


@async_test(timeout=60)
async def test_event_waiter_threads_are_bounded_whatever_the_streams(
        daemon: DaemonProcess) -> None:
    """Issue 24.10: one waiter thread per stream ever used grew without bound."""
    from client.copies import MAX_WAITERS

    def waiters() -> int:
        return sum(1 for t in threading.enumerate() if t.name.startswith("transferd-copies"))

    before = waiters()
    streams = [StandinStream(f"producer-{i}") for i in range(3 * MAX_WAITERS)]
    try:
        async with await Client.connect(daemon.url) as c:
            c.use_copy_staging(StagingPool(64 * KiB, 4))
            buf = await c.alloc_buffer(len(streams) * KiB)
            for i, s in enumerate(streams):
                dev = _dev(bytes([i]) * KiB)
                await c.copy_from_device(buf.tensor(i * KiB, KiB), (dev.ptr, dev.size),
                                         stream=s)
                await c.synchronize()
            assert waiters() - before <= MAX_WAITERS
            got = bytes(await c.get_tensor(buf.tensor()))
            assert got == b"".join(bytes([i]) * KiB for i in range(len(streams)))
    finally:
        for s in streams:
            s.close()


@async_test(timeout=60)
async def test_a_copy_the_producer_failed_is_never_sent(
        daemon: DaemonProcess, stream: StandinStream) -> None:
    """Issue 24.2 on the client: its staging holds nothing of the device's bytes, so its
    SET must not go; the fault is raised at the next flush point, once."""
    from transferd.protocol.errors import Internal

    dev = _dev(os.urandom(64 * KiB))
    async with await Client.connect(daemon.url) as c:
        c.use_copy_staging(StagingPool(64 * KiB, 2))
        buf = await c.alloc_buffer(dev.size)
        await c.set_tensor(buf.tensor(), b"\x01" * dev.size)
        stream.fail()
        await c.copy_from_device(buf.tensor(), (dev.ptr, dev.size), stream=stream)
        with pytest.raises(Internal, match="fault"):
            await c.synchronize()
        assert bytes(await c.get_tensor(buf.tensor())) == b"\x01" * dev.size
        stream.heal()
        await c.copy_from_device(buf.tensor(), (dev.ptr, dev.size), stream=stream)
        await c.synchronize()
        assert bytes(await c.get_tensor(buf.tensor())) == bytes(dev.host_array())
