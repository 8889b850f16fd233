"""Workers (transferd.workers): where a domain group runs, and the engine's slot table.

A LoopWorker is the caller's loop (a call from that loop runs at once, from another
thread it is scheduled there); a ThreadWorker is a thread with its own loop (every call
crosses over).  Both answer the watchdog's heartbeat.  Slots bound what is in flight.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.helpers import run
from transferd.workers import LoopWorker, Slots, ThreadWorker, make_worker


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


def test_slots_bound_what_is_in_flight_and_wake_one_waiter_per_release() -> None:
    async def main() -> None:
        s = Slots(2)
        s.take()
        s.take()
        assert not s.has_slot() and s.in_flight == 2
        woke: list[int] = []

        async def waiter(i: int) -> None:
            await s.wait_slot()
            s.take()
            woke.append(i)

        tasks = [asyncio.ensure_future(waiter(i)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert woke == []
        s.release()
        await asyncio.sleep(0.01)
        assert woke == [0] and s.in_flight == 2  # one slot, one waiter
        s.release()
        s.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert sorted(woke) == [0, 1, 2] and s.in_flight == 2

    run(main(), timeout=10)
    with pytest.raises(ValueError):
        Slots(0)
