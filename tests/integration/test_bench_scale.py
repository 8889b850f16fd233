"""The scaling and copies figures of issue 12, each in its quickest form, against real daemons."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from benchmarks import copies
from benchmarks.harness import Options, Pinning


def _opts() -> Options:
    return Options(quick=True, pinning=Pinning.detect(enabled=False))


def test_copies_counted_match_the_memcpy_count_on_every_path() -> None:
    with tempfile.TemporaryDirectory(prefix="td-copies-") as where:
        lib, why = copies.build_memcount(where)
        if lib is None:
            pytest.skip(f"memcpy cross-check needs a C compiler: {why}")
        doc = copies.run_paths(_opts(), lib, where, sizes="4096")
        assert not list(Path(where).glob("*.sock"))  # daemons gone, socket removed
    rows = {r["path"]: r for r in doc["results"]}
    assert len(rows) == 10
    for path, r in rows.items():
        for proc in copies.PROCS:
            counted = copies_total(r["counted"][proc])
            mem = r["memcpy"][proc]["bytes"] - r["idle"]["memcpy"][proc]["bytes"]
            # A copy site the instrumentation missed would show as memcpy bytes over it.
            assert abs(mem - counted) <= 0.05 * r["moved"], (path, proc, counted, mem)
    # Engine writes move no payload byte through Python on either daemon.
    write = rows["single write A->B"]
    assert all(copies_total(write["counted"][p]) == 0 for p in copies.PROCS)
    # A batch of small gets is cut once (it was cut twice: its callback and the flush).
    batch = rows["get_tensor_async x8 + flush"]["counted"]["client"]
    assert batch["client.batch_cut"]["bytes"] == rows["get_tensor_async x8 + flush"]["moved"]


def copies_total(counts: dict[str, dict[str, int]]) -> int:
    return sum(v["bytes"] for v in counts.values())
