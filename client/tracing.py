"""The ``traceparent`` a submit carries when none is given: the current OpenTelemetry
span's, where the ``otel`` extra is installed (pip install 'transferd[otel]').

Without OpenTelemetry nothing is imported: whether it is there is looked up once
(``importlib.util.find_spec``), and only then is its API imported.
"""

from __future__ import annotations

import importlib.util
from typing import Any

_otel: Any = None  # the opentelemetry.trace module, False once found missing


def current_traceparent() -> str | None:
    """The W3C traceparent of the current OpenTelemetry span, or None (no span, or no
    OpenTelemetry here)."""
    global _otel
    if _otel is None:
        if importlib.util.find_spec("opentelemetry") is None:
            _otel = False
        else:
            from opentelemetry import trace as otel_trace
            _otel = otel_trace
    if _otel is False:
        return None
    ctx = _otel.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def tag(body: dict[str, Any], verify: bool | None, traceparent: str | None) -> None:
    """Put a submit's ``verify`` and ``traceparent`` (given, or the current span's) in
    its request body; absent fields take the daemon's defaults."""
    if verify is not None:
        body["verify"] = bool(verify)
    tp = traceparent if traceparent is not None else current_traceparent()
    if tp is not None:
        body["traceparent"] = tp


__all__ = ["current_traceparent", "tag"]
