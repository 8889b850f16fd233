"""What the daemon exports to Prometheus, what STATS reports, and the client's own
periodic TRANSFERD_STATS line."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import textwrap

import pytest

from client import Client
from tests.conftest import DaemonFactory
from tests.helpers import REPO, async_test, digest, metric, pattern, scrape
from transferd.memory import charge_of
from transferd.protocol.constants import HEADER_SIZE, Command
from transferd.protocol.errors import NotFound, OutOfBounds
from transferd.protocol.frames import pack_body
from transferd.protocol.messages import Tensor


def test_the_buffer_limit_is_exported_from_the_start(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(["-m", "64"])
    assert d.metrics_url is not None
    m = scrape(d.metrics_url)
    # Set before any allocation: the memory alert divides by it.
    assert metric(m, "transferd_buffer_limit_bytes", device="cpu") == 64 << 20
    assert 'transferd_buffer_limit_bytes{device="cpu"}' in m


async def poll(pred: object, timeout: float = 5.0) -> bool:
    """Wait (without blocking the loop) until ``pred()`` holds."""
    assert callable(pred)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@async_test(timeout=60)
async def test_metrics_follow_the_traffic(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    assert d.metrics_url is not None and d.metrics_url.startswith("http://127.0.0.1:")
    assert d.metrics_url.endswith("/metrics")
    url = d.metrics_url

    m0 = await asyncio.to_thread(scrape, url)
    assert metric(m0, "transferd_open_connections") == 0
    assert metric(m0, "transferd_commands_total", command="GET_TENSORS") == 0
    assert metric(m0, "transferd_buffer_allocated_bytes", device="cpu") == 0
    # Every error code is exported from the start, at zero.
    assert "transferd_errors_total{code=\"OUT_OF_BOUNDS\"}" in m0

    n, size = 8, 4096
    async with await Client.connect(d.url) as c, await Client.connect(d.url) as c2:
        m1 = await asyncio.to_thread(scrape, url)
        assert metric(m1, "transferd_open_connections") == 2
        assert metric(m1, "transferd_commands_total", command="HELLO") == 2

        buf = await c.alloc_buffer(n * size)
        buf2 = await c2.alloc_buffer(1000)
        m2 = await asyncio.to_thread(scrape, url)
        # Charged by the pages held, plus a page of bookkeeping per buffer.
        assert metric(m2, "transferd_buffer_allocated_bytes", device="cpu") == (
            charge_of(n * size) + charge_of(1000))

        steps = 3
        for step in range(steps):
            data = [pattern(size, step * 100 + i) for i in range(n)]
            for i in range(n):
                c.set_tensor_async(buf.tensor(i * size, size), data[i])
            futs = [c.get_tensor_async(buf.tensor(i * size, size)) for i in range(n)]
            await c.flush()
            assert [digest(f.result()) for f in futs] == [digest(x) for x in data]
        await c.synchronize()  # every one-way SET_TENSORS has been handled
        m3 = await asyncio.to_thread(scrape, url)

        def moved(name: str, **labels: str) -> float:
            return metric(m3, name, **labels) - metric(m2, name, **labels)

        assert moved("transferd_commands_total", command="GET_TENSORS") == steps
        assert moved("transferd_commands_total", command="SET_TENSORS") == steps
        assert moved("transferd_commands_total", command="GET_TENSOR") == 0
        assert moved("transferd_commands_total", command="SYNCHRONIZE") == 1
        body = pack_body({"tensors": [Tensor(buf.id, i * size, size).to_wire() for i in
                                      range(n)]})
        frame = HEADER_SIZE + len(body) + n * size
        assert moved("transferd_command_bytes_total", command="SET_TENSORS",
                     direction="in") == steps * frame
        assert moved("transferd_command_bytes_total", command="GET_TENSORS",
                     direction="in") == steps * (HEADER_SIZE + len(body))
        # Replies: a header and the tensors' bytes (no body).
        assert moved("transferd_command_bytes_total", command="GET_TENSORS",
                     direction="out") == steps * (HEADER_SIZE + n * size)
        # One-way commands send nothing back.
        assert moved("transferd_command_bytes_total", command="SET_TENSORS",
                     direction="out") == 0
        # The duration histogram saw each replied GET_TENSORS once.
        assert moved("transferd_request_duration_seconds_count", command="GET_TENSORS") == steps
        assert moved("transferd_request_duration_seconds_bucket", command="GET_TENSORS",
                     le="+Inf") == steps
        assert moved("transferd_request_duration_seconds_sum", command="GET_TENSORS") > 0
        buckets = sorted(
            (float(k.split('le="')[1].split('"')[0]), v)
            for k, v in m3.items()
            if k.startswith("transferd_request_duration_seconds_bucket")
            and 'command="GET_TENSORS"' in k
        )
        assert len(buckets) > 5
        assert all(a[1] <= b[1] for a, b in itertools.pairwise(buckets))

        # Errors by code.
        with_oob = metric(m3, "transferd_errors_total", code="OUT_OF_BOUNDS")
        with_nf = metric(m3, "transferd_errors_total", code="NOT_FOUND")
        with pytest.raises(OutOfBounds):
            await c.get_tensor(Tensor(buf.id, n * size, 1))
        c.set_tensor_async(Tensor(buf.id, n * size - 1, 2), b"xx")  # one-way: an EVENT
        with pytest.raises(OutOfBounds):
            await c.synchronize()
        with pytest.raises(NotFound):
            await c.free_buffer(999_999)
        m4 = await asyncio.to_thread(scrape, url)
        assert metric(m4, "transferd_errors_total", code="OUT_OF_BOUNDS") == with_oob + 2
        assert metric(m4, "transferd_errors_total", code="NOT_FOUND") == with_nf + 1

        await c.free_buffer(buf)
        m5 = await asyncio.to_thread(scrape, url)
        assert metric(m5, "transferd_buffer_allocated_bytes", device="cpu") == charge_of(1000)
        await c2.free_buffer(buf2)

    assert await poll(
        lambda: metric(scrape(url), "transferd_open_connections") == 0
    ), "open connections did not go back to 0"
    m6 = scrape(url)
    assert metric(m6, "transferd_buffer_allocated_bytes", device="cpu") == 0
    assert metric(m6, "transferd_connections_accepted_total") == 2


@async_test()
async def test_protocol_errors_are_counted(daemon_factory: DaemonFactory) -> None:
    from tests.helpers import RawConn

    d = daemon_factory()
    assert d.metrics_url is not None
    before = scrape(d.metrics_url)
    with RawConn.to(d) as raw:
        raw.send_raw(b"NOPE" * 6)
        assert raw.recv().body["code"] == "BAD_FRAME"
    with RawConn.to(d) as raw:
        raw.send(Command.STATS)
        assert raw.recv().body["code"] == "NO_HELLO"
    after = scrape(d.metrics_url)
    for code in ("BAD_FRAME", "NO_HELLO"):
        assert (metric(after, "transferd_errors_total", code=code)
                - metric(before, "transferd_errors_total", code=code)) == 1


def test_metrics_can_be_turned_off(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(metrics=False)
    assert d.metrics_url is None
    assert not any("metrics on" in line for line in d.stdout_lines)


@async_test()
async def test_stats_command_counts_and_bytes(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    async with await Client.connect(d.url) as c:
        s0 = await c.server_stats()
        assert s0["commands"]["HELLO"] == 1 and s0["commands"]["STATS"] == 1
        buf = await c.alloc_buffer(1000)
        await c.set_tensor(buf.tensor(), b"\x01" * 1000)
        await c.get_tensor(buf.tensor())
        s1 = await c.server_stats()
        assert s1["commands"]["ALLOC_BUFFER"] == 1
        assert s1["commands"]["SET_TENSOR"] == 1 and s1["commands"]["GET_TENSOR"] == 1
        assert s1["commands"]["STATS"] == 2
        assert s1["bytes_in"] - s0["bytes_in"] >= 1000
        assert s1["bytes_out"] - s0["bytes_out"] >= 1000
        # The client's own view of the same traffic.
        cs = c.stats()
        assert cs["commands"]["SET_TENSOR"] == 1 and cs["commands"]["STATS"] == 2
        assert cs["bytes_out"] == s1["bytes_in"]  # every byte sent was received
        # The server's bytes_out was taken just before its STATS reply went out;
        # the client has received everything before it, and the reply itself.
        assert cs["bytes_in"] == s1["bytes_out"] + HEADER_SIZE + len(pack_body(s1))
    async with await Client.connect(d.url) as other:
        s2 = await other.server_stats()
    # Counts are of all connections since start.
    assert s2["commands"]["HELLO"] == 2 and s2["commands"]["STATS"] == 3


STATS_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from client import Client

    async def main(url):
        async with await Client.connect(url) as c:
            buf = await c.alloc_buffer(4096)
            for i in range(3):
                c.set_tensor_async(buf.tensor(0, 4096), bytes([i]) * 4096)
                f = c.get_tensor_async(buf.tensor(0, 4096))
                await c.flush()
                assert f.result() == bytes([i]) * 4096
            await asyncio.sleep(0.45)

    asyncio.run(asyncio.wait_for(main(sys.argv[1]), 30))
    """
)


