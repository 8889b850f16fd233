"""Where a read with ``out=`` lands.

A flush sends the queued reads as GET_TENSORS (or GET_TENSOR) requests; each reply
resolves its reads' futures (client/queue.py, ``Reads``), its payload cut into their
results or received straight into their ``out=`` buffers, checked here.
"""

from __future__ import annotations

from typing import Any

from transferd.protocol.errors import BadRequest
from transferd.protocol.messages import Tensor


def out_view(t: Tensor, out: Any) -> memoryview:
    """Where a read with ``out=`` lands: ``out`` as writable bytes of the tensor's size."""
    if out is None:
        return memoryview(bytearray(t.size))
    view = memoryview(out).cast("B")
    if view.readonly:
        raise BadRequest("out= must be a writable buffer")
    if view.nbytes != t.size:
        raise BadRequest(f"out= holds {view.nbytes} bytes for a tensor of {t.size}")
    return view
