"""Deadlines as requests carry them (``timeout_ms``).

A connection's pending operations, their deadlines and CANCEL of one are the
node's (transferd/service/ops.py: each connection's ``caller.ops``, keyed by the
request's seq, so CANCEL can only name an operation of its own connection); this
module reads a request's ``timeout_ms``.
"""

from __future__ import annotations

from typing import Any

from transferd.protocol.errors import BadRequest
from transferd.service.ops import Op, Ops

__all__ = ["MAX_TIMEOUT_MS", "Op", "Ops", "ms_field"]

# A deadline in ms fits in a u32 (49 days).
MAX_TIMEOUT_MS = 0xFFFFFFFF


def ms_field(raw: Any) -> float:
    """A ``timeout_ms`` value in seconds: a positive u32 of milliseconds."""
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 < raw <= MAX_TIMEOUT_MS:
        raise BadRequest("field 'timeout_ms' must be a positive integer (milliseconds)")
    return raw / 1000.0

