"""The client queue's planning: where segments split, how batches are chunked."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgpack
import pytest

from client.queue import (
    BODY_SLACK,
    TENSOR_WIRE_BYTES,
    PackedTensors,
    QueuedGet,
    QueuedSet,
    chunks,
    segments,
)
from transferd.protocol.frames import pack_body
from transferd.protocol.messages import U64_MAX, Tensor

_loop = asyncio.new_event_loop()


def S(buf: int, off: int, size: int) -> QueuedSet:
    return QueuedSet(Tensor(buf, off, size), b"\0" * size)


def G(buf: int, off: int, size: int) -> QueuedGet:
    return QueuedGet(Tensor(buf, off, size), _loop.create_future())


def shape(ops: list[Any]) -> list[tuple[list[Tensor], list[Tensor]]]:
    return [([s.tensor for s in seg.sets], [g.tensor for g in seg.gets]) for seg in segments(ops)]


def teardown_module() -> None:
    _loop.close()


def test_empty_queue_has_no_segments() -> None:
    assert segments([]) == []


def test_sets_then_gets_are_one_segment() -> None:
    ops = [S(1, 0, 4), S(1, 4, 4), G(1, 0, 8), G(1, 0, 4)]
    assert shape(ops) == [
        ([Tensor(1, 0, 4), Tensor(1, 4, 4)], [Tensor(1, 0, 8), Tensor(1, 0, 4)])
    ]


def test_get_then_non_overlapping_set_does_not_split() -> None:
    # Same buffer, adjacent ranges; and a different buffer at the same offsets.
    ops = [G(1, 0, 4), S(1, 4, 4), G(2, 0, 4), S(3, 0, 4)]
    (seg,) = segments(ops)
    assert [s.tensor for s in seg.sets] == [Tensor(1, 4, 4), Tensor(3, 0, 4)]
    assert [g.tensor for g in seg.gets] == [Tensor(1, 0, 4), Tensor(2, 0, 4)]


@pytest.mark.parametrize(
    "write",
    [(1, 0, 4), (1, 3, 1), (1, 2, 10), (1, 0, 100)],
    ids=["same", "last-byte", "tail", "covers"],
)
def test_set_after_overlapping_get_splits(write: tuple[int, int, int]) -> None:
    ops = [S(1, 0, 4), G(1, 0, 4), S(*write), G(1, 0, 4)]
    assert shape(ops) == [
        ([Tensor(1, 0, 4)], [Tensor(1, 0, 4)]),
        ([Tensor(*write)], [Tensor(1, 0, 4)]),
    ]


def test_zero_size_tensors_never_overlap() -> None:
    ops = [G(1, 4, 0), S(1, 4, 0), G(1, 0, 8), S(1, 8, 0)]
    assert len(segments(ops)) == 1


def test_each_conflict_opens_one_new_segment_in_order() -> None:
    ops = [G(1, 0, 8), S(1, 0, 8), G(1, 0, 8), S(1, 4, 1), S(1, 100, 4), G(1, 100, 4), S(1, 100, 4)]
    assert shape(ops) == [
        ([], [Tensor(1, 0, 8)]),
        ([Tensor(1, 0, 8)], [Tensor(1, 0, 8)]),
        ([Tensor(1, 4, 1), Tensor(1, 100, 4)], [Tensor(1, 100, 4)]),
        ([Tensor(1, 100, 4)], []),
    ]


@pytest.mark.parametrize("seed", range(30))
def test_segments_preserve_read_after_write_semantics(seed: int) -> None:
    """Simulate the queue against a model: executing segments (sets, then gets) gives
    every read exactly what in-order execution would."""
    rng = random.Random(seed)
    size = 64
    ops: list[Any] = []
    for i in range(rng.randint(1, 40)):
        off = rng.randrange(size)
        n = rng.randint(0, size - off)
        if rng.random() < 0.5:
            ops.append(QueuedSet(Tensor(1, off, n), bytes([i + 1]) * n))
        else:
            ops.append(G(1, off, n))

    def in_order() -> list[bytes]:
        mem = bytearray(size)
        out = []
        for op in ops:
            t = op.tensor
            if isinstance(op, QueuedSet):
                mem[t.offset : t.offset + t.size] = op.data
            else:
                out.append(bytes(mem[t.offset : t.offset + t.size]))
        return out

    def by_segments() -> dict[int, bytes]:
        mem = bytearray(size)
        got: dict[int, bytes] = {}
        for seg in segments(ops):
            for s in seg.sets:
                mem[s.tensor.offset : s.tensor.offset + s.tensor.size] = s.data
            for g in seg.gets:
                got[id(g)] = bytes(mem[g.tensor.offset : g.tensor.offset + g.tensor.size])
        return got

    seg_result = by_segments()
    gets = [op for op in ops if isinstance(op, QueuedGet)]
    assert [seg_result[id(g)] for g in gets] == in_order()
    # Nothing lost, nothing duplicated, order kept within each kind.
    flat_sets = [s for seg in segments(ops) for s in seg.sets]
    flat_gets = [g for seg in segments(ops) for g in seg.gets]
    assert flat_sets == [op for op in ops if isinstance(op, QueuedSet)]
    assert flat_gets == gets


# -- chunks ------------------------------------------------------------------------------


def _body_len(part: list[Any]) -> int:
    return len(pack_body({"tensors": [op.tensor.to_wire() for op in part]}))


def test_tensor_wire_bound_is_an_upper_bound() -> None:
    worst = [U64_MAX, U64_MAX, U64_MAX]
    assert len(msgpack.packb(worst)) <= TENSOR_WIRE_BYTES


def test_chunks_of_nothing() -> None:
    assert list(chunks([], 4096, 1 << 20)) == []


def test_one_chunk_when_it_fits() -> None:
    items = [S(1, i * 8, 8) for i in range(100)]
    parts = list(chunks(items, 1 << 20, 1 << 20))
    assert len(parts) == 1 and parts[0] == items


@pytest.mark.parametrize("max_body", [BODY_SLACK + TENSOR_WIRE_BYTES, 1024, 4096, 65536])
def test_chunks_respect_max_body(max_body: int) -> None:
    items = [S(U64_MAX, U64_MAX - 16, 16) for _ in range(3000)]
    parts = list(chunks(items, max_body, 1 << 40))
    assert [op for p in parts for op in p] == items
    for p in parts:
        assert p
        assert _body_len(p) <= max_body
    per = (max_body - BODY_SLACK) // TENSOR_WIRE_BYTES
    assert len(parts) == -(-len(items) // per)


@pytest.mark.parametrize("max_payload", [100, 1000, 4096])
def test_chunks_respect_max_payload(max_payload: int) -> None:
    rng = random.Random(max_payload)
    items = [S(1, 0, rng.randint(0, 100)) for _ in range(500)]
    parts = list(chunks(items, 1 << 20, max_payload))
    assert [op for p in parts for op in p] == items
    for i, p in enumerate(parts):
        total = sum(op.tensor.size for op in p)
        assert total <= max_payload
        # Greedy: the next item would not have fitted.
        if i + 1 < len(parts):
            assert total + parts[i + 1][0].tensor.size > max_payload


def test_a_tensor_bigger_than_max_payload_goes_alone() -> None:
    items = [S(1, 0, 10), S(1, 0, 5000), S(1, 0, 10)]
    parts = list(chunks(items, 1 << 20, 1000))
    assert [[op.tensor.size for op in p] for p in parts] == [[10], [5000], [10]]


def test_chunks_respect_both_limits_at_once() -> None:
    items = [G(1, i, 50) for i in range(1000)]
    parts = list(chunks(items, 1024, 400))
    for p in parts:
        assert sum(op.tensor.size for op in p) <= 400
        assert _body_len(p) <= 1024
    assert [op for p in parts for op in p] == items


def test_packed_tensors_are_kept_for_the_same_objects_only() -> None:
    p = PackedTensors()
    ts = [Tensor(1, i * 4, 4) for i in range(8)]
    raw = p.body(ts)
    assert msgpack.unpackb(raw) == {"tensors": [list(t) for t in ts]}
    assert p.body(list(ts)) is raw  # the same tensors in a new list: kept
    # Equal is not the same: a Tensor built with True for 1 packs to other bytes.
    odd = [Tensor(True, 0, 4), *ts[1:]]  # type: ignore[arg-type]
    assert odd == ts
    raw2 = p.body(odd)
    assert raw2 != raw and msgpack.unpackb(raw2)["tensors"][0][0] is True
    assert p.body(ts) == raw and p.body(ts[:-1]) != raw  # shorter: packed anew
    assert msgpack.unpackb(p.body([])) == {"tensors": []}


def test_a_reply_of_small_rows_is_gathered_and_one_of_large_rows_scattered() -> None:
    from client.queue import GATHER_MAX, GATHER_ROW, Columns, Reads
    from transferd.protocol.constants import Command
    from transferd.protocol.frames import Frame

    def sink(rows: int, size: int, out: bool = False) -> list[memoryview] | None:
        seg = Columns()
        loop = asyncio.new_event_loop()
        try:
            for i in range(rows):
                if out and i == 1:
                    seg.get_out[i] = (memoryview(bytearray(size)), None)
                seg.get_t.append(Tensor(1, i * size, size))
                seg.get_f.append(loop.create_future())
        finally:
            loop.close()
        frame = Frame(int(Command.GET_TENSORS), 0, 1, {}, rows * size)
        return Reads(seg, 0, rows, rows * size).sink(frame)

    assert sink(32, 4096) is None  # 128 KiB of 4 KiB rows: received whole, cut
    assert sink(8, GATHER_ROW) is None
    views = sink(4, 64 << 10)  # 256 KiB of 64 KiB rows: straight into each row's memory
    assert views is not None and [len(v) for v in views] == [64 << 10] * 4
    assert sink(GATHER_MAX // 4096 + 1, 4096) is not None  # over GATHER_MAX in all
    out = sink(32, 4096, out=True)  # a read with out= lands where it said
    assert out is not None and len(out) == 32


def test_a_gathered_reply_of_the_wrong_length_fails_every_read() -> None:
    # A server that lies about a GET_TENSORS reply's payload: no read resolves to a row
    # cut short (or to bytes of the next row); each gets BadFrame.
    from client.queue import Columns, Reads
    from transferd.protocol.constants import Command
    from transferd.protocol.errors import BadFrame
    from transferd.protocol.frames import Frame

    loop = asyncio.new_event_loop()
    try:
        for rows, got in ((4, 15), (4, 17), (1, 3)):
            seg = Columns()
            for i in range(rows):
                seg.get_t.append(Tensor(1, i * 4, 4))
                seg.get_f.append(loop.create_future())
            reads = Reads(seg, 0, rows, rows * 4)
            reply: asyncio.Future[Frame] = loop.create_future()
            reply.set_result(Frame(int(Command.GET_TENSORS), 0, 1, {}, got,
                                   payload=bytearray(got)))
            reads.settle(reply)
            for f in seg.get_f:
                with pytest.raises(BadFrame, match=f"{got} payload bytes for reads of {rows * 4}"):
                    f.result()
        seg = Columns()  # the right length: each row its own bytes
        for i in range(3):
            seg.get_t.append(Tensor(1, i * 2, 2))
            seg.get_f.append(loop.create_future())
        reply = loop.create_future()
        reply.set_result(Frame(int(Command.GET_TENSORS), 0, 1, {}, 6, payload=bytearray(b"aabbcc")))
        Reads(seg, 0, 3, 6).settle(reply)
        assert [f.result() for f in seg.get_f] == [b"aa", b"bb", b"cc"]
    finally:
        loop.close()


def test_the_queue_counts_its_rows_and_sums_its_bytes_at_take() -> None:
    from client.queue import TensorQueue

    q = TensorQueue()
    assert not q and len(q) == 0
    loop = asyncio.new_event_loop()
    try:
        q.add_set(Tensor(1, 0, 4), b"abcd")
        assert q and len(q) == 1
        q.add_get(Tensor(1, 0, 4), loop.create_future())
        q.add_set(Tensor(1, 2, 3), b"xyz")  # overlaps the read: a second segment
        q.add_get(Tensor(2, 0, 7), loop.create_future())
        assert len(q) == 4 and len(q.segs) == 2
        segs = q.take()
        assert [(s.set_bytes, s.get_bytes) for s in segs] == [(4, 4), (3, 7)]
        assert not q and len(q) == 0 and q.take() == []
    finally:
        loop.close()
