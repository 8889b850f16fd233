"""The WRITE's extension block (checksum, trace id) and the traceparent value, sans-IO."""

from __future__ import annotations

import mmap
import random
import re
from typing import Any

import pytest

from transferd.protocol import crc, trace
from transferd.protocol.crc import crc_of
from transferd.protocol.errors import BadRequest, IntegrityError
from transferd.protocol.peer_ext import CRC32C, TRACE, encode_ext, parse_ext
from transferd.protocol.peer_wire import (
    WRITE_HEAD,
    ack_error,
    encode_ack,
    encode_write,
    frame_size,
    parse_write,
)

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_crc32c_is_castagnoli() -> None:
    # The check value of CRC-32C (RFC 3720): "123456789" -> 0xE3069283.
    assert crc_of([b"1234", memoryview(b"56789")]) == 0xE3069283


def _installed() -> list[str]:
    out = []
    for name, _ in crc.BACKENDS:
        try:
            crc.load(name)
        except ImportError:
            continue
        out.append(name)
    return out


@pytest.mark.parametrize("name", [n for n, _ in crc.BACKENDS])
def test_every_backend_computes_the_same_crc(name: str) -> None:
    # A sender on one backend and a receiver on the other must agree: the check value,
    # continuation across cuts at any byte, views of writable (mmap) memory, empty views.
    if name not in _installed():
        pytest.skip(f"the {name} package is not installed here")
    fn = crc.load(name)
    assert fn(b"123456789", 0) == 0xE3069283
    rng = random.Random(20)
    m = mmap.mmap(-1, 1 << 20)
    m[:] = rng.randbytes(1 << 20)
    whole = memoryview(m)
    ref = crc.load(_installed()[-1])
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, 1 << 20), 3))
        v = 0
        for a, b in zip([0, *cuts], [*cuts, 1 << 20], strict=True):
            v = fn(whole[a:b], v)
        v = fn(whole[:0], v)
        assert v == ref(whole, 0)
    del whole
    m.close()


def test_require_keeps_the_fastest_installed() -> None:
    # Which backend is faster depends on the CPU (AVX-512 or not): require() times them.
    crc.require()
    names = _installed()
    assert crc.backend in names
    if len(names) > 1:
        assert set(crc.timings) == set(names)
        assert crc.timings[crc.backend] * (1 - crc.TIE) <= min(crc.timings.values())


def _fake_clock(costs: dict[int, float]) -> tuple[dict[str, Any], Any]:
    """Backends whose calls cost what ``costs`` says (by id of the function), timed by a
    clock that advances by that cost: the choice, without a CPU's noise."""
    now = [0.0]
    last: list[float] = [0.0]

    def make(cost: float) -> Any:
        def fn(data: Any, value: int) -> int:
            last[0] = cost
            return value
        return fn

    def clock() -> float:
        now[0] += last[0]
        last[0] = 0.0
        return now[0]

    return {str(k): make(v) for k, v in costs.items()}, clock


@pytest.mark.parametrize("costs,want", [
    ({1: 2.0, 2: 1.0}, "2"),     # the second twice as fast: kept
    ({1: 1.0, 2: 2.0}, "1"),
    ({1: 1.0, 2: 0.97}, "1"),    # within TIE: the first stays
    ({1: 1.0, 2: 0.90}, "2"),
])
def test_fastest_is_chosen_by_time_not_by_order(costs: dict[int, float], want: str) -> None:
    fns, clock = _fake_clock(costs)
    name, per_gib = crc.fastest(list(fns.items()), clock)
    assert name == want
    assert set(per_gib) == set(fns)


@pytest.mark.parametrize("addrs,lens,span", [
    ([0x1000], [10], None), ([0x1000, 0x2000], [5, 5], None),
    ([0x1000, 0x2000], [4, 6], None), ([0x1000], [10], [0x1000, 100])])
def test_write_with_a_block_round_trips(addrs: list[int], lens: list[int],
                                        span: list[int] | None) -> None:
    raw = trace.parse(TP)
    head = encode_write(1, 2, 3, addrs, lens, 7, span, None, False, encode_ext(0xDEAD, raw))
    assert frame_size(head + bytes(10)) == len(head) + 10
    w = parse_write(head, 0, WRITE_HEAD.unpack_from(head))
    assert (w.crc, w.trace, w.addrs, w.lens) == (0xDEAD, raw, addrs, lens)
    plain = encode_write(1, 2, 3, addrs, lens, 7, span)
    w = parse_write(plain, 0, WRITE_HEAD.unpack_from(plain))
    assert (w.crc, w.trace) == (None, None)


@pytest.mark.parametrize("block,why", [
    (bytes((0x05, 0)), "unknown"),  # a kind that may not be skipped
    (bytes((CRC32C, 3, 1, 2, 3)), "bytes (it has 4)"),
    (encode_ext(1, None) * 2, "twice"),
    (bytes((TRACE, 26)) + bytes(5), "runs past"),
    (b"\x01", "cut short"),
])
def test_a_bad_block_is_refused(block: bytes, why: str) -> None:
    with pytest.raises(BadRequest, match=re.escape(why)):
        parse_ext(block, 0, len(block))


def test_a_skippable_kind_is_skipped() -> None:
    block = bytes((0x90, 3, 9, 9, 9)) + encode_ext(5, None)
    assert parse_ext(block, 0, len(block)) == (5, None)


def test_an_integrity_ack_stays_typed() -> None:
    err = ack_error(1, encode_ack(1, 2, IntegrityError("checksum mismatch: x"))[16:])
    assert isinstance(err, IntegrityError) and err.message == "checksum mismatch: x"
    assert err.to_body()["code"] == "PEER_UNREACHABLE"  # what a client sees


def test_traceparent() -> None:
    raw = trace.parse(TP)
    assert len(raw) == trace.WIRE_LEN and trace.format(raw) == TP
    assert trace.trace_id(raw) == "4bf92f3577b34da6a3ce929d0e0e4736"
    # A later version's extra fields are dropped, as W3C says.
    assert trace.format(trace.parse("01" + TP[2:] + "-extra")) == "01" + TP[2:]
    for bad in ("", "00-" + "0" * 32 + "-00f067aa0ba902b7-01", TP.upper(), "ff" + TP[2:],
                TP + "-x", TP[:-1], 17):
        with pytest.raises(BadRequest):
            trace.parse(bad)
