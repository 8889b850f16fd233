"""OpenTelemetry spans per traced transfer (docs/integrity.md, "Spans"): a traced write
between two live daemons yields, in each daemon's span file (log.otel = "console"), a
transfer span and a span per part on the sender and a landing span per part on the
receiver, all in the request's trace and chained request -> transfer -> part -> landing;
a failed traced write's span says ERROR with its error's code.  Without OpenTelemetry
(or with spans off) nothing of it is imported."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, DaemonProcess, async_test, wait_until
from tests.integration import engine_cluster
from tests.integration.engine_cluster import (
    RAILS,
    WAIT,
    Node,
    engine_env,
    fresh_imm,
    secret_file,
    settle,
    start_many,
)

own_daemons = engine_cluster.own_daemons

HAVE_SDK = importlib.util.find_spec("opentelemetry") is not None and \
    importlib.util.find_spec("opentelemetry.sdk") is not None
needs_sdk = pytest.mark.skipif(
    not HAVE_SDK, reason="needs the OpenTelemetry SDK (pip install 'transferd[otel]')")


def spans_in(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def spanning(files: dict[str, Path | None]) -> list[DaemonProcess]:
    """Daemons on RAILS[name] (started, ready) for each name of ``files``, exporting their
    spans as JSON lines to that file (None: spans off), within 50 ms of each span's end
    (the batch's delay), not at the default 5 s."""
    return start_many([
        {"env": {**({"TRANSFERD_LOG_OTEL": "console", "TRANSFERD_LOG_OTEL_FILE": str(f),
                     "OTEL_BSP_SCHEDULE_DELAY": "50"} if f is not None else {}),
                 **engine_env(RAILS[n], secret_file=secret_file())}}
        for n, f in files.items()])


def test_nothing_of_opentelemetry_is_imported_when_spans_are_off() -> None:
    """The engine, the Domains, the client and tracing.configure with nothing asking for
    spans load no opentelemetry module (whether the package is installed or not)."""
    code = ("import sys, transferd.engine, transferd.domains.tcp.domain, client\n"
            "from transferd import tracing\n"
            "assert tracing.configure('auto') is None and tracing.SPANS is None\n"
            "assert tracing.configure('none') is None\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_auto_reads_the_standard_variables() -> None:
    from transferd.tracing import wanted

    env: dict[str, str] = {}
    assert wanted("auto", env.get) == "none"
    env["OTEL_TRACES_EXPORTER"] = "otlp"
    assert wanted("auto", env.get) == "otlp"
    env["OTEL_TRACES_EXPORTER"] = "none,console"
    assert wanted("auto", env.get) == "console"
    env["OTEL_SDK_DISABLED"] = "true"
    assert wanted("auto", env.get) == "none"
    assert wanted("console", env.get) == "console"


def test_spans_asked_for_without_the_sdk_refuse_to_start() -> None:
    """A daemon told to export spans where OpenTelemetry cannot be imported (hidden
    here, whether it is installed or not) does not start, and says what to install."""
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "from rpc_server.cli import main; main()")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "TRANSFERD_"))}
    r = subprocess.run([sys.executable, "-c", code, "-H", "127.0.0.1", "-p", "0",
                        "--metrics-port", "-1"], capture_output=True, text=True,
                       timeout=60, cwd=REPO, env={**env, "TRANSFERD_LOG_OTEL": "console"})
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert "log.otel = 'console'" in r.stderr, r.stderr
    assert "pip install 'transferd[otel]'" in r.stderr, r.stderr


