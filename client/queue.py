"""The queue of asynchronous reads and writes, drained at flush points.

``set_tensor_async`` and ``get_tensor_async`` only append here.  A flush turns
the queue into as few commands as the order allows: normally one SET_TENSORS
(one-way, NO_REPLY) followed by one GET_TENSORS.  Writes go before the reads
queued after them.  A write queued after a read that overlaps it starts a new
segment, so a read never sees a write issued after it.  Batches are split
where the server's max_body or max_payload would be exceeded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from transferd.protocol.messages import Tensor

# Upper bound of one tensor's msgpack encoding ([u64, u64, u64] = 1 + 3*9).
TENSOR_WIRE_BYTES = 28
BODY_SLACK = 64


@dataclass(slots=True)
class QueuedSet:
    tensor: Tensor
    data: Any  # a bytes-like object of tensor.size bytes, held until sent


@dataclass(slots=True)
class QueuedGet:
    tensor: Tensor
    future: asyncio.Future[Any]
    out: memoryview | None = None  # where the bytes land
    result: Any = None  # what the future resolves to (the caller's out=, or a bytearray)


@dataclass
class Segment:
    sets: list[QueuedSet] = field(default_factory=list)
    gets: list[QueuedGet] = field(default_factory=list)


def _overlaps(a: Tensor, b: Tensor) -> bool:
    return a.buffer == b.buffer and a.offset < b.offset + b.size and b.offset < a.offset + a.size


def segments(ops: list[QueuedSet | QueuedGet]) -> list[Segment]:
    """Split the queue where sending all writes before all reads would reorder."""
    # The usual queue is all its writes, then all its reads: one segment, found
    # with list operations instead of a Python-level turn per operation.
    # (Not "is QueuedSet": an async device copy's SET is a subclass.)
    is_set = [type(op) is not QueuedGet for op in ops]
    if False not in is_set:
        return [Segment(cast(list[QueuedSet], list(ops)))] if ops else []
    first_get = is_set.index(False)
    if True not in is_set[first_get:]:
        return [
            Segment(cast(list[QueuedSet], ops[:first_get]), cast(list[QueuedGet], ops[first_get:]))
        ]
    out = [Segment()]
    for op in ops:
        cur = out[-1]
        if isinstance(op, QueuedSet):
            if cur.gets and any(_overlaps(op.tensor, g.tensor) for g in cur.gets):
                cur = Segment()
                out.append(cur)
            cur.sets.append(op)
        else:
            cur.gets.append(op)
    return [s for s in out if s.sets or s.gets]


def chunks(items: list[Any], max_body: int, max_payload: int,
           max_tensors: int = 0) -> Iterator[list[Any]]:
    """Split a batch so each command's body, payload and tensor count stay inside the limits."""
    per_body = max(1, (max_body - BODY_SLACK) // TENSOR_WIRE_BYTES)
    if max_tensors > 0:
        per_body = min(per_body, max_tensors)
    if 0 < len(items) <= per_body and sum([i.tensor.size for i in items]) <= max_payload:
        yield items  # the usual case: the whole batch fits one command
        return
    start = 0
    while start < len(items):
        size = 0
        end = start
        while end < len(items) and end - start < per_body:
            nxt = items[end].tensor.size
            if end > start and size + nxt > max_payload:
                break
            size += nxt
            end += 1
        yield items[start:end]
        start = end
