"""Workers (transferd.workers) and the engine's slot table.

A ThreadWorker is a thread with its own loop (every call crosses over); a LoopWorker is
the caller's loop (a call from that loop runs at once, from another thread it is
scheduled there).  Both answer the watchdog's heartbeat.  Slots bound what is in flight.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from tests.helpers import async_test, run
from transferd.workers import LoopWorker, Slots, ThreadWorker, make_worker


@pytest.fixture
def slots() -> Slots:
    return Slots(2)


@pytest.fixture
def worker() -> Iterator[ThreadWorker]:
    w = ThreadWorker("test-worker", None)
    w.start()
    yield w
    w.stop()


def test_runs_calls_on_its_own_thread(worker: ThreadWorker) -> None:
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


def test_calls_keep_their_order(worker: ThreadWorker) -> None:
    seen: list[int] = []
    for i in range(200):
        worker.call(seen.append, i)
    assert worker.run_sync(lambda: len(seen)) == 200
    assert seen == list(range(200))


def test_stop_ends_the_thread() -> None:
    w = ThreadWorker("short-lived")
    w.start()
    w.stop()
    assert not w._thread.is_alive()
    w.stop()  # twice is harmless


def test_unpinnable_cpu_runs_unpinned() -> None:
    w = ThreadWorker("unpinnable", cpu=1 << 20)
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
    w = ThreadWorker("pinned", cpu=cpu)
    w.start()
    try:
        assert w.pinned
        assert w.run_sync(lambda: os.sched_getaffinity(0)) == {cpu}
    finally:
        w.stop()


def test_bounded_slots(slots: Slots) -> None:
    assert slots.capacity == 2 and slots.in_flight == 0
    assert slots.has_slot()
    slots.take()
    assert slots.has_slot() and slots.in_flight == 1
    slots.take()
    assert not slots.has_slot() and slots.in_flight == 2
    slots.release()
    assert slots.has_slot() and slots.in_flight == 1
    slots.release()
    assert slots.in_flight == 0


@async_test(timeout=10)
async def test_wait_slot_waits_for_a_release(slots: Slots) -> None:
    await asyncio.wait_for(slots.wait_slot(), 1)  # free: returns at once
    slots.take()
    slots.take()
    first = asyncio.ensure_future(slots.wait_slot())
    second = asyncio.ensure_future(slots.wait_slot())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not first.done() and not second.done()
    slots.release()
    await asyncio.wait_for(first, 5)
    # One release lets one waiter through; it takes the slot, the other still waits.
    for _ in range(5):
        await asyncio.sleep(0)
    assert not second.done()
    slots.take()
    slots.release()
    await asyncio.wait_for(second, 5)
    slots.take()
    assert not slots.has_slot()
    slots.release()
    slots.release()
    assert slots.in_flight == 0


@async_test(timeout=10)
async def test_cancelled_waiter_does_not_swallow_a_release(slots: Slots) -> None:
    slots.take()
    slots.take()
    gone = asyncio.ensure_future(slots.wait_slot())
    keep = asyncio.ensure_future(slots.wait_slot())
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    slots.release()
    await asyncio.wait_for(keep, 5)
    assert gone.cancelled()
    slots.release()


@async_test(timeout=20)
async def test_many_submitters_never_exceed_capacity(slots: Slots) -> None:
    peak = 0
    done = 0

    async def submit() -> None:
        nonlocal peak, done
        if not slots.has_slot():
            await slots.wait_slot()
        slots.take()
        peak = max(peak, slots.in_flight)
        await asyncio.sleep(0.001)
        slots.release()
        done += 1

    await asyncio.gather(*(submit() for _ in range(100)))
    assert done == 100
    assert peak == slots.capacity  # full, never over
    assert slots.in_flight == 0


def test_a_loop_worker_runs_a_call_at_once_on_its_loop() -> None:
    async def main() -> None:
        w = LoopWorker("t")
        w.start()
        assert w.loop is asyncio.get_running_loop() and w.on_daemon_loop
        seen: list[int] = []
        w.call(seen.append, 1)
        assert seen == [1]  # on the caller's stack: no hand-off, no wake-up
        assert w.run_sync(lambda: 7) == 7  # no wait on its own loop
        assert await asyncio.wrap_future(w.run(asyncio.sleep(0, result=8))) == 8

    run(main(), timeout=10)


def test_a_loop_worker_called_from_another_thread_runs_the_call_on_its_loop() -> None:
    async def main() -> None:
        w = LoopWorker("t")
        w.start()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        where: list[int] = []

        def fn() -> None:
            where.append(threading.get_ident())
            done.set_result(None)

        other = threading.Thread(target=w.call, args=(fn,))
        other.start()
        other.join(5)
        await asyncio.wait_for(done, 5)
        assert where == [threading.get_ident()]
        # run_sync from another thread waits for the loop, which is free to run it.
        got: list[int] = []
        t = threading.Thread(target=lambda: got.append(w.run_sync(lambda: 5, timeout=5)))
        t.start()
        for _ in range(500):
            if got:
                break
            await asyncio.sleep(0.01)
        t.join(5)
        assert got == [5]

    run(main(), timeout=10)


def test_a_thread_worker_runs_calls_on_its_own_thread_and_stops() -> None:
    w = ThreadWorker("t")
    w.start()
    try:
        assert not w.on_daemon_loop and w.kind == "thread"
        assert w.run_sync(threading.get_ident) != threading.get_ident()
        ran = threading.Event()
        w.call(ran.set)
        assert ran.wait(5)
        before = w.last_beat
        time.sleep(0.01)
        w.beat()
        for _ in range(500):
            if w.last_beat > before:
                break
            time.sleep(0.01)
        assert w.last_beat > before
    finally:
        w.stop()
    assert not w._thread.is_alive()
    w.stop()  # again: nothing to do


def test_make_worker_knows_the_kinds_and_nothing_else() -> None:
    assert isinstance(make_worker("loop", "x", 0), LoopWorker)
    assert isinstance(make_worker("thread", "x", None), ThreadWorker)
    with pytest.raises(ValueError, match="unknown worker kind 'auto'"):
        make_worker("auto", "x", None)  # the engine resolves auto first


def test_a_missing_uvloop_is_its_own_error_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 24.11: it was imported in the worker's thread, so the start waited 10 s
    # and said only "worker ... failed to start".
    import sys

    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if it were not installed
    w = ThreadWorker("test-no-uvloop", None)
    t0 = time.monotonic()
    with pytest.raises(ImportError, match="uvloop"):
        w.start()
    assert time.monotonic() - t0 < 2


def test_a_worker_that_fails_in_its_thread_says_why_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import transferd.workers.worker as wmod

    def broken(cpu: int) -> bool:
        raise OSError("no such core")

    monkeypatch.setattr(wmod, "pin_current_thread", broken)
    w = ThreadWorker("test-broken", 0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="no such core"):
        w.start()
    assert time.monotonic() - t0 < 2
