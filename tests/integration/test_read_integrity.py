"""Verified and traced one-sided READs between live daemons (issue 20, docs/integrity.md):
over a path that corrupts some answers in flight (the chaos Domain's engine.chaos_corrupt,
on the responder) every verified read that succeeds is byte-exact, the reader's failure
counter moves, an unverified read over the same path can land corrupted; a raw
responder that answers with a wrong checksum, or none where one was asked, is refused;
a traced read's trace id is in `transferd inflight` (with its owner) and in both
daemons' logs, and in its span where spans are on."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from pathlib import Path

import pytest

from client import Client, Pages
from tests.helpers import DaemonProcess, async_test, digest, pattern, wait_until
from tests.integration import engine_cluster
from tests.integration.engine_cluster import (
    RAILS,
    WAIT,
    Cluster,
    MiB,
    client_url,
    engine_env,
    inflight,
    nodes,
    secret_file,
    settle,
    start_many,
    stopped,
    verified,
)
from tests.integration.test_engine_read_attacks import LyingResponder
from tests.integration.test_engine_reads import region
from tests.integration.test_inproc import Side, inproc
from tests.integration.test_integrity import failures
from tests.integration.test_tracing import needs_sdk, spanning, spans_in
from transferd.protocol import trace
from transferd.protocol.errors import BadRequest, PeerUnreachable
from transferd.protocol.peer_ext import encode_ext
from transferd.protocol.peer_wire import RX_CRC, RX_EXT

own_daemons = engine_cluster.own_daemons
clusters = engine_cluster.clusters
cluster = engine_cluster.cluster


@async_test(timeout=120)
async def test_chaos_corrupt_caught_by_a_verified_read(own_daemons: list[DaemonProcess]
                                                       ) -> None:
    a_d, b_d = start_many([
        {"env": engine_env(RAILS[n], "chaos", chaos_corrupt=0.05, chaos_seed=i + 11,
                           secret_file=secret_file())}
        for i, n in enumerate("ab")])
    own_daemons += [a_d, b_d]
    n, size = 40, 64 * 1024
    async with nodes(a_d, b_d) as (a, b):
        src = await region(b, n * size, seed=94, access="r")
        dst = await region(a, n * size)
        before = failures(a_d)
        done = [await a.client.submit_single_read(size, (dst.mr, i * size),
                                                  (src.desc, i * size), verify=True)
                for i in range(n)]
        ok = await verified(done)
        got = await a.read(dst)
        for i in ok:
            assert digest(got[i * size:(i + 1) * size]) == \
                digest(bytes(src.data[i * size:(i + 1) * size])), i
        # The reader found them (by the responder's node and the rail).
        assert failures(a_d) > before
        assert "re-read on rail" in a_d.stderr
        # The same path without verify: some of the bytes land wrong.
        plain = await region(a, n * size)
        done = [await a.client.submit_single_read(size, (plain.mr, i * size),
                                                  (src.desc, i * size), verify=False)
                for i in range(n)]
        assert await settle(done, timeout=WAIT * 2) == [None] * n
        got = await a.read(plain)
        bad = [i for i in range(n)
               if got[i * size:(i + 1) * size] != bytes(src.data[i * size:(i + 1) * size])]
        assert bad, "nothing was corrupted: chaos_corrupt did nothing to the answers"
        # The region read was never touched.
        assert digest(await b.read(src)) == digest(bytes(src.data))


@pytest.fixture
def one_daemon(own_daemons: list[DaemonProcess]) -> DaemonProcess:
    (d,) = start_many([{"env": engine_env(RAILS["a"], secret_file=secret_file())}])
    own_daemons.append(d)
    return d


@async_test(timeout=60)
async def test_a_wrong_checksum_is_re_read_once_then_refused(one_daemon: DaemonProcess
                                                              ) -> None:
    liar = LyingResponder("wrong_crc")
    try:
        async with nodes(one_daemon) as (a,):
            dst = await region(a, 64 * 1024, seed=35)
            before = failures(one_daemon)
            r = await a.client.submit_single_read(4096, (dst.mr, 0),
                                                  (liar.desc(64 * 1024), 0), verify=True)
            with pytest.raises(PeerUnreachable, match="checksum mismatch"):
                await r.wait(WAIT)
            # Asked with RX_CRC (no trace: no extension block), once more on the other rail.
            assert liar.reads_seen == 2 and liar.flags_seen == [RX_CRC, RX_CRC]
            assert failures(one_daemon) == before + 2
            assert "re-read on rail" in one_daemon.stderr
    finally:
        liar.close()


@async_test(timeout=60)
async def test_an_answer_without_the_checksum_asked_is_refused(one_daemon: DaemonProcess
                                                                ) -> None:
    liar = LyingResponder("no_crc")
    try:
        async with nodes(one_daemon) as (a,):
            dst = await region(a, 64 * 1024, seed=36)
            r = await a.client.submit_single_read(4096, (dst.mr, 0),
                                                  (liar.desc(64 * 1024), 0), verify=True)
            with pytest.raises(PeerUnreachable, match="without the checksum"):
                await r.wait(WAIT)
            await asyncio.sleep(0.2)
            assert liar.reads_seen == 1  # the peer's answer: not asked again
            assert digest(await a.read(dst)) == digest(bytes(dst.data))  # nothing placed
    finally:
        liar.close()


@async_test(timeout=60)
async def test_a_traced_read_carries_its_trace_id_in_its_frames(one_daemon: DaemonProcess
                                                                 ) -> None:
    tid = secrets.token_hex(16)
    tp = f"00-{tid}-{secrets.token_hex(8)}-01"
    liar = LyingResponder("no_crc")
    try:
        async with nodes(one_daemon) as (a,):
            dst = await region(a, 64 * 1024, seed=37)
            r = await a.client.submit_single_read(4096, (dst.mr, 0),
                                                  (liar.desc(64 * 1024), 0), verify=False,
                                                  traceparent=tp)
            await settle([r])
            assert liar.flags_seen == [RX_EXT]
            assert liar.ext_seen == [encode_ext(None, trace.parse(tp))]
    finally:
        liar.close()


@async_test(timeout=90)
async def test_a_traced_read_from_a_stopped_peer(own_daemons: list[DaemonProcess]) -> None:
    """Its inflight entry (kind read, stage sent, the trace id, the owner: the same
    connection a write of that client names), the stall warning, and once the peer is
    back both daemons' log records about it carry the trace id."""
    env = {"TRANSFERD_LOG_LEVEL": "debug"}
    a_d, b_d = start_many([
        {"env": {**env, **engine_env(RAILS[n], secret_file=secret_file(), stall_warn_s=0.4,
                                     peer_timeout_s=20)}}
        for n in "ab"])
    own_daemons += [a_d, b_d]
    tid = secrets.token_hex(16)
    tp = f"00-{tid}-{secrets.token_hex(8)}-01"
    async with nodes(a_d, b_d) as (a, b):
        src = await region(b, 64 * 1024, seed=96, access="rw")
        dst = await region(a, 64 * 1024)
        warm = await a.client.submit_single_read(4096, (dst.mr, 0), (src.desc, 0))
        assert await settle([warm]) == [None]
        with stopped(b_d):
            r = await a.client.submit_single_read(64 * 1024, (dst.mr, 0), (src.desc, 0),
                                                  traceparent=tp, verify=True)
            w = await a.client.submit_single_write(4096, None, (dst.mr, 0), (src.desc, 0))

            def listed() -> list[dict]:
                return [e for e in inflight(a_d) if e["kind"] in ("read", "write")]

            assert await asyncio.to_thread(wait_until, lambda: len(listed()) == 2, WAIT)
            (read,) = [e for e in listed() if e["kind"] == "read"]
            (write,) = [e for e in listed() if e["kind"] == "write"]
            assert read["trace_id"] == tid and read["stage"] == "sent", read
            assert read["total"] == 64 * 1024 and read["peer"], read
            assert read["owner"] and read["owner"] == write["owner"], (read, write)
            assert await asyncio.to_thread(
                wait_until, lambda: "stalled: read" in a_d.stderr, WAIT), a_d.output()
            (line,) = [ln for ln in a_d.stderr.splitlines() if "stalled: read" in ln]
            assert tid in line, line
        assert await settle([r, w]) == [None, None]
        assert digest(await a.read(dst, 4096)) == digest(bytes(src.data[4096:]))
        # B's record of the READ it answered, A's of the transfer's end: the trace id.
        assert await asyncio.to_thread(
            wait_until, lambda: any(tid in ln and "answered" in ln
                                    for ln in b_d.stderr.splitlines()), WAIT), b_d.output()
        assert any(tid in ln and "transfer" in ln for ln in a_d.stderr.splitlines())
        assert not [e for e in inflight(a_d) if e["trace_id"] == tid]


