"""The scaling and copies figures of issue 12, each in its quickest form, against real daemons."""

from __future__ import annotations

import socket
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks import copies
from benchmarks.harness import Options, Pinning
from tests.conftest import DaemonFactory
from tests.helpers import async_test
from transferd.protocol.peer_inbound import MAX_GUESS_TABLE, SMALL_PAYLOAD


def _opts() -> Options:
    return Options(quick=True, pinning=Pinning.detect(enabled=False))


def test_copies_counted_match_the_memcpy_count_on_every_path() -> None:
    with tempfile.TemporaryDirectory(prefix="td-copies-") as where:
        lib, why = copies.build_memcount(where)
        if lib is None:
            pytest.skip(f"memcpy cross-check needs a C compiler: {why}")
        doc = copies.run_paths(_opts(), lib, where, sizes=f"4096,{4 * SMALL_PAYLOAD}")
        assert not list(Path(where).glob("*.sock"))  # daemons gone, socket removed
    rows = {(r["path"], r["size"]): r for r in doc["results"]}
    assert len(rows) == 28
    for path, r in rows.items():
        for proc in copies.PROCS:
            counted = copies_total(r["counted"][proc])
            mem = r["memcpy"][proc]["bytes"] - r["idle"]["memcpy"][proc]["bytes"]
            # A copy site the instrumentation missed would show as memcpy bytes over it.
            assert abs(mem - counted) <= 0.05 * r["moved"], (path, proc, counted, mem)
    # An engine write's payload goes through Python on neither A nor the client; on B
    # only what a frame's first receive brought in past its header (at most
    # SMALL_PAYLOAD a frame: a small write lands in one receive), the rest straight into the region.
    for size in (4096, 4 * SMALL_PAYLOAD):
        for path in ("single write A->B", "single write A->B shared buffer"):
            write = rows[(path, size)]
            counted = write["counted"]
            assert copies_total(counted["client"]) == copies_total(counted["daemon A"]) == 0
            assert set(counted["daemon B"]) == {"peer.buffered"}, counted["daemon B"]
            b = counted["daemon B"]["peer.buffered"]
            assert b["calls"] == write["reps"], (path, size, b)
            # (A header shorter than the link's guess leaves more room: MAX_GUESS_TABLE.)
            most = min(size, SMALL_PAYLOAD + MAX_GUESS_TABLE) * write["reps"]
            assert min(size, SMALL_PAYLOAD) * write["reps"] <= b["bytes"] <= most, (path, b)
    # A batch of small gets is cut once (it was cut twice: its callback and the flush).
    got = rows[("get_tensor_async x8 + flush", 4096)]
    assert got["counted"]["client"]["client.batch_cut"]["bytes"] == got["moved"]


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
    loads = res.data["loads"]["engine write 4 KiB"]["3"]
    assert loads["daemon"][0]["ops"] >= 3
    # The thread-worker daemons ran the same writes.
    assert loads[scale_clients.THREAD][0]["ops"] >= 3
    assert summary["engine write 4 KiB"][3]["thread_ops_per_s"] > 0


def test_pages_figure_goes_past_the_region_cyclically_and_checks_pages() -> None:
    from benchmarks import scale_pages

    region = 16 << 20  # 4096 pages of 4 KiB: 8192 pages visit it twice
    res = scale_pages.run(_opts(), pages=(256, 8192), page_sizes=(4096,), region=region)
    s = res.data["summary"]
    assert s["4096/256"]["transferd_s_per_page"] > 0
    assert s["4096/8192"]["transferd_s_per_page"] > 0
    assert s["4096 flatness transferd"] >= 1.0 and s["4096 cpu flatness transferd"] >= 1.0
    assert s["4096/8192"]["transferd_cpu_s_per_page"] > 0
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
    assert 0 < s["direct_call_s"] < 0.1
    # The lock figure ran its three designs (the other CPU's only where there is one).
    assert s["same loop with work"]["rate_per_s"] > 0


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    for _ in range(1000):
        if len(out) >= n:
            break
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def test_ack_floor_answers_split_pipelined_and_abandoned_requests() -> None:
    """The floor must count requests exactly, or every ratio against it is wrong."""
    from benchmarks.baselines import FRAME
    from benchmarks.harness import ServerProcess
    from benchmarks.scale_baselines import ACK

    argv = [sys.executable, "-m", "benchmarks.scale_baselines", "ack", "--read", "65536"]
    with ServerProcess(argv, Pinning.detect(enabled=False), name="ack") as ack:
        host, port = ack.host_port
        # A sender that announces 1 GiB and vanishes after 1 MiB: the server keeps serving.
        with socket.create_connection((host, port), timeout=10) as liar:
            liar.sendall(FRAME.pack(b"TD", 5, 0, 1, 0, 0, 1 << 30) + bytes(1 << 20))
        with socket.create_connection((host, port), timeout=10) as s:
            payload = bytes(range(256)) * 400  # 100 KiB, more than one read
            one = FRAME.pack(b"TD", 5, 0, 1, 0, 0, len(payload)) + payload
            for piece in (one[:5], one[5:23], one[23:5000], one[5000:]):  # header split too
                s.sendall(piece)
            assert _recv_exactly(s, FRAME.size) == ACK
            # Five at once: payloads, an empty one, one with a body.
            many = b"".join([one, FRAME.pack(b"TD", 5, 0, 2, 0, 0, 0),
                             FRAME.pack(b"TD", 5, 0, 3, 10, 0, 7) + bytes(17), one, one])
            s.sendall(many)
            assert _recv_exactly(s, 5 * FRAME.size) == ACK * 5
            s.settimeout(0.3)
            with pytest.raises(TimeoutError):
                s.recv(1)  # not one answer more than requests


@async_test()
async def test_stats_reports_copies_only_while_counting(daemon_factory: DaemonFactory) -> None:
    from client import Client

    plain = daemon_factory()
    counting = daemon_factory(env={"TRANSFERD_COUNT_COPIES": "1"})
    data = bytes(range(256)) * 16
    for d, counts in ((plain, False), (counting, True)):
        async with await Client.connect(d.url) as c:
            buf = await c.alloc_buffer(4096)
            await c.set_tensor(buf.tensor(), data)
            assert bytes(await c.get_tensor(buf.tensor())) == data
            stats = await c.server_stats()
            assert ("copies" in stats) is counts
            if counts:
                # 4 KiB in (copied out of the read buffer) and 4 KiB out (joined with its header).
                assert stats["copies"]["decoder.payload"]["bytes"] >= 4096
                assert stats["copies"]["session.reply_join"] == {"calls": 1, "bytes": 4096}


def test_worst_growth_ignores_fixed_costs_and_catches_growth() -> None:
    from benchmarks.scale_pages import worst_growth

    assert worst_growth([7.0, 5.0, 4.0, 4.0]) == 1.0  # a fixed cost amortized: flat
    assert worst_growth([4.0, 5.0, 4.0, 8.0]) == 2.0  # 8 at more pages against 4 at fewer
    assert worst_growth([5.0, 3.0, 6.0]) == 2.0


def test_strip_counting_takes_out_every_guarded_count(tmp_path: Path) -> None:
    """The 'no counts in the code' arm of the cost figure runs code with none left."""
    removed = copies.strip_counting(str(tmp_path))
    # 24 sites (the session's reply join and the client's send join are one site now,
    # transferd/transports/carriers.py's StreamCarrier.write, counted under each name).
    assert removed >= 24
    left = [f"{p}:{i}" for p in tmp_path.rglob("*.py") if p.name != "copies.py"
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if line.strip().startswith("count(")]
    assert left == []
