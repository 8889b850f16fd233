"""Property tests of the frame decoder (issue 11, hostile input): any bytes, cut into any
reads, end in frames or a typed ProtocolError, never another exception or a hang; and
valid frames come out whole whatever the read boundaries."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is a dev dependency")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from transferd.protocol.constants import HEADER_SIZE, MAGIC  # noqa: E402
from transferd.protocol.errors import ProtocolError  # noqa: E402
from transferd.protocol.frames import HEADER, FrameDecoder, encode_frame  # noqa: E402

SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

# Bodies msgpack can carry: what a request's map may hold.
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)
bodies = st.dictionaries(st.text(min_size=1, max_size=8), values, max_size=5)


def feed_in_cuts(dec: FrameDecoder, data: bytes, cuts: list[int]) -> list[Any]:
    """Feed ``data`` in pieces at ``cuts``; the frames, bounded by the bytes fed."""
    out: list[Any] = []
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    for a, b in itertools.pairwise(points):
        out += dec.feed(data[a:b])
        assert len(out) <= len(data) // HEADER_SIZE + 1  # no frame from nothing
    return out


@SETTINGS
@given(st.binary(max_size=600), st.lists(st.integers(0, 600), max_size=8))
def test_any_bytes_end_in_frames_or_a_protocol_error(data: bytes, cuts: list[int]) -> None:
    dec = FrameDecoder(max_body=256, max_payload=256)
    try:
        feed_in_cuts(dec, data, cuts)
    except ProtocolError as exc:
        assert exc.code.value in ("BAD_FRAME", "TOO_LARGE"), exc


@SETTINGS
@given(st.integers(0, 255), st.integers(0, 255), st.integers(0, 0xFFFFFFFF),
       st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFFFF), st.integers(0, (1 << 64) - 1),
       st.binary(max_size=300))
def test_any_header_after_the_magic(cmd: int, flags: int, seq: int, body_len: int,
                                    reserved: int, payload_len: int, rest: bytes) -> None:
    """Headers with the right magic and any fields: a frame, a wait, or a typed error."""
    raw = HEADER.pack(MAGIC, cmd, flags, seq, body_len, reserved, payload_len) + rest
    dec = FrameDecoder(max_body=256, max_payload=1 << 20)
    try:
        frames = dec.feed(raw)
    except ProtocolError:
        return
    for f in frames:
        assert f.body_len <= 256 and f.payload_len <= 1 << 20


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 255), st.integers(0, 0xFFFFFFFF), bodies,
                          st.binary(max_size=64)), min_size=1, max_size=6),
       st.lists(st.integers(0, 4096), max_size=10))
def test_valid_frames_come_out_whole_at_any_read_boundaries(
    specs: list[tuple[int, int, dict[str, Any], bytes]], cuts: list[int]
) -> None:
    wire = b"".join(encode_frame(cmd, 0, seq, body, len(p)) + p for cmd, seq, body, p in specs)
    frames = feed_in_cuts(FrameDecoder(), wire, cuts)
    assert len(frames) == len(specs)
    for f, (cmd, seq, body, payload) in zip(frames, specs, strict=True):
        assert (f.cmd, f.seq, f.body) == (cmd, seq, body)
        assert bytes(f.payload or b"") == payload


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 255), st.integers(0, 0xFFFFFFFF), bodies,
                          st.binary(max_size=300)), min_size=1, max_size=8),
       st.lists(st.integers(0, 4096), max_size=12), st.sampled_from([32, 64, 100]))
def test_an_elastic_buffer_grows_and_shrinks_at_any_read_boundaries(
    specs: list[tuple[int, int, dict[str, Any], bytes]], cuts: list[int], small: int
) -> None:
    """A server connection's decoder once authenticated (FrameDecoder.elastic): it grows
    when a receive fills it and goes back to ``small`` when quiet, mid-stream as often as
    the reads fall; every frame still comes out whole, and the buffer is small after."""
    wire = b"".join(encode_frame(cmd, 0, seq, body, len(p)) + p for cmd, seq, body, p in specs)
    dec = FrameDecoder(buffer_size=small)
    dec.elastic(small)
    frames = feed_in_cuts(dec, wire, cuts)
    assert len(frames) == len(specs)
    for f, (cmd, seq, body, payload) in zip(frames, specs, strict=True):
        assert (f.cmd, f.seq, f.body) == (cmd, seq, body)
        assert bytes(f.payload or b"") == payload
    assert dec.next_frame() is None
    assert len(dec._buf) == small or dec._end - dec._mark >= dec._offered