@needs_sdk
@async_test(timeout=90)
async def test_a_traced_read_has_its_span(own_daemons: list[DaemonProcess],
                                          tmp_path: Path) -> None:
    """log.otel = "console": a traced read of 4 MiB (over both rails) makes a span
    ``transferd.read`` in the request's trace, a ``transferd.part`` under it per part;
    an untraced read makes none."""
    file = tmp_path / "a.jsonl"
    a_d, b_d = spanning({"a": file, "b": None})
    own_daemons += [a_d, b_d]
    tid, parent = secrets.token_hex(16), secrets.token_hex(8)
    size = 4 << 20
    async with nodes(a_d, b_d) as (a, b):
        src = await region(b, size, seed=97, access="r")
        dst = await region(a, size)
        plain = await a.client.submit_single_read(4096, (dst.mr, 0), (src.desc, 0))
        assert await settle([plain]) == [None]
        r = await a.client.submit_single_read(size, (dst.mr, 0), (src.desc, 0),
                                              traceparent=f"00-{tid}-{parent}-01")
        assert await settle([r]) == [None]
        assert digest(await a.read(dst)) == digest(bytes(src.data))
        assert await asyncio.to_thread(wait_until, lambda: any(
            s["name"] == "transferd.read" for s in spans_in(file)), WAIT), a_d.output()
        spans = spans_in(file)
        (top,) = [s for s in spans if s["name"] == "transferd.read"]
        parts = [s for s in spans if s["name"] == "transferd.part"]
        assert {s["context"]["trace_id"] for s in spans} == {f"0x{tid}"}, spans
        assert top["parent_id"] == f"0x{parent}", top
        attrs = top["attributes"]
        assert attrs["transferd.kind"] == "read" and attrs["transferd.bytes"] == size, attrs
        assert len(parts) == attrs["transferd.parts"] >= 2, spans
        assert all(p["parent_id"] == top["context"]["span_id"] for p in parts), parts


