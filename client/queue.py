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
from asyncio import InvalidStateError
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import is_, itemgetter
from typing import Any, cast

from transferd.copies import COUNTING, count
from transferd.protocol.errors import BadFrame
from transferd.protocol.frames import Frame, pack_body
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


# -- the flat queue: a column per field, one entry per row --------------------------------
#
# set_tensor_async and get_tensor_async append a row's fields to the current segment's
# columns (no object per row but the read's future); a flush sends each segment's columns
# as they are (the tensors list is the GET_TENSORS / SET_TENSORS body, the data list the
# SET's payload) and settles a reply's reads in one pass.  The op lists above remain for
# the async device copies (client/copies.py), whose SETs wait for their bytes: a queue
# with a copy in it is held as ops (Client._op_queue), converted to columns when sent.

# A small reply for reads without ``out=`` is received whole and cut into the reads'
# results: cheaper than scattering it over one small buffer per read.  So is a larger
# one of small rows (GATHER_ROW on average, GATHER_MAX in all): either way each byte is
# copied once in user space (cut from the whole, or from the decoder's buffer into its
# row), and cutting costs no Python turn per row to set its buffer up and fill it.
GATHER_SMALL = 64 * 1024
GATHER_ROW = 16 * 1024
GATHER_MAX = 4 << 20


@dataclass(slots=True, eq=False)
class Columns:
    """One segment of the queue: its writes, then its reads, a list per field."""

    set_t: list[Tensor] = field(default_factory=list)
    set_d: list[Any] = field(default_factory=list)  # bytes or memoryview("B"), each row's
    set_bytes: int = 0
    get_t: list[Tensor] = field(default_factory=list)
    get_f: list[asyncio.Future[Any]] = field(default_factory=list)
    get_bytes: int = 0
    # The reads with a destination of their own (out=), by row: (where the bytes land,
    # what the future resolves to).  A dict, not two more columns: the usual read has
    # none, and two appends per row are a third of queueing one.
    get_out: dict[int, tuple[memoryview, Any]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.set_t or self.get_t)


def overlaps_any(t: Tensor, tensors: list[Tensor]) -> bool:
    b, o, n = t
    if not n:
        return False
    e = o + n
    return any(gb == b and go < e and o < go + gn for gb, go, gn in tensors)


_SIZE = itemgetter(2)


class TensorQueue:
    """The queue of asynchronous reads and writes, as columns (see above).

    Appending a row is two list appends and nothing else (no count, no byte sum: they
    are taken in C at :meth:`take`).  A segment after the first opens only after a
    row, so the queue holds something exactly when its first segment does."""

    __slots__ = ("cur", "segs")

    def __init__(self) -> None:
        self.cur = Columns()
        self.segs = [self.cur]

    def __bool__(self) -> bool:
        first = self.segs[0]
        return bool(first.set_t or first.get_t)

    def __len__(self) -> int:
        return sum([len(s.set_t) + len(s.get_t) for s in self.segs])

    def add_set(self, t: Tensor, data: Any) -> None:
        cur = self.cur
        # A write after a read of the same bytes opens a segment (sent after that read);
        # one after reads of other bytes may go before them.
        if cur.get_t and overlaps_any(t, cur.get_t):
            cur = self.cur = Columns()
            self.segs.append(cur)
        cur.set_t.append(t)
        cur.set_d.append(data)

    def add_get(self, t: Tensor, fut: asyncio.Future[Any], dest: memoryview | None = None,
                out: Any = None) -> None:
        cur = self.cur
        if dest is not None:
            cur.get_out[len(cur.get_t)] = (dest, out)
        cur.get_t.append(t)
        cur.get_f.append(fut)

    def take(self) -> list[Columns]:
        """Everything queued, in order, each segment's byte counts summed; the queue is
        empty after."""
        segs = self.segs
        self.cur = Columns()
        self.segs = [self.cur]
        if not segs[-1]:
            segs = segs[:-1]
        for seg in segs:
            seg.set_bytes = sum(map(_SIZE, seg.set_t))
            seg.get_bytes = sum(map(_SIZE, seg.get_t))
        return segs

    def to_ops(self) -> list[QueuedSet | QueuedGet]:
        """Everything queued as ops (each segment's writes, then its reads), emptied."""
        ops: list[QueuedSet | QueuedGet] = []
        for seg in self.take():
            ops += map(QueuedSet, seg.set_t, seg.set_d)
            outs = seg.get_out
            for i, (t, f) in enumerate(zip(seg.get_t, seg.get_f, strict=True)):
                o = outs.get(i)
                ops.append(QueuedGet(t, f) if o is None else QueuedGet(t, f, o[0], o[1]))
        return ops


def columns(seg: Segment) -> Columns:
    """A segment of ops as columns (the async copies' path)."""
    c = Columns()
    for s in seg.sets:
        c.set_t.append(s.tensor)
        c.set_d.append(s.data)
        c.set_bytes += s.tensor.size
    for g in seg.gets:
        if g.out is not None:
            c.get_out[len(c.get_t)] = (g.out, g.result)
        c.get_t.append(g.tensor)
        c.get_f.append(g.future)
        c.get_bytes += g.tensor.size
    return c


