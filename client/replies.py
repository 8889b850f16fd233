"""Where a GET reply's payload goes, and how it settles the queued reads it answers.

A flush sends the queued reads as GET_TENSORS (or GET_TENSOR) requests; each
reply resolves its reads' futures here, its payload cut into their results
or received straight into their ``out=`` buffers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from transferd.copies import COUNTING, count
from transferd.protocol.errors import BadRequest
from transferd.protocol.frames import Frame
from transferd.protocol.messages import Tensor

from .queue import QueuedGet


def resolve_gets(gets: list[QueuedGet], fut: asyncio.Future[Frame]) -> None:
    """Settle queued reads from their GET_TENSOR(S) reply future."""
    if fut.cancelled():
        for g in gets:
            if not g.future.done():
                g.future.cancel()
    elif (exc := fut.exception()) is not None:
        for g in gets:
            if not g.future.done():
                g.future.set_exception(exc)
    else:
        payload = fut.result().payload
        if payload is not None:  # gathered whole (see lazy_sink): cut it up
            if len(gets) == 1:
                gets[0].result = payload
            else:
                pos = 0
                for g in gets:
                    end = pos + g.tensor[2]
                    # Called twice per reply (its done callback, then the flush
                    # itself): a read already settled is not cut out again.
                    if not g.future.done():
                        g.result = payload[pos:end]
                        if COUNTING:
                            count("client.batch_cut", end - pos)
                    pos = end
        for g in gets:
            f = g.future
            if not f.done():
                # No result yet: a zero-byte read, whose sink was never asked for.
                r = g.result
                f.set_result(r if r is not None else bytearray())


# A small reply for reads without ``out=`` is received whole and cut into the
# reads' results: cheaper than scattering it over one small buffer per read.
GATHER_SMALL = 64 * 1024


def lazy_sink(gets: list[QueuedGet]) -> Callable[[Frame], list[memoryview] | None]:
    """Where a GET reply's payload goes, decided when the reply arrives.

    Reads without ``out=`` get their bytearray only then, after the server has
    checked every tensor: a read the server refuses allocates nothing.
    """

    def sink(frame: Frame) -> list[memoryview] | None:
        if frame.payload_len <= GATHER_SMALL and all(g.out is None for g in gets):
            return None  # the decoder gathers the payload; resolve_gets cuts it
        views: list[memoryview] = []
        append = views.append
        for g in gets:
            out = g.out
            if out is None:
                g.result = r = bytearray(g.tensor[2])
                g.out = out = memoryview(r)
            append(out)
        return views

    return sink


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
