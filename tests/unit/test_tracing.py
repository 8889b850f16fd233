"""transferd.tracing over the SDK's in-memory exporter: the parent chain a part's frames
carry, and a failed part's status (the live two-daemon run: tests/integration/
test_tracing.py)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from transferd.parts import Transfer, WritePart
from transferd.protocol import trace
from transferd.protocol.errors import NotFound
from transferd.protocol.values import NetAddr

if importlib.util.find_spec("opentelemetry.sdk") is None:  # pragma: no cover
    pytest.skip("needs the OpenTelemetry SDK (pip install 'transferd[otel]')",
                allow_module_level=True)

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from transferd.tracing import Spans, wire

TID, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def _spans() -> tuple[Spans, InMemorySpanExporter]:
    out = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(out))
    return Spans(provider), out


def _part(index: int, rail: int) -> WritePart:
    dst = NetAddr(0xABC, 0, [b"127.0.0.1:1"])
    return WritePart(rail, dst, 7, [0], [4096], [memoryview(bytes(4096))], None,
                     index=index, op=3)


def test_parts_name_their_own_span_and_end_with_their_answer() -> None:
    spans, out = _spans()
    raw = trace.parse(f"00-{TID}-{PARENT}-01")
    top = spans.transfer("single", 3, raw)
    parts = [_part(0, 0), _part(1, 1)]
    spans.planned(top, parts)
    ends: list[object] = []
    transfer = Transfer(3, 2, 8192, ends.append)
    answers = [spans.part(transfer, p, top) for p in parts]
    for p, a in zip(parts, answers, strict=True):
        # The frames carry the part span's id as the parent, in the request's trace.
        tp = trace.format(p.trace or b"")
        assert tp.split("-")[1] == TID
        assert int(tp.split("-")[2], 16) == a.span.get_span_context().span_id
        assert p.trace == wire(a.span)
    answers[0].part_done()
    answers[1].part_done(NotFound("no region with rkey 7"))
    assert ends and isinstance(ends[0], NotFound)
    loop = asyncio.new_event_loop()
    try:
        fut = loop.create_future()
        fut.set_exception(NotFound("no region with rkey 7"))
        spans.ended(top, fut)
    finally:
        loop.close()
    done = {s.name + str(s.attributes.get("transferd.part", "")): s
            for s in out.get_finished_spans()}
    t = done["transferd.single"]
    assert t.parent is not None and t.parent.span_id == int(PARENT, 16)
    assert t.context.trace_id == int(TID, 16)
    assert t.attributes["transferd.bytes"] == 8192
    assert tuple(t.attributes["transferd.rails"]) == (0, 1)
    assert t.attributes["transferd.error.code"] == "NOT_FOUND"
    assert not t.status.is_ok
    for i in (0, 1):
        s = done[f"transferd.part{i}"]
        assert s.parent is not None and s.parent.span_id == t.context.span_id
    assert done["transferd.part0"].status.is_unset
    assert done["transferd.part1"].attributes["transferd.error.code"] == "NOT_FOUND"


def test_a_landing_is_the_child_of_the_part_it_names() -> None:
    spans, out = _spans()
    raw = trace.parse(f"00-{TID}-{PARENT}-01")
    spans.landed(3, 1, 4096, raw, 1, 0xABC, 0.002)
    (s,) = out.get_finished_spans()
    assert s.name == "transferd.land"
    assert s.parent is not None and s.parent.span_id == int(PARENT, 16)
    assert s.parent.is_remote and s.context.trace_id == int(TID, 16)
    assert s.end_time is not None and s.start_time is not None
    assert s.end_time - s.start_time >= 2_000_000
    assert s.attributes["transferd.peer"] == f"{0xABC:016x}"