class PackedTensors:
    """A batch's body, ``{"tensors": [...]}``, packed; kept for the next batch of the same
    tensors (a decode loop writes and reads the same rows every step).  The same means
    the same objects, in order: a Tensor is a tuple of ints, so the same objects pack to
    the same bytes.  Any other list is packed as before, after one compare that stops at
    the first tensor that differs."""

    __slots__ = ("raw", "tensors")

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.raw = b""

    def body(self, tensors: list[Tensor]) -> bytes:
        last = self.tensors
        if len(last) == len(tensors) and self.raw and all(map(is_, last, tensors)):
            return self.raw
        raw = pack_body({"tensors": tensors})
        self.tensors, self.raw = tensors, raw
        return raw


def ranges(tensors: list[Tensor], nbytes: int, max_body: int, max_payload: int,
           max_tensors: int = 0) -> list[tuple[int, int]]:
    """Where a column of tensors splits so each command's body, payload and tensor count
    stay inside the limits (``chunks``, by index): one range in the usual case."""
    per_body = max(1, (max_body - BODY_SLACK) // TENSOR_WIRE_BYTES)
    if max_tensors > 0:
        per_body = min(per_body, max_tensors)
    n = len(tensors)
    if n <= per_body and nbytes <= max_payload:
        return [(0, n)] if n else []
    out: list[tuple[int, int]] = []
    start = 0
    while start < n:
        size = 0
        end = start
        while end < n and end - start < per_body:
            nxt = tensors[end][2]
            if end > start and size + nxt > max_payload:
                break
            size += nxt
            end += 1
        out.append((start, end))
        start = end
    return out


class Reads:
    """The reads one GET_TENSORS (or GET_TENSOR) answers: rows ``lo:hi`` of a segment.

    Its :meth:`sink` picks where the reply's payload lands once the reply is known good
    (a read the server refuses allocates nothing); :meth:`settle` resolves the reads'
    futures from the reply, once, in one pass.
    """

    __slots__ = ("hi", "lo", "nbytes", "results", "seg", "settled")

    def __init__(self, seg: Columns, lo: int, hi: int, nbytes: int) -> None:
        self.seg, self.lo, self.hi, self.nbytes = seg, lo, hi, nbytes
        self.settled = False
        # What each read resolves to, once sink() gave the reply's payload its memory.
        self.results: list[Any] | None = None

    def _outs(self) -> bool:
        outs = self.seg.get_out
        if not outs:
            return False
        lo, hi = self.lo, self.hi
        return any(lo <= i < hi for i in outs)

    def sink(self, frame: Frame) -> list[memoryview] | None:
        plen = frame.payload_len
        if (plen <= GATHER_SMALL or (plen <= GATHER_MAX and
                                     plen <= GATHER_ROW * (self.hi - self.lo))) \
                and not self._outs():
            if plen != self.nbytes:  # (rows received in place: the decoder's check)
                raise BadFrame(f"payload of {plen} bytes where {self.nbytes} were expected",
                               seq=frame.seq)
            return None  # the decoder gathers the payload; settle cuts it
        seg = self.seg
        outs, get_t = seg.get_out, seg.get_t
        views: list[memoryview] = []
        results: list[Any] = []
        for i in range(self.lo, self.hi):
            o = outs.get(i) if outs else None
            if o is None:
                r = bytearray(get_t[i][2])
                results.append(r)
                views.append(memoryview(r))
            else:
                results.append(o[1])
                views.append(o[0])
        self.results = results
        return views

    def settle(self, fut: asyncio.Future[Frame]) -> None:
        """Resolve the reads from their reply's future (a done callback, and the flush
        itself: the second call does nothing)."""
        if self.settled:
            return
        self.settled = True
        seg, lo, hi = self.seg, self.lo, self.hi
        futs = seg.get_f[lo:hi]
        if fut.cancelled():
            for f in futs:
                if not f.done():
                    f.cancel()
            return
        exc = fut.exception()
        if exc is not None:
            for f in futs:
                if not f.done():
                    f.set_exception(exc)
            return
        payload = fut.result().payload
        if payload is not None:  # gathered whole (see sink): cut it up, one pass
            if len(payload) != self.nbytes:  # a server that lies: no row cut short
                bad = BadFrame(f"a reply of {len(payload)} payload bytes for reads of "
                               f"{self.nbytes}")
                for f in futs:
                    if not f.done():
                        f.set_exception(bad)
                return
            if hi - lo == 1:
                f = futs[0]
                if not f.done():
                    f.set_result(payload)
                return
            if COUNTING:
                count("client.batch_cut", len(payload))
            pos = 0
            for f, t in zip(futs, seg.get_t[lo:hi], strict=True):
                end = pos + t[2]
                r = payload[pos:end]
                pos = end
                try:  # (no done() per row: a future cancelled meanwhile is let be)
                    f.set_result(r)
                except InvalidStateError:
                    continue
            return
        results = self.results
        if results is None and self.nbytes:
            # No payload where rows of bytes were asked for: no read is told it read
            # nothing (an empty bytearray is no row of theirs).
            bad = BadFrame(f"a reply of no payload to reads of {self.nbytes} bytes")
            for f in futs:
                if not f.done():
                    f.set_exception(bad)
            return
        if results is None:
            # No payload, so no sink was asked for: zero-byte reads (out= or a new
            # bytearray each).
            outs = seg.get_out
            results = [outs[i][1] if i in outs else bytearray() for i in range(lo, hi)]
        for f, r in zip(futs, results, strict=True):
            try:
                f.set_result(r)
            except InvalidStateError:  # cancelled meanwhile
                continue
