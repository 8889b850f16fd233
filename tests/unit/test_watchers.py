"""The watcher set without a daemon: words grouped per array, changes merged while one is
in flight, caps, and the thread slowing down once nothing changes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from transferd.engine.watchers import SCALAR_READS, Watchers
from transferd.protocol.errors import OutOfMemory


def wait(pred: object, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():  # type: ignore[operator]
            return True
        time.sleep(0.001)
    return False


@pytest.mark.parametrize("count", [1, SCALAR_READS, SCALAR_READS + 1, 512])
def test_every_watched_word_of_an_array_reports_its_own_change(count: int) -> None:
    """Both read paths (one by one, and the gather past SCALAR_READS)."""
    ws = Watchers(idle_poll_s=1e-3, max_per_owner=512)
    words = np.zeros(512, dtype=np.uint64)
    seen: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def cb(i: int):  # type: ignore[no-untyped-def]
        def on(old: int, new: int) -> None:
            with lock:
                seen.append((i, old, new))
        return on

    for i in range(count):
        ws.add("conn", "page", words, i, cb(i))
    try:
        for i in range(0, count, max(1, count // 7)):
            words[i] = i + 100
        want = {(i, 0, i + 100) for i in range(0, count, max(1, count // 7))}
        assert wait(lambda: len(seen) >= len(want)), seen
        time.sleep(0.02)
        assert set(seen) == want and len(seen) == len(want)
    finally:
        ws.close()


def test_changes_while_one_is_in_flight_are_merged() -> None:
    ws = Watchers()
    words = np.zeros(8, dtype=np.uint64)
    got: list[tuple[int, int]] = []
    w = ws.add("conn", "k", words, 3, lambda o, n: got.append((o, n)), handoff=True)
    try:
        words[3] = 1
        assert wait(lambda: got == [(0, 1)])
        words[3] = 2
        words[3] = 3
        time.sleep(0.05)
        assert got == [(0, 1)]  # not delivered yet: nothing more is sent
        w.delivered()
        assert wait(lambda: got == [(0, 1), (1, 3)]), got
    finally:
        ws.close()


def test_caps_per_owner_and_per_daemon_and_what_closing_frees() -> None:
    ws = Watchers(max_watchers=5, max_per_owner=3)
    words = np.zeros(8, dtype=np.uint64)
    try:
        for i in range(3):
            ws.add("a", "ka", words, i, lambda o, n: None)
        with pytest.raises(OutOfMemory, match="per connection"):
            ws.add("a", "ka", words, 4, lambda o, n: None)
        ws.add("b", "kb", words, 5, lambda o, n: None)
        ws.add("b", "kb", words, 6, lambda o, n: None)
        with pytest.raises(OutOfMemory, match="at most 5 words"):
            ws.add("c", "kc", words, 7, lambda o, n: None)
        assert len(ws.owner_closed("a")) == 3 and len(ws) == 2
        ws.add("c", "kc", words, 7, lambda o, n: None)
        assert len(ws) == 3
    finally:
        ws.close()


def test_the_thread_slows_down_when_nothing_changes_and_speeds_up_on_a_change() -> None:
    """Polls a second, not latencies (those are benchmarks.watchers'): about 100 while
    idle at a 10 ms pace, against about 20,000 at full pace; and after a change it is
    back at full pace, so it polls far more in the next 30 ms than idle in 100 ms."""
    ws = Watchers(idle_poll_s=10e-3)
    words = np.zeros(8, dtype=np.uint64)
    got: list[tuple[int, int]] = []
    ws.add("conn", "k", words, 0, lambda o, n: got.append((o, n)))
    try:
        time.sleep(0.3)  # long past the HOLD_POLLS at full pace
        p0 = ws.polls
        time.sleep(1.0)
        idle = ws.polls - p0
        assert 10 <= idle <= 150, idle
        words[0] = 1
        assert wait(lambda: got == [(0, 1)])
        p1 = ws.polls
        time.sleep(0.05)  # at the idle pace: 5 polls at most; at full pace: dozens
        assert ws.polls - p1 >= 10, ws.polls - p1
    finally:
        ws.close()


def test_a_word_that_keeps_moving_makes_only_its_own_array_fast() -> None:
    """An attacker bumping its word nonstop: its array is polled at full pace, every
    other array still at the idle pace (before, all of them at full pace)."""
    ws = Watchers(idle_poll_s=10e-3)
    hot_words, cold_words = np.zeros(8, dtype=np.uint64), np.zeros(8, dtype=np.uint64)
    hot = ws.add("attacker", "hot", hot_words, 0, lambda o, n: None)
    cold = ws.add("victim", "cold", cold_words, 0, lambda o, n: None)
    stop = threading.Event()

    def bump() -> None:
        v = 0
        while not stop.is_set():
            v += 1
            hot_words[0] = v
            time.sleep(1e-4)

    t = threading.Thread(target=bump)
    t.start()
    try:
        time.sleep(0.3)
        assert hot.segment is not None and cold.segment is not None
        h0, c0 = hot.segment.polls, cold.segment.polls
        time.sleep(1.0)
        hot_polls, cold_polls = hot.segment.polls - h0, cold.segment.polls - c0
        assert cold_polls <= 150, cold_polls  # about 100: the idle pace
        assert hot_polls >= 5 * cold_polls, (hot_polls, cold_polls)
        assert hot.changes > 100
    finally:
        stop.set()
        t.join()
        ws.close()


def test_a_watcher_whose_memory_is_gone_ends_and_holds_nothing() -> None:
    """``gone()`` true (its buffer freed): the watcher goes at the next sweep, and with it
    every reference to the array, even one its own callback made back to it (a cycle
    that held a freed buffer's memory until the collector ran), and even when no other
    watcher keeps the thread awake (its loop variables held the last array)."""
    import gc
    import weakref

    gc.disable()  # only reference counts may free it
    try:
        ws = Watchers(idle_poll_s=1e-3)
        freed = [False]
        words = np.zeros(512, dtype=np.uint64)
        alive = weakref.ref(words)


        def watch(words: np.ndarray) -> None:
            box: list[object] = []  # the callback finds its watcher here: a cycle
            box.append(ws.add("conn", "buffer", words, 3, lambda o, n: box, words,
                              gone=lambda: freed[0]))

        watch(words)
        del words
        time.sleep(0.05)
        freed[0] = True
        assert wait(lambda: len(ws) == 0, 3)
        assert wait(lambda: alive() is None, 2)
        ws.close()
    finally:
        gc.enable()