@needs_sdk
@async_test(timeout=90)
async def test_a_traced_write_has_spans_on_both_daemons(own_daemons: list[DaemonProcess],
                                                        tmp_path: Path) -> None:
    files = {n: tmp_path / f"{n}.jsonl" for n in "ab"}
    a_d, b_d = spanning(dict(files))
    own_daemons += [a_d, b_d]
    tid, parent = secrets.token_hex(16), secrets.token_hex(8)
    tp = f"00-{tid}-{parent}-01"
    size = 4 << 20
    a = Node(a_d, await engine_cluster.connect_node(a_d))
    b = Node(b_d, await engine_cluster.connect_node(b_d))
    try:
        src = await a.region(size, seed=61)
        dst = await b.region(size)
        imm = fresh_imm()
        expect = await b.client.expect_imm_count(imm, 1, wait=False)
        c = await a.client.submit_single_write(size, imm, (src.mr, 0), (dst.desc, 0),
                                               traceparent=tp)
        assert await settle([c, expect]) == [None, None]
        assert await b.read(dst) == bytes(src.data)
        # An untraced write makes no span.
        plain = await a.client.submit_single_write(4096, None, (src.mr, 0), (dst.desc, 0))
        assert await settle([plain]) == [None]

        def a_spans() -> list[dict[str, Any]]:
            return spans_in(files["a"])

        assert await asyncio.to_thread(wait_until, lambda: any(
            s["name"] == "transferd.single" for s in a_spans()), WAIT), a_d.output()
        sent = a_spans()
        (top,) = [s for s in sent if s["name"] == "transferd.single"]
        parts = [s for s in sent if s["name"] == "transferd.part"]
        # Both rails carry a part of the 4 MiB write.
        assert len(parts) == top["attributes"]["transferd.parts"] >= 2, sent
        assert {s["context"]["trace_id"] for s in sent} == {f"0x{tid}"}, sent
        assert top["parent_id"] == f"0x{parent}", top
        assert top["status"]["status_code"] == "UNSET", top
        attrs = top["attributes"]
        assert attrs["transferd.op"] >= 1 and attrs["transferd.kind"] == "single"
        assert attrs["transferd.bytes"] == size, attrs
        assert attrs["transferd.peer"] == f"{dst.desc.node[0]:016x}", attrs
        assert list(attrs["transferd.rails"]) == [0, 1], attrs
        top_id = top["context"]["span_id"]
        assert all(p["parent_id"] == top_id for p in parts), parts
        assert sum(p["attributes"]["transferd.bytes"] for p in parts) == size
        assert {p["attributes"]["transferd.rail"] for p in parts} == {0, 1}

        # B: one landing span per part, each the child of its part's span.
        part_ids = {p["context"]["span_id"]: p for p in parts}
        assert await asyncio.to_thread(wait_until, lambda: len(
            [s for s in spans_in(files["b"]) if s["name"] == "transferd.land"]) >= len(parts),
            WAIT), b_d.output()
        lands = [s for s in spans_in(files["b"]) if s["name"] == "transferd.land"]
        assert len(lands) == len(parts), lands
        assert {s["context"]["trace_id"] for s in lands} == {f"0x{tid}"}
        assert {s["parent_id"] for s in lands} == set(part_ids), (lands, parts)
        for s in lands:
            p = part_ids[s["parent_id"]]
            assert s["attributes"]["transferd.part"] == p["attributes"]["transferd.part"]
            assert s["attributes"]["transferd.bytes"] == p["attributes"]["transferd.bytes"]
            assert s["attributes"]["transferd.peer"] == f"{src.desc.node[0]:016x}", s

        # A traced write that fails: into a region B no longer has.
        gone = await b.region(4096)
        await b.client.dereg_mr(gone.mr)
        tid2 = secrets.token_hex(16)
        bad = await a.client.submit_single_write(
            4096, None, (src.mr, 0), (gone.desc, 0),
            traceparent=f"00-{tid2}-{secrets.token_hex(8)}-01")
        (err,) = await settle([bad])
        assert err is not None
        code = type(err).code.value  # type: ignore[attr-defined]

        def failed() -> list[dict[str, Any]]:
            return [s for s in a_spans() if s["context"]["trace_id"] == f"0x{tid2}"
                    and s["name"] == "transferd.single"]

        assert await asyncio.to_thread(wait_until, lambda: bool(failed()), WAIT)
        (f,) = failed()
        assert f["status"]["status_code"] == "ERROR", f
        assert f["attributes"]["transferd.error.code"] == code, f
        assert f["status"]["description"].startswith(code), f
        # Only traced writes made spans (the untraced 4 KiB write none).
        assert {s["context"]["trace_id"] for s in a_spans()} == {f"0x{tid}", f"0x{tid2}"}
    finally:
        await a.close()
        await b.close()


