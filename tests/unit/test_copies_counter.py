"""transferd.copies: the counts, their snapshots and differences."""

from __future__ import annotations

import os
import threading

from transferd import copies


def test_counts_add_up_by_site_and_delta_keeps_only_what_changed() -> None:
    before = copies.snapshot()
    copies.count("test.a", 10)
    copies.count("test.a", 5)
    copies.count("test.b", 7)
    after = copies.snapshot()
    d = copies.delta(after, before)
    assert d["test.a"] == {"calls": 2, "bytes": 15}
    assert d["test.b"] == {"calls": 1, "bytes": 7}
    assert copies.total(d) == 22
    assert copies.delta(after, after) == {}


def test_counts_from_threads_are_not_lost() -> None:
    before = copies.snapshot()

    def work() -> None:
        for _ in range(2000):
            copies.count("test.threads", 3)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    d = copies.delta(copies.snapshot(), before)
    assert d["test.threads"] == {"calls": 8000, "bytes": 24000}


def test_off_unless_the_environment_asks() -> None:
    asked = os.environ.get(copies.ENV, "").strip() not in ("", "0", "false", "no")
    assert copies.COUNTING is asked
