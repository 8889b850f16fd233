"""OpenTelemetry spans per traced transfer, with the ``otel`` extra (docs/integrity.md).

A transfer that carries a W3C trace id (``traceparent``) gets, where spans are on:

- on the initiating daemon a span ``transferd.<kind>`` (single, paged, scatter) from
  the submit to its completion, parented on the request's traceparent, with the
  op, kind, bytes, peer node(s), rails, and on failure status ERROR with the typed
  error's wire code;
- under it a span ``transferd.part`` per part, from the moment it is handed to its
  rail to its acknowledgement; the part's frames carry *that* span's id as the
  parent (the WRITE's TRACE entry), so that
- the receiving daemon's span ``transferd.land`` per landed traced part (from its
  header to its count) is the part's child: one trace shows both daemons.

Spans are on when :func:`configure` found an exporter: ``log.otel`` (``console``:
one JSON object per span and line, to ``log.otel_file`` or stderr; ``otlp``: the
OTLP exporter package, configured by the standard ``OTEL_EXPORTER_OTLP_*``
variables) or, with ``auto``, ``OTEL_TRACES_EXPORTER``.  Off (the default where
nothing asks for spans), nothing of OpenTelemetry is imported and :data:`SPANS` is
None: the engine and the Domains check that one attribute, and only for a transfer
that carries a trace id.  Spans are batched and exported on the SDK's own thread,
never on the daemon's loop or a worker's.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("transferd.tracing")

# What exports spans, once configure() found one (None: spans off).
SPANS: Spans | None = None

MODES = ("auto", "none", "console", "otlp")


class TracingUnavailable(Exception):
    """The exporter asked for cannot be had here (a package is missing)."""


def _remote(otel: Any, raw: bytes) -> Any:
    """An OpenTelemetry context whose current span is the remote parent ``raw`` names
    (26 wire bytes: version, trace id, parent id, flags)."""
    ctx = otel.SpanContext(trace_id=int.from_bytes(raw[1:17], "big"),
                           span_id=int.from_bytes(raw[17:25], "big"), is_remote=True,
                           trace_flags=otel.TraceFlags(raw[25]))
    return otel.set_span_in_context(otel.NonRecordingSpan(ctx))


def wire(span: Any) -> bytes:
    """The 26 wire bytes of a traceparent naming ``span`` as the parent."""
    ctx = span.get_span_context()
    return (b"\x00" + ctx.trace_id.to_bytes(16, "big") + ctx.span_id.to_bytes(8, "big")
            + bytes([int(ctx.trace_flags) & 0xFF]))


class Spans:
    """A tracer and its provider (its exporter's thread); every method is thread-safe
    (the SDK's spans are), so parts end theirs on their group's worker."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace as otel

        self._otel = otel
        self.provider = provider
        self.tracer = provider.get_tracer("transferd")

    def transfer(self, kind: str, op: int, trace: bytes) -> Any:
        """The span of a traced submit, started now."""
        return self.tracer.start_span(
            f"transferd.{kind or 'write'}", context=_remote(self._otel, trace),
            kind=self._otel.SpanKind.SERVER,
            attributes={"transferd.op": op, "transferd.kind": kind or "write"})

    def planned(self, span: Any, parts: Sequence[Any]) -> None:
        """What the transfer's parts say of it: bytes, peer(s), rails, part count."""
        nodes = sorted({p.dst.node for p in parts})
        span.set_attributes({
            "transferd.bytes": sum(p.nbytes for p in parts),
            "transferd.peer": ",".join(f"{n:016x}" for n in nodes),
            "transferd.rails": sorted({p.rail for p in parts}),
            "transferd.parts": len(parts)})

    def ended(self, span: Any, fut: Any) -> None:
        """The submit's future is done: the span ends with its outcome."""
        err = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or err is not None:
            code = getattr(getattr(err, "code", None), "value", None) or (
                "CANCELLED" if err is None else type(err).__name__)
            span.set_attribute("transferd.error.code", str(code))
            span.set_status(self._otel.Status(
                self._otel.StatusCode.ERROR,
                f"{code}: {getattr(err, 'message', err) if err is not None else 'cancelled'}"))
        span.end()

    def part(self, target: Any, part: Any, parent: Any) -> PartSpan:
        """A span for ``part`` under ``parent`` (its transfer's), started now; the part's
        frames will name it as their parent.  ``target``: what the part's answer goes
        to (the Transfer)."""
        span = self.tracer.start_span(
            "transferd.part", context=self._otel.set_span_in_context(parent),
            kind=self._otel.SpanKind.CLIENT,
            attributes={"transferd.op": part.op, "transferd.part": part.index,
                        "transferd.bytes": part.nbytes, "transferd.rail": part.rail,
                        "transferd.peer": f"{part.dst.node:016x}"})
        part.trace = wire(span)
        return PartSpan(self, target, part, span)

    def landed(self, op: int, index: int, nbytes: int, trace: bytes, rail: int,
               peer: int | None, ago_s: float) -> None:
        """A traced part landed here (the receiving daemon): its span, from its header
        ``ago_s`` seconds ago until now, under the sender's part span."""
        now = time.time_ns()
        span = self.tracer.start_span(
            "transferd.land", context=_remote(self._otel, trace),
            kind=self._otel.SpanKind.SERVER, start_time=now - int(max(ago_s, 0.0) * 1e9),
            attributes={"transferd.op": op, "transferd.part": index,
                        "transferd.bytes": nbytes, "transferd.rail": rail,
                        "transferd.peer": f"{peer:016x}" if peer is not None else ""})
        span.end(end_time=now)

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what the batch holds


class PartSpan:
    """What a Domain answers one traced part to (as it would the Transfer): ends the
    part's span, then passes the answer on."""

    __slots__ = ("_spans", "part", "span", "target")

    def __init__(self, spans: Spans, target: Any, part: Any, span: Any) -> None:
        self._spans, self.target, self.part, self.span = spans, target, part, span

    @property
    def finished(self) -> bool:
        return bool(self.target.finished)

    @property
    def op(self) -> int:
        return int(self.target.op)

    @property
    def trace(self) -> bytes | None:
        return self.target.trace

    def _end(self, error: Any) -> None:
        span = self.span
        if span is None:
            return
        self.span = None
        span.set_attribute("transferd.rail", self.part.rail)  # where it went in the end
        if error is not None:
            otel = self._spans._otel
            code = getattr(error.code, "value", error.code)
            span.set_attribute("transferd.error.code", str(code))
            span.set_status(otel.Status(otel.StatusCode.ERROR, f"{code}: {error.message}"))
        span.end()

    def part_done(self, error: Any = None) -> None:
        self._end(error)
        self.target.part_done(error)

    def fail(self, error: Any) -> None:
        self._end(error)
        self.target.fail(error)


def _console(path: str) -> Any:
    """A span exporter writing one JSON object per span and line to ``path`` (stderr
    for "")."""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    out = open(path, "a", buffering=1) if path else sys.stderr  # noqa: SIM115
    return ConsoleSpanExporter(out=out,
                               formatter=lambda span: span.to_json(indent=None) + "\n")


def _otlp() -> Any:
    """The OTLP span exporter the standard variables ask for (OTEL_EXPORTER_OTLP_*)."""
    proto = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
             or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    kind = "grpc" if proto == "grpc" else "http"
    try:
        module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{kind}"
                                         ".trace_exporter")
    except ImportError as exc:
        pkg = f"opentelemetry-exporter-otlp-proto-{kind}"
        raise TracingUnavailable(f"OTLP ({proto}) needs {pkg}: pip install {pkg}") from exc
    return module.OTLPSpanExporter()


def wanted(mode: str, env: Callable[[str], str | None] = os.environ.get) -> str:
    """The exporter ``mode`` (log.otel) asks for: "console", "otlp" or "none"; "auto"
    reads OTEL_SDK_DISABLED and OTEL_TRACES_EXPORTER (unset: none, so that a daemon
    with the package installed exports nothing nobody asked for)."""
    if mode != "auto":
        return mode
    if (env("OTEL_SDK_DISABLED") or "").strip().lower() == "true":
        return "none"
    names = [n.strip().lower() for n in (env("OTEL_TRACES_EXPORTER") or "").split(",")]
    for name in names:
        if name in ("console", "otlp"):
            return name
    return "none"


def configure(mode: str, path: str = "") -> Spans | None:
    """Turn spans on as ``log.otel`` (``mode``) and the environment say; :data:`SPANS`.

    Raises :class:`TracingUnavailable` (saying what to install) when an exporter is
    asked for that cannot be had here.  Nothing is imported when none is asked for.
    """
    global SPANS
    exporter = wanted(mode)
    if exporter == "none":
        SPANS = None
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(
            f"spans ({exporter}) need the OpenTelemetry SDK: pip install "
            "'transferd[otel]'") from exc
    made = _console(path) if exporter == "console" else _otlp()
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "transferd"}
    provider = TracerProvider(resource=Resource.create(attrs))
    # Batched: exported on the processor's thread (OTEL_BSP_* tune it).
    provider.add_span_processor(BatchSpanProcessor(made))
    SPANS = Spans(provider)
    log.info("tracing: spans per traced transfer exported to %s",
             f"{path or 'stderr'} (console)" if exporter == "console" else "OTLP")
    return SPANS