@async_test(timeout=90)
async def test_a_traced_barrier_and_send_have_spans(own_daemons: list[DaemonProcess],
                                                    tmp_path: Path) -> None:
    """A barrier and a send take a traceparent as writes do: a span each on the daemon
    that sends them (transferd.barrier, transferd.send, with their parts); a barrier's
    zero-byte writes carry the trace id to the peer, whose landing spans name it."""
    files = {n: tmp_path / f"{n}.jsonl" for n in "ab"}
    a_d, b_d = spanning(dict(files))
    own_daemons += [a_d, b_d]
    tids = [secrets.token_hex(16) for _ in range(2)]
    a = Node(a_d, await engine_cluster.connect_node(a_d))
    b = Node(b_d, await engine_cluster.connect_node(b_d))
    try:
        dst = await b.region(4096)
        got: list[bytes] = []
        b.client.submit_recvs(64, 1, got.append)
        imm = fresh_imm()
        expect = await b.client.expect_imm_count(imm, 1, wait=False)
        bar = await a.client.submit_barrier(None, imm, [dst.desc],
                                            traceparent=f"00-{tids[0]}-{'1' * 16}-01")
        snd = await a.client.submit_send(await b.client.main_address(), b"traced",
                                         traceparent=f"00-{tids[1]}-{'2' * 16}-01")
        assert await settle([bar, snd, expect]) == [None, None, None]
        assert await asyncio.to_thread(wait_until, lambda: got == [b"traced"], WAIT)

        def named(path: Path, name: str, tid: str) -> list[dict[str, Any]]:
            return [s for s in spans_in(path)
                    if s["name"] == name and s["context"]["trace_id"] == f"0x{tid}"]

        for kind, tid in zip(("barrier", "send"), tids, strict=True):
            assert await asyncio.to_thread(wait_until, lambda k=kind, t=tid: bool(
                named(files["a"], f"transferd.{k}", t)), WAIT), (kind, a_d.output())
            (top,) = named(files["a"], f"transferd.{kind}", tid)
            assert top["attributes"]["transferd.kind"] == kind, top
            assert top["attributes"]["transferd.peer"] == f"{dst.desc.node[0]:016x}", top
            assert named(files["a"], "transferd.part", tid), (kind, [
                (x["name"], x["context"]["trace_id"]) for x in spans_in(files["a"])])
        assert await asyncio.to_thread(wait_until, lambda: bool(
            named(files["b"], "transferd.land", tids[0])), WAIT), b_d.output()
        assert named(files["a"], "transferd.send", tids[1])[0]["attributes"][
            "transferd.bytes"] == len(b"traced")
    finally:
        await a.close()
        await b.close()


@pytest.mark.skipif(not HAVE_SDK, reason="the otel extra is not installed")
@async_test(timeout=90)
async def test_a_submit_without_traceparent_takes_the_current_span(
        own_daemons: list[DaemonProcess], tmp_path: Path) -> None:
    """No traceparent given: the client takes the current OpenTelemetry span's (the async
    client from the task's context, a SyncClient from its calling thread's), and the
    daemon's transfer span is that span's child."""
    from opentelemetry import trace as ot

    from client import SyncClient

    out = tmp_path / "a.jsonl"
    a_d, b_d = spanning({"a": out, "b": None})
    own_daemons += [a_d, b_d]
    ids = [(secrets.token_hex(16), secrets.token_hex(8)) for _ in range(2)]

    def current(tid: str, parent: str) -> Any:
        return ot.use_span(ot.NonRecordingSpan(ot.SpanContext(
            trace_id=int(tid, 16), span_id=int(parent, 16), is_remote=False,
            trace_flags=ot.TraceFlags(ot.TraceFlags.SAMPLED))))

    a = Node(a_d, await engine_cluster.connect_node(a_d))
    b = Node(b_d, await engine_cluster.connect_node(b_d))
    try:
        src = await a.region(8192, seed=62)
        dst = await b.region(8192)
        with current(*ids[0]):
            c = await a.client.submit_single_write(4096, None, (src.mr, 0), (dst.desc, 0))
        assert await settle([c]) == [None]

        def sync_write() -> None:
            with SyncClient.connect(a_d.url) as s, current(*ids[1]):
                smr, _ = s.reg_mr(s.alloc_buffer(4096))
                w = s.submit_single_write(4096, None, (smr, 0), (dst.desc, 4096))
                s.synchronize()  # (waits for this connection's submits)
                assert w.done() and w.exception() is None

        await asyncio.to_thread(sync_write)
        for tid, parent in ids:
            def top(t: str = tid) -> list[dict[str, Any]]:
                return [s for s in spans_in(out) if s["name"] == "transferd.single"
                        and s["context"]["trace_id"] == f"0x{t}"]

            assert await asyncio.to_thread(wait_until, lambda: bool(top()), WAIT), \
                (tid, a_d.output())
            assert top()[0]["parent_id"] == f"0x{parent}", top()
    finally:
        await a.close()
        await b.close()
