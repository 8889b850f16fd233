"""Worker: a thread with its own loop, calls handed over, bounded slots."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from tests.helpers import async_test
from transferd.workers import Worker


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker("test-worker", None, capacity=2)
    w.start()
    yield w
    w.stop()


def test_runs_calls_on_its_own_thread(worker: Worker) -> None:
    assert worker.loop is not None and worker.loop.is_running()
    seen: list[str] = []
    done = threading.Event()

    def record(tag: str) -> None:
        seen.append(f"{tag}:{threading.current_thread().name}")
        done.set()

    worker.call(record, "x")
    assert done.wait(5)
    assert seen == ["x:test-worker"]
    assert worker.run_sync(lambda: threading.current_thread().name) == "test-worker"

    async def coro() -> int:
        await asyncio.sleep(0)
        return 42

    assert worker.run(coro()).result(5) == 42


def test_calls_keep_their_order(worker: Worker) -> None:
    seen: list[int] = []
    for i in range(200):
        worker.call(seen.append, i)
    assert worker.run_sync(lambda: len(seen)) == 200
    assert seen == list(range(200))


def test_stop_ends_the_thread() -> None:
    w = Worker("short-lived")
    w.start()
    w.stop()
    assert not w._thread.is_alive()
    w.stop()  # twice is harmless


def test_unpinnable_cpu_runs_unpinned() -> None:
    w = Worker("unpinnable", cpu=1 << 20)
    w.start()
    try:
        assert not w.pinned
        assert w.run_sync(lambda: 1 + 1) == 2
    finally:
        w.stop()


def test_pinned_when_possible() -> None:
    import os

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no sched_getaffinity")
    cpu = max(os.sched_getaffinity(0))
    w = Worker("pinned", cpu=cpu)
    w.start()
    try:
        assert w.pinned
        assert w.run_sync(lambda: os.sched_getaffinity(0)) == {cpu}
    finally:
        w.stop()


def test_bounded_slots(worker: Worker) -> None:
    assert worker.capacity == 2 and worker.in_flight == 0
    assert worker.has_slot()
    worker.take()
    assert worker.has_slot() and worker.in_flight == 1
    worker.take()
    assert not worker.has_slot() and worker.in_flight == 2
    worker.release()
    assert worker.has_slot() and worker.in_flight == 1
    worker.release()
    assert worker.in_flight == 0


@async_test(timeout=10)
async def test_wait_slot_waits_for_a_release(worker: Worker) -> None:
    await asyncio.wait_for(worker.wait_slot(), 1)  # free: returns at once
    worker.take()
    worker.take()
    first = asyncio.ensure_future(worker.wait_slot())
    second = asyncio.ensure_future(worker.wait_slot())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not first.done() and not second.done()
    worker.release()
    await asyncio.wait_for(first, 5)
    # One release lets one waiter through; it takes the slot, the other still waits.
    for _ in range(5):
        await asyncio.sleep(0)
    assert not second.done()
    worker.take()
    worker.release()
    await asyncio.wait_for(second, 5)
    worker.take()
    assert not worker.has_slot()
    worker.release()
    worker.release()
    assert worker.in_flight == 0


@async_test(timeout=10)
async def test_cancelled_waiter_does_not_swallow_a_release(worker: Worker) -> None:
    worker.take()
    worker.take()
    gone = asyncio.ensure_future(worker.wait_slot())
    keep = asyncio.ensure_future(worker.wait_slot())
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    worker.release()
    await asyncio.wait_for(keep, 5)
    assert gone.cancelled()
    worker.release()


@async_test(timeout=20)
async def test_many_submitters_never_exceed_capacity(worker: Worker) -> None:
    peak = 0
    done = 0

    async def submit() -> None:
        nonlocal peak, done
        if not worker.has_slot():
            await worker.wait_slot()
        worker.take()
        peak = max(peak, worker.in_flight)
        await asyncio.sleep(0.001)
        worker.release()
        done += 1

    await asyncio.gather(*(submit() for _ in range(100)))
    assert done == 100
    assert peak == worker.capacity  # full, never over
    assert worker.in_flight == 0
