"""Trace ids and what is in flight (docs/integrity.md): a traced write to a peer that
stopped answering is listed by `transferd inflight` with its stage, age and trace id,
warned about once as stalled, and its trace id is in both daemons' logs."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys

import pytest

from client import ScatterDst
from tests.helpers import REPO, DaemonProcess, async_test, metric, scrape, wait_until
from tests.integration import engine_cluster
from tests.integration.engine_cluster import (
    RAILS,
    SECRET,
    WAIT,
    engine_env,
    fresh_imm,
    inflight,
    nodes,
    secret_file,
    settle,
    start_many,
    stopped,
)
from tests.integration.fake_peer import FakePeer, raw_write
from transferd.protocol import trace
from transferd.protocol.errors import BadRequest
from transferd.protocol.peer_ext import encode_ext

own_daemons = engine_cluster.own_daemons


def text_inflight(d: DaemonProcess) -> str:
    r = subprocess.run([sys.executable, "-m", "transferd.cli", "inflight", d.url],
                       capture_output=True, text=True, timeout=30, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return r.stdout


@async_test(timeout=90)
async def test_a_traced_write_to_a_stopped_peer(own_daemons: list[DaemonProcess]) -> None:
    env = {"TRANSFERD_LOG_LEVEL": "debug"}
    a_d, b_d = start_many([
        {"env": {**env, **engine_env(RAILS[n], secret_file=secret_file(), stall_warn_s=0.4,
                                     peer_timeout_s=20)}}
        for n in "ab"])
    own_daemons += [a_d, b_d]
    tid, parent = secrets.token_hex(16), secrets.token_hex(8)
    tp = f"00-{tid}-{parent}-01"
    async with nodes(a_d, b_d) as (a, b):
        src = await a.region(64 * 1024, seed=95)
        dst = await b.region(64 * 1024)
        imm = fresh_imm()
        warm = await a.client.submit_single_write(4096, None, (src.mr, 0), (dst.desc, 0))
        assert await settle([warm]) == [None]
        # B waits for the write: an expectation in B's listing.
        expect = await b.client.expect_imm_count(imm, 1, wait=False)
        (e,) = [e for e in inflight(b_d) if e["kind"] == "expectation"]
        assert e["stage"] == "expecting" and e["what"] == f"imm {imm} count 1", e
        assert (e["done"], e["total"]) == (0, 1)
        with stopped(b_d):
            c = await a.client.submit_single_write(64 * 1024, imm, (src.mr, 0), (dst.desc, 0),
                                                   traceparent=tp)

            def listed() -> dict | None:
                mine = [e for e in inflight(a_d) if e["trace_id"] == tid]
                return mine[0] if mine and mine[0]["in_stage_s"] >= 0.5 else None

            entry = await asyncio.to_thread(lambda: wait_until(
                lambda: listed() is not None, WAIT) and listed())
            assert entry, a_d.output()
            assert entry["kind"] == "write" and entry["stage"] == "sent", entry
            assert entry["age_s"] >= 0.5 and entry["total"] == 64 * 1024, entry
            assert entry["done"] == 0 and entry["peer"], entry
            assert tid in await asyncio.to_thread(text_inflight, a_d)
            # The stall warning, once, with all of it.
            assert await asyncio.to_thread(
                wait_until, lambda: "stalled: write" in a_d.stderr, WAIT), a_d.output()
            (line,) = [ln for ln in a_d.stderr.splitlines() if "stalled: write" in ln]
            assert "WARNING" in line and "sent for" in line and tid in line, line
            assert entry["peer"] in line and "65,536 bytes" in line, line
            await asyncio.sleep(0.6)
            assert sum("stalled: write" in ln for ln in a_d.stderr.splitlines()) == 1
        # B comes back: the write lands, B logs it with the trace id, the listing empties.
        assert await settle([c, expect]) == [None, None]
        assert await asyncio.to_thread(wait_until, lambda: tid in b_d.stderr, WAIT), \
            b_d.output()
        assert not [e for e in inflight(a_d) if e["trace_id"] == tid]
        assert not [e for e in inflight(b_d) if e["kind"] == "expectation"]
        assert metric(scrape(a_d.metrics_url or ""), "transferd_engine_stalls_total") >= 1
        # A traceparent that is not one is refused, naming what is wrong.
        with pytest.raises(BadRequest, match="traceparent"):
            bad = await a.client.submit_single_write(4096, None, (src.mr, 0), (dst.desc, 0),
                                                     traceparent="00-xyz")
            await bad.wait(WAIT)


@async_test(timeout=60)
async def test_a_write_landing_from_a_peer_that_went_quiet(
        own_daemons: list[DaemonProcess]) -> None:
    """A raw peer sends a traced WRITE's header and half its payload, then nothing: the
    receiver lists it as landing (bytes in of total, the trace id) and warns once."""
    (b_d,) = start_many([{"env": engine_env(RAILS["b"], secret_file=secret_file(),
                                            stall_warn_s=0.3)}])
    own_daemons.append(b_d)
    tid = secrets.token_hex(16)
    raw = trace.parse(f"00-{tid}-{secrets.token_hex(8)}-01")
    async with nodes(b_d) as (b,):
        addr_b = await b.client.main_address()
        dst = await b.region(64 * 1024)
        (_, k0), _ = dst.desc.rkeys
        with FakePeer(addr_b, 0, SECRET) as peer:
            await asyncio.to_thread(peer.handshake)
            w = {"op": 5, "part": 0, "rkey": k0, "addrs": [dst.desc.ptr],
                 "lens": [64 * 1024]}
            peer.conn.send_raw(raw_write(w, bytes(20_000), payload_len=64 * 1024,
                                         ext=encode_ext(None, raw)))

            def listed() -> list[dict]:
                return [e for e in inflight(b_d) if e["trace_id"] == tid]

            assert await asyncio.to_thread(wait_until, lambda: bool(listed()), WAIT)
            (e,) = listed()
            assert e["kind"] == "incoming write" and e["stage"] == "landing", e
            assert (e["done"], e["total"], e["op"]) == (20_000, 64 * 1024, 5), e
            assert e["peer"] == f"{peer.me.node:016x}" and e["what"] == "part 0", e
            assert await asyncio.to_thread(
                wait_until, lambda: "stalled: incoming write 5" in b_d.stderr, WAIT), \
                b_d.output()
            (line,) = [ln for ln in b_d.stderr.splitlines() if "stalled: incoming" in ln]
            assert "landing for" in line and tid in line and "20,000 of 65,536" in line
        # The peer is gone: nothing of it is in flight any more.
        assert await asyncio.to_thread(wait_until, lambda: not listed(), WAIT)


@async_test(timeout=90)
async def test_every_submit_is_listed_with_its_owner_and_trace_waiting_ones_too(
        own_daemons: list[DaemonProcess]) -> None:
    """A scatter, a barrier and a send to a stopped peer are listed with their owner
    (the connection) and trace id, as a single write is; a fourth submit, over
    engine.max_inflight_per_client, waits for a slot: it is listed too (queued, its
    owner and trace id) and warned about as stalled, and leaves the listing once it
    started and ended."""
    a_d, b_d = start_many([
        {"env": engine_env(RAILS[n], secret_file=secret_file(), stall_warn_s=0.4,
                           peer_timeout_s=20, max_inflight_per_client=3)}
        for n in "ab"])
    own_daemons += [a_d, b_d]
    tids = [secrets.token_hex(16) for _ in range(4)]
    tps = [f"00-{t}-{secrets.token_hex(8)}-01" for t in tids]
    async with nodes(a_d, b_d) as (a, b):
        src = await a.region(64 * 1024, seed=96)
        dst = await b.region(64 * 1024)
        got: list[bytes] = []
        b.client.submit_recvs(1024, 1, got.append)
        addr_b = await b.client.main_address()
        warm = await a.client.submit_single_write(4096, None, (src.mr, 0), (dst.desc, 0))
        assert await settle([warm]) == [None]
        imm = fresh_imm()
        with stopped(b_d):
            cs = [await a.client.submit_scatter(None, imm, src.mr, [
                      ScatterDst(4096, 0, (dst.desc, 0)), ScatterDst(4096, 4096,
                                                                     (dst.desc, 8192))],
                      traceparent=tps[0]),
                  await a.client.submit_barrier(None, imm, [dst.desc], traceparent=tps[1]),
                  await a.client.submit_send(addr_b, b"hello", traceparent=tps[2]),
                  await a.client.submit_single_write(4096, None, (src.mr, 0), (dst.desc, 0),
                                                     traceparent=tps[3])]

            def listed() -> dict[str, dict]:
                return {e["trace_id"]: e for e in inflight(a_d) if e["trace_id"] in tids}

            assert await asyncio.to_thread(wait_until, lambda: len(listed()) == 4, WAIT), \
                (listed(), a_d.output())
            got_now = listed()
            owners = {e["owner"] for e in got_now.values()}
            assert len(owners) == 1 and "" not in owners, got_now  # one connection's
            scatter, barrier, send, queued = (got_now[t] for t in tids)
            assert scatter["kind"] == "write" and scatter["total"] == 8192, scatter
            assert scatter["stage"] == "sent" and scatter["parts"] == 2, scatter
            assert scatter["rails"] and set(scatter["rails"]) <= {0, 1}, scatter
            assert barrier["kind"] == "write" and barrier["stage"] == "sent", barrier
            assert send["kind"] == "send" and send["total"] == 5, send
            assert queued["kind"] == "write" and queued["stage"] == "queued", queued
            assert "SINGLE_WRITE, waiting for a slot" in queued["what"], queued
            assert await asyncio.to_thread(
                wait_until, lambda: "SINGLE_WRITE, waiting for a slot" in a_d.stderr
                and "stalled:" in a_d.stderr, WAIT), a_d.output()
            (line,) = [ln for ln in a_d.stderr.splitlines()
                       if "stalled:" in ln and "waiting for a slot" in ln]
            assert tids[3] in line and "queued for" in line, line
        assert await settle(cs) == [None] * 4
        assert await asyncio.to_thread(wait_until, lambda: got == [b"hello"], WAIT)
        assert not listed()
