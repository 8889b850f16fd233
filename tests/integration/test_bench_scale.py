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


def test_clients_figure_runs_every_workload_and_count() -> None:
    from benchmarks import scale_clients

    res = scale_clients.run(_opts(), clients=(1, 3), duration=0.05)
    summary = res.data["summary"]
    assert set(summary) == set(scale_clients.WORKLOADS)
    for w, by_count in summary.items():
        for c in (1, 3):
            v = by_count[c]
            assert v["floor_ops_per_s"] > 0 and v["daemon_ops_per_s"] > 0, (w, c)
            assert v["daemon_p99_s"] > 0 and v["ops_ratio"] > 0
    # Every client of every arm ran: 3 clients made at least 3 operations.
    loads = res.data["loads"]["engine write 4 KiB"]["3"]["daemon"]
    assert loads[0]["ops"] >= 3


def test_pages_figure_goes_past_the_region_cyclically_and_checks_pages() -> None:
    from benchmarks import scale_pages

    region = 16 << 20  # 4096 pages of 4 KiB: 8192 pages visit it twice
    res = scale_pages.run(_opts(), pages=(256, 8192), page_sizes=(4096,), region=region)
    s = res.data["summary"]
    assert s["4096/256"]["transferd_s_per_page"] > 0
    assert s["4096/8192"]["transferd_s_per_page"] > 0
    assert s["4096 flatness transferd"] >= 1.0
    assert "(cyclic)" in res.tables[0].render()


def test_peers_figure_counts_memory_and_descriptors_per_link() -> None:
    from benchmarks import scale_peers

    res = scale_peers.run(_opts(), counts=(1, 2), total=16 << 20)
    s = res.data["summary"]
    assert s["1"]["transferd_bytes_per_s"] > 0 and s["2"]["socket_bytes_per_s"] > 0
    # One TCP link per peer on one rail: one more descriptor per link, give or take.
    assert 0.5 <= s["fds_per_link"] <= 3, s["fds_per_link"]
    mem = res.data["memory"]
    assert [m["links"] for m in mem] == [1, 2]


def test_handoff_figure_measures_every_design() -> None:
    from benchmarks import scale_handoff

    res = scale_handoff.run(_opts(), n=200)
    s = res.data["summary"]
    for arm in ("same loop", "thread, same CPU", "process, same CPU"):
        assert 0 < s[arm]["p50_s"] < 0.1, arm
        assert s[arm]["rate_per_s"] > 0
    assert s["direct_call_s"] < s["same loop"]["p50_s"]