# Engines embedded in this process (inproc clients) using the spans, and whether the
# first of them turned them on (so the last one out turns them off again).
_embedded = 0
_embedded_configured = False


def acquire(mode: str, path: str = "") -> None:
    """Spans for an engine embedded in this process (``inproc://``): as :func:`configure`
    for the first one, when nothing turned them on before; the others share them.  The
    same errors as configure."""
    global _embedded, _embedded_configured
    if _embedded == 0 and SPANS is None:
        _embedded_configured = configure(mode, path) is not None
    _embedded += 1


def embedded() -> int:
    """How many embedded engines hold a share of the spans now."""
    return _embedded


def release() -> None:
    """An embedded engine closed: the last one out exports what is left and stops the
    spans, if the first one turned them on."""
    global _embedded, _embedded_configured
    if _embedded == 0:
        return
    _embedded -= 1
    if _embedded == 0 and _embedded_configured:
        _embedded_configured = False
        shutdown()


def shutdown() -> None:
    """Export what is left and stop (the daemon's exit)."""
    global SPANS
    spans, SPANS = SPANS, None
    if spans is not None:
        try:
            spans.shutdown()
        except Exception as exc:  # an exporter that fails at the end must not hide the exit
            log.warning("tracing: flushing spans at exit failed: %s", exc)


__all__ = ["MODES", "SPANS", "PartSpan", "Spans", "TracingUnavailable", "acquire", "configure",
           "embedded", "shutdown", "wanted", "wire"]