@async_test(timeout=90)
async def test_an_inproc_engine_reads_verified_and_traced(
        clusters: Callable[[str], Cluster]) -> None:
    """The in-process client passes verify and traceparent as the daemon's does: a
    verified traced read from a daemon lands whole, a traceparent that is not one is
    refused, and verify refused nowhere it can be checked."""
    cl = clusters("tcp")
    async with inproc("tcp") as me:
        b = await Client.connect(client_url(cl.b), timeout=WAIT)
        try:
            src = Side(b, False)
            dst = Side(me, True)
            sbuf = await b.alloc_buffer(1 << 20)
            src.buffers.append(sbuf)
            await b.set_tensor(sbuf.tensor(), pattern(1 << 20, 98))
            _, desc = await b.reg_mr(sbuf, access="r")
            buf, mr, _ = await dst.region(1 << 20)
            tp = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
            r = await me.submit_single_read(1 << 20, (mr, 0), (desc, 0), verify=True,
                                            traceparent=tp)
            await r.wait(WAIT)
            assert digest(await dst.read(buf)) == digest(pattern(1 << 20, 98))
            bad = await me.submit_paged_reads(4096, (mr, Pages([0], 4096, 0)),
                                              (desc, Pages([1], 4096, 0)), verify=True,
                                              traceparent="00-xyz")
            with pytest.raises(BadRequest, match="traceparent"):
                await bad.wait(WAIT)
            g = await me.submit_gather(mr, [(4096, 0, desc, 8192)], verify=True)
            await g.wait(WAIT)
            assert (await dst.read(buf))[:4096] == pattern(1 << 20, 98)[8192:12288]
        finally:
            await dst.close()
            await src.close()
            await b.close()


@async_test(timeout=90)
async def test_verified_reads_land_exactly(cluster: Cluster) -> None:
    """verify=True on a single read of 20 MiB (parts of 8 MiB over both rails), a paged
    and a gather one, on a clean path: byte-exact, and no checksum fails."""
    async with nodes(cluster.a, cluster.b) as (a, b):
        size = 20 * MiB + 4096
        src = await region(b, size, seed=99, access="r")
        dst = await region(a, size + 64 * 1024)
        before = failures(cluster.a)
        r = await a.client.submit_single_read(size, (dst.mr, 0), (src.desc, 0), verify=True)
        pages = [3, 0, 7, 5]
        p = await a.client.submit_paged_reads(
            4096, (dst.mr, Pages(list(range(len(pages))), 4096, size)),
            (src.desc, Pages(pages, 4096, 0)), verify=True)
        g = await a.client.submit_gather(dst.mr, [(100, size + 40_000, src.desc, 77)],
                                         verify=True)
        assert await settle([r, p, g]) == [None, None, None]
        got = await a.read(dst)
        assert digest(got[:size]) == digest(bytes(src.data))
        for k, s in enumerate(pages):
            off = size + k * 4096
            assert got[off:off + 4096] == bytes(src.data[s * 4096:(s + 1) * 4096])
        assert got[size + 40_000:size + 40_100] == bytes(src.data[77:177])
        assert failures(cluster.a) == before


@async_test(timeout=60)
async def test_engine_verify_makes_every_read_verified(own_daemons: list[DaemonProcess]
                                                       ) -> None:
    """engine.verify on the reader: a read that says nothing asks for the checksum (a
    responder that sends none is refused); verify=False opts that read out."""
    (d,) = start_many([{"env": engine_env(RAILS["a"], verify=True,
                                          secret_file=secret_file())}])
    own_daemons.append(d)
    liar = LyingResponder("no_crc")
    try:
        async with nodes(d) as (a,):
            dst = await region(a, 64 * 1024, seed=38)
            r = await a.client.submit_single_read(4096, (dst.mr, 0), (liar.desc(64 * 1024), 0))
            with pytest.raises(PeerUnreachable, match="without the checksum"):
                await r.wait(WAIT)
            r = await a.client.submit_single_read(4096, (dst.mr, 0), (liar.desc(64 * 1024), 0),
                                                  verify=False)
            await r.wait(WAIT)
            assert (await a.read(dst))[:4096] == b"\xAA" * 4096  # what it answered, taken
            assert liar.flags_seen == [RX_CRC, 0]
    finally:
        liar.close()
