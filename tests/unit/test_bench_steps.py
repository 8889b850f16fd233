"""benchmarks.engine_steps: every process's events matched to the write they belong to."""

from __future__ import annotations

from benchmarks.engine_steps import STEPS, _steps


def _events(t0: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    a = [("read", t0 + 10), ("submit", t0 + 20), ("execute", t0 + 30), ("sent", t0 + 40),
         ("peer_read", t0 + 70), ("finished", t0 + 80), ("event", t0 + 90)]
    b = [("peer_read", t0 + 50), ("sent", t0 + 60)]
    return a, b


def test_each_write_gets_the_first_of_each_step_inside_its_window() -> None:
    writes = [(0, 100_000), (200_000, 300_000)]
    a0, b0 = _events(0)
    a1, b1 = _events(200_000)
    # A stray flush before A's event in write 0 (another link) is not its WRITE.
    a0.insert(6, ("sent", 85))
    steps = _steps(writes, a0 + a1, b0 + b1)
    assert set(steps) == {f"{p} {t}" for p, t in STEPS}
    assert steps["A read"] == [0.01, 0.01] and steps["A sent"] == [0.04, 0.04]
    assert steps["B read"] == [0.05, 0.05] and steps["A ack"] == [0.07, 0.07]
    assert steps["client done"] == [100.0, 100.0]


def test_a_write_missing_a_step_is_left_out() -> None:
    a, b = _events(0)
    steps = _steps([(0, 100_000)], [e for e in a if e[0] != "execute"], b)
    assert all(v == [] for v in steps.values())
