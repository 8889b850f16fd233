"""What the soak (:mod:`benchmarks.soak`) measures and how it reports it.

- :class:`Latencies`: per operation kind, a count and a bounded reservoir of
  latencies (p50 / p99 from it): minutes of 16 clients never grow a list
  without bound.
- :class:`RssSampler`: each daemon's VmRSS (``/proc/PID/status``) every
  ``interval`` seconds, in a thread (the client loop is busy; the sampler must
  not wait for it), and the stated test of "memory flat after warm-up".
- :func:`plot`: the PNG of every daemon's RSS over time, with matplotlib (the
  optional ``plot`` extra) or a reason why not, never a crash.
- :func:`summary`: the text table printed at the end.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MiB = 1 << 20
# Latencies kept per operation kind (reservoir sampling beyond it).
RESERVOIR = 50_000


class Latencies:
    """Counts and latency reservoirs per operation kind."""

    def __init__(self, seed: int = 0) -> None:
        self.counts: dict[str, int] = {}
        self.samples: dict[str, list[float]] = {}
        self._rng = random.Random(seed)

    def add(self, kind: str, seconds: float) -> None:
        n = self.counts.get(kind, 0) + 1
        self.counts[kind] = n
        s = self.samples.setdefault(kind, [])
        if len(s) < RESERVOIR:
            s.append(seconds)
        else:  # Algorithm R: each latency kept with probability RESERVOIR / n
            k = self._rng.randrange(n)
            if k < RESERVOIR:
                s[k] = seconds

    def merge(self, other: Latencies) -> None:
        for kind, n in other.counts.items():
            for v in other.samples[kind]:
                self.add(kind, v)
            # The reservoir holds a sample; the count is exact.
            self.counts[kind] += n - len(other.samples[kind])

    def table(self, seconds: float) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for kind in sorted(self.counts):
            s = sorted(self.samples[kind])
            out[kind] = {
                "count": self.counts[kind],
                "ops_per_s": round(self.counts[kind] / seconds, 1),
                "p50_us": round(percentile(s, 50) * 1e6, 1),
                "p99_us": round(percentile(s, 99) * 1e6, 1),
                "max_us": round(s[-1] * 1e6, 1) if s else 0.0,
            }
        return out


def percentile(sorted_values: Sequence[float], p: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def vm_rss(pid: int) -> int:
    """VmRSS of ``pid`` in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


@dataclass
class Series:
    name: str
    pid: int
    # (seconds since the start, RSS in bytes); bounded by the run's length / interval.
    points: list[tuple[float, int]] = field(default_factory=list)


class RssSampler:
    """Samples each daemon's RSS every ``interval`` s in a thread, at most ``max_points``."""

    def __init__(self, pids: dict[str, int], interval: float = 0.5,
                 max_points: int = 100_000) -> None:
        self.series = [Series(name, pid) for name, pid in pids.items()]
        self.interval = interval
        self.max_points = max_points
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sample()

    def _sample(self) -> None:
        t = time.monotonic() - self.t0
        for s in self.series:
            if len(s.points) < self.max_points:
                s.points.append((t, vm_rss(s.pid)))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)


def flatness(series: Series, warmup_s: float, end_s: float, bound: int,
             window: int = 5) -> dict[str, Any]:
    """The stated test: RSS at the end is within ``bound`` bytes of RSS after warm-up.

    "After warm-up" is the median of the ``window`` samples at or after
    ``warmup_s``; "at the end" the median of the last ``window`` samples taken
    before ``end_s`` (the load's end, before the checks read everything back).
    """
    loaded = [rss for t, rss in series.points if t <= end_s]
    after = [rss for t, rss in series.points if warmup_s <= t <= end_s]
    if len(after) < 2:
        return {"passed": False, "reason": f"only {len(after)} samples after warm-up"}
    warm = statistics.median(after[:window])
    end = statistics.median(after[-window:])
    return {
        "warm_rss_mib": round(warm / MiB, 1),
        "end_rss_mib": round(end / MiB, 1),
        "growth_mib": round((end - warm) / MiB, 1),
        "peak_mib": round(max(loaded) / MiB, 1),
        "samples_after_warmup": len(after),
        "passed": end - warm <= bound,
    }


def plot(series: Sequence[Series], path: str, warmup_s: float, end_s: float) -> str | None:
    """Write the RSS-over-time PNG; None when written, else why not (never raises)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("matplotlib is not installed (the optional 'plot' extra: "
                "pip install -e '.[plot]'; make soak installs it): no PNG")
    try:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for s in series:
            ax.plot([t for t, _ in s.points], [r / MiB for _, r in s.points], label=s.name)
        ax.axvline(warmup_s, color="grey", linestyle="--", label="end of warm-up")
        ax.axvline(end_s, color="black", linestyle=":", label="end of load")
        ax.set_xlabel("seconds")
        ax.set_ylabel("RSS (MiB)")
        ax.set_title("transferd soak: each daemon's RSS")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
    except Exception as exc:  # a plotting problem must not lose the run's record
        return f"the PNG could not be drawn: {type(exc).__name__}: {exc}"
    return None


def summary(record: dict[str, Any]) -> str:
    """The text summary: ops/s and latency per kind, the checks, each daemon's memory."""
    lines = [f"soak: {record['clients']} clients, {record['daemons']} daemons, "
             f"{record['load_s']:.1f} s of load: {record['total_ops_per_s']:.0f} ops/s",
             f"{'op':<12}{'count':>9}{'ops/s':>10}{'p50 µs':>10}{'p99 µs':>10}{'max µs':>11}"]
    for kind, r in record["ops"].items():
        lines.append(f"{kind:<12}{r['count']:>9}{r['ops_per_s']:>10.1f}{r['p50_us']:>10.0f}"
                     f"{r['p99_us']:>10.0f}{r['max_us']:>11.0f}")
    c = record["checks"]
    lines.append(f"checksums: {c['checksums']['equal']} of {c['checksums']['regions']} "
                 f"regions equal ({c['checksums']['bytes'] / MiB:.0f} MiB compared)")
    m = c["messages"]
    lines.append(f"messages: {m['sent']} sent and acknowledged, {m['received']} received, "
                 f"{m['lost']} lost, {m['duplicated']} duplicated, {m['corrupt']} corrupt")
    i = c["imm"]
    lines.append(f"immediates: {i['expected']} expected, {i['counted']} counted, "
                 f"{i['lost']} lost, {i['duplicated']} duplicated")
    lines.append(f"memory (bound: growth after warm-up <= {record['rss_bound_mib']} MiB):")
    for name, r in record["memory"].items():
        if "warm_rss_mib" in r:
            lines.append(f"  {name}: {r['warm_rss_mib']} MiB after warm-up, "
                         f"{r['end_rss_mib']} MiB at the end ({r['growth_mib']:+} MiB), "
                         f"peak {r['peak_mib']} MiB: {'flat' if r['passed'] else 'GREW'}")
        else:
            lines.append(f"  {name}: {r.get('reason')}")
    lines.append(f"errors: {record['error_count']}")
    for e in record["errors"][:10]:
        lines.append(f"  {e}")
    lines.append(f"plot: {record['plot']}")
    lines.append("PASSED" if record["passed"] else "FAILED")
    return "\n".join(lines)
