"""Where a read with ``out=`` lands.

A flush sends the queued reads as GET_TENSORS (or GET_TENSOR) requests; each reply
resolves its reads' futures (client/queue.py, ``Reads``), its payload cut into their
results or received straight into their ``out=`` buffers, checked here.
"""

from __future__ import annotations

from typing import Any

from transferd.protocol.constants import command_name
from transferd.protocol.errors import BadFrame, BadRequest
from transferd.protocol.frames import Frame
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


def reply_uint(r: Frame, name: str, default: int | None = None) -> int:
    """Field ``name`` of the reply ``r``, an unsigned integer (``default`` when absent and
    one is given): a server's reply that lacks it, or holds another type, is BAD_FRAME
    naming it, not a KeyError in the caller."""
    v = r.body.get(name, default)
    if type(v) is not int or v < 0:
        raise BadFrame(f"the server's {command_name(r.cmd)} reply: field {name!r} is "
                       f"{str(v)[:40]!r}, not an unsigned integer", seq=r.seq)
    return v


def reply_field(r: Frame, name: str, kind: type | tuple[type, ...]) -> Any:
    """Field ``name`` of the reply ``r``, an instance of ``kind`` (else BAD_FRAME)."""
    v = r.body.get(name)
    if not isinstance(v, kind):
        raise BadFrame(f"the server's {command_name(r.cmd)} reply: field {name!r} is "
                       f"{str(v)[:40]!r}, not of the type it must be", seq=r.seq)
    return v