def _run_client_script(url: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", STATS_SCRIPT, url],
        capture_output=True,
        text=True,
        timeout=60,
        env=full,
        cwd=REPO,
    )


def test_client_prints_stats_periodically(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    r = _run_client_script(d.url, {"TRANSFERD_STATS": "1", "TRANSFERD_STATS_MS": "100"})
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("transferd-client stats:")]
    assert 2 <= len(lines) <= 10, r.stderr  # ~0.45 s at one line per 100 ms
    last = lines[-1]
    assert "SET_TENSORS=3" in last and "GET_TENSORS=3" in last and "HELLO=1" in last
    assert "bytes_out=" in last and "bytes_in=" in last
    out = int(last.split("bytes_out=")[1].split()[0])
    assert out > 3 * 4096


def test_client_is_quiet_without_stats(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    r = _run_client_script(d.url, {"TRANSFERD_STATS_MS": "100"})
    assert r.returncode == 0, r.stderr
    assert "transferd-client stats" not in r.stderr


# -- an idle page, and the engine's receiving side -------------------------------------------


def test_an_idle_daemon_exports_a_small_page(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(["-m", "16"])
    assert d.metrics_url is not None
    idle = scrape(d.metrics_url)
    assert len(idle) < 150, len(idle)
    assert not any(k.startswith("transferd_request_duration_seconds") for k in idle)
    assert not any(k.startswith("transferd_commands_total") for k in idle)
    assert metric(idle, "transferd_errors_total", code="INTERNAL") == 0  # rate() needs it
    from client import SyncClient

    with SyncClient(d.url) as c:
        c.get_devices()
    m = scrape(d.metrics_url)
    durations = {k.split('command="')[1].split('"')[0] for k in m
                 if k.startswith("transferd_request_duration_seconds_count")}
    assert durations == {"HELLO", "GET_DEVICES"}, durations


@async_test(timeout=60)
async def test_the_receiving_engine_is_visible() -> None:
    from client import MrDesc
    from tests.integration.engine_cluster import (
        RAILS,
        WAIT,
        engine_env,
        fresh_imm,
        nodes,
        settle,
        start_many,
    )

    MiB = 1 << 20
    a_d, b_d = start_many([{"env": engine_env(RAILS["a"])}, {"env": engine_env(RAILS["b"])}])
    try:
        assert a_d.metrics_url and b_d.metrics_url
        async with nodes(a_d, b_d) as (a, b):
            src = await a.region(4 * MiB, seed=80)
            dst = await b.region(4 * MiB)
            imm = fresh_imm()
            pending = await b.client.expect_imm_count(imm, 1000, wait=False)
            m = scrape(b_d.metrics_url)
            assert metric(m, "transferd_engine_expectations_pending") == 1
            w = await a.client.submit_single_write(4 * MiB, imm, (src.mr, 0), (dst.desc, 0))
            await w.wait(WAIT)
            m = scrape(b_d.metrics_url)
            assert metric(m, "transferd_engine_landed_bytes_total") == 4 * MiB
            parts = metric(m, "transferd_engine_landed_writes_total")
            assert parts >= 2  # sharded over both rails
            assert metric(m, "transferd_engine_immediates_total") == 1
            assert metric(m, "transferd_engine_inbound_links", rail="0") == 1
            assert metric(m, "transferd_engine_inbound_links", rail="1") == 1
            # The initiator's links, by rail and state; nothing in flight now.
            ma = scrape(a_d.metrics_url)
            assert metric(ma, "transferd_engine_links", rail="0", state="ready") == 1
            assert metric(ma, "transferd_engine_links", rail="1", state="ready") == 1
            assert metric(ma, "transferd_engine_transfers_in_flight") == 0
            assert metric(ma, "transferd_engine_queue_depth", queue="link_waiting") == 0
            # A forged rkey: refused, by reason; nothing more landed.
            forged = MrDesc(dst.desc.ptr, [(ad, k ^ 0x5A5A) for ad, k in dst.desc.rkeys],
                            dst.desc.size)
            [err] = await settle([await a.client.submit_single_write(
                4096, None, (src.mr, 0), (forged, 0))])
            assert isinstance(err, NotFound)
            m = scrape(b_d.metrics_url)
            assert metric(m, "transferd_engine_refused_writes_total", reason="NOT_FOUND") == 1
            assert metric(m, "transferd_engine_refused_writes_total", reason="OUT_OF_BOUNDS") == 0
            assert metric(m, "transferd_engine_landed_bytes_total") == 4 * MiB
            # A two-sided message, delivered to a posted receive.
            got: list[bytes] = []
            b.client.submit_recvs(64, 1, got.append)
            await b.client.imm_count(0)  # the receive is posted before the send
            w = await a.client.submit_send(await b.client.main_address(), b"hello b")
            await w.wait(WAIT)
            assert await poll(lambda: got == [b"hello b"])
            m = scrape(b_d.metrics_url)
            assert metric(m, "transferd_engine_messages_delivered_total") == 1
            assert metric(m, "transferd_engine_queue_depth", queue="recv_posted") == 1
            assert not pending.done()
    finally:
        for d in (a_d, b_d):
            d.stop()
