"""The sans-IO frame layer: encoding, decoding, payload sinks, every malformed header."""

from __future__ import annotations

import hashlib
import random
import struct
from typing import Any

import msgpack
import pytest

from transferd.protocol import frames
from transferd.protocol.constants import (
    DEFAULT_MAX_BODY,
    HEADER_SIZE,
    MAGIC,
    Command,
    ErrorCode,
    Flag,
)
from transferd.protocol.errors import BadFrame, ProtocolError, TooLarge
from transferd.protocol.frames import (
    DISCARD,
    HEADER,
    Frame,
    FrameDecoder,
    decode_header,
    encode_frame,
    encode_header,
    pack_body,
)
from transferd.protocol.messages import Tensor

# One request of every command shape in PROTOCOL.md's table (and the replies that
# carry a body or payload), as (cmd, flags, body, payload).
T = [3, 4096, 1024]
SHAPES: list[tuple[int, int, dict[str, Any] | None, bytes]] = [
    (Command.HELLO, 0, {"major": 1, "minor": 2, "client": "test"}, b""),
    (Command.HELLO, 0, {"major": 1, "minor": 2, "client": "test", "token": "s3cret"}, b""),
    (
        Command.HELLO,
        Flag.REPLY,
        {
            "major": 1,
            "minor": 2,
            "patch": 0,
            "server": "transferd/0.1.0",
            "features": ["batched_get", "batched_set"],
            "max_body": DEFAULT_MAX_BODY,
            "max_payload": 1 << 34,
        },
        b"",
    ),
    (Command.GET_DEVICES, 0, None, b""),
    (
        Command.GET_DEVICES,
        Flag.REPLY,
        {"devices": [{"name": "cpu", "total": 1 << 32, "free": 1 << 31, "alignment": 4096,
                      "max_size": 1 << 32}]},
        b"",
    ),
    (Command.ALLOC_BUFFER, 0, {"device": "cpu", "size": 1 << 20}, b""),
    (Command.ALLOC_BUFFER, Flag.REPLY, {"buffer": 7, "size": 1 << 20}, b""),
    (Command.FREE_BUFFER, 0, {"buffer": 7}, b""),
    (Command.BUFFER_CLEAR, 0, {"buffer": 7, "value": 255}, b""),
    (Command.SET_TENSOR, 0, {"tensor": [7, 0, 5]}, b"hello"),
    (Command.SET_TENSOR, Flag.NO_REPLY, {"tensor": [7, 0, 5]}, b"hello"),
    (Command.GET_TENSOR, 0, {"tensor": [7, 0, 5]}, b""),
    (Command.GET_TENSOR, Flag.REPLY, None, b"hello"),
    (Command.COPY_TENSOR, 0, {"src": [7, 0, 5], "dst": [8, 10, 5]}, b""),
    (Command.SYNCHRONIZE, 0, None, b""),
    (Command.SYNCHRONIZE, Flag.REPLY, None, b""),
    (Command.STATS, 0, None, b""),
    (
        Command.STATS,
        Flag.REPLY,
        {"commands": {c.name: i for i, c in enumerate(Command)}, "bytes_in": 10, "bytes_out": 20},
        b"",
    ),
    (Command.GET_TENSORS, 0, {"tensors": [[7, 0, 3], [7, 3, 4], [8, 0, 0]]}, b""),
    (Command.GET_TENSORS, Flag.REPLY, None, b"abcdefg"),
    (Command.SET_TENSORS, Flag.NO_REPLY, {"tensors": [[7, 0, 3], [7, 3, 4]]}, b"abcdefg"),
    (Command.SET_TENSOR, Flag.EVENT | Flag.ERROR, {"code": "OUT_OF_BOUNDS", "message": "x"}, b""),
    (Command.GET_TENSOR, Flag.REPLY | Flag.ERROR, {"code": "NOT_FOUND", "message": "no"}, b""),
    (0x3F, Flag.EVENT, {"kind": "done", "blob": b"\x00\x01\xff"}, b""),
]


def stream_of(shapes: list[tuple[int, int, dict[str, Any] | None, bytes]]) -> bytes:
    out = bytearray()
    for seq, (cmd, flags, body, payload) in enumerate(shapes, start=1):
        out += encode_frame(cmd, flags, seq, body, len(payload)) + payload
    return bytes(out)


def as_tuples(fs: list[Frame]) -> list[tuple[int, int, int, dict[str, Any], bytes]]:
    return [
        (f.cmd, int(f.flags), f.seq, f.body, bytes(f.payload) if f.payload is not None else b"")
        for f in fs
    ]


EXPECTED = [
    (int(cmd), int(flags), seq, body or {}, payload)
    for seq, (cmd, flags, body, payload) in enumerate(SHAPES, start=1)
]


# -- encoding -------------------------------------------------------------------------


def test_header_layout_is_the_documented_struct() -> None:
    raw = encode_header(Command.SET_TENSORS, Flag.NO_REPLY, 0x01020304, 17, 1 << 40)
    assert len(raw) == HEADER_SIZE == 24
    assert raw[:2] == b"TD" == MAGIC
    assert raw[2] == 0x11 and raw[3] == 0x08
    assert raw[4:8] == (0x01020304).to_bytes(4, "little")
    assert raw[8:12] == (17).to_bytes(4, "little")
    assert raw[12:16] == b"\0\0\0\0"
    assert raw[16:24] == (1 << 40).to_bytes(8, "little")
    assert struct.unpack("<2sBBIIIQ", raw) == (b"TD", 0x11, 0x08, 0x01020304, 17, 0, 1 << 40)
    h = decode_header(raw)
    assert (h.magic, h.cmd, h.flags, h.seq, h.body_len, h.reserved, h.payload_len) == (
        b"TD", 0x11, 0x08, 0x01020304, 17, 0, 1 << 40
    )


def test_empty_body_is_zero_bytes() -> None:
    assert pack_body(None) == b"" == pack_body({})
    raw = encode_frame(Command.SYNCHRONIZE, 0, 9)
    assert len(raw) == HEADER_SIZE
    assert decode_header(raw).body_len == 0


def test_body_is_msgpack_with_bin_type() -> None:
    raw = encode_frame(Command.HELLO, 0, 1, {"client": "x", "blob": b"\x00\xff"})
    h = decode_header(raw)
    body = raw[HEADER_SIZE:]
    assert h.body_len == len(body)
    assert msgpack.unpackb(body, raw=False) == {"client": "x", "blob": b"\x00\xff"}
    # bytes travel as msgpack bin (0xc4), not str.
    assert b"\xc4\x02\x00\xff" in body


def test_seq_wraps_to_32_bits() -> None:
    raw = encode_header(Command.STATS, 0, (1 << 32) + 5, 0, 0)
    assert decode_header(raw).seq == 5


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{Command(s[0]).name}-{int(s[1])}")
def test_every_command_shape_round_trips(shape: tuple[int, int, Any, bytes]) -> None:
    cmd, flags, body, payload = shape
    raw = encode_frame(cmd, flags, 42, body, len(payload)) + payload
    (f,) = FrameDecoder().feed(raw)
    assert f.cmd == cmd and int(f.flags) == int(flags) and f.seq == 42
    assert f.body == (body or {})
    assert f.payload_len == len(payload)
    assert (bytes(f.payload) if f.payload is not None else b"") == payload
    assert f.wire_len == len(raw)
    assert f.is_reply == bool(flags & Flag.REPLY)
    assert f.is_error == bool(flags & Flag.ERROR)
    assert f.is_event == bool(flags & Flag.EVENT)
    assert f.no_reply == bool(flags & Flag.NO_REPLY)


# -- stream splitting -------------------------------------------------------------------


def test_whole_stream_at_once() -> None:
    assert as_tuples(FrameDecoder().feed(stream_of(SHAPES))) == EXPECTED


def test_byte_by_byte_gives_the_same_frames() -> None:
    data = stream_of(SHAPES)
    dec = FrameDecoder()
    got: list[Frame] = []
    for i in range(len(data)):
        got += dec.feed(data[i : i + 1])
    assert as_tuples(got) == EXPECTED
    assert dec.next_frame() is None


@pytest.mark.parametrize("seed", range(20))
def test_random_splits_give_the_same_frames(seed: int) -> None:
    rng = random.Random(seed)
    # Mix in some payloads above the streaming threshold so the direct path is split too.
    shapes = list(SHAPES)
    for _ in range(3):
        n = rng.choice([frames.STREAM_THRESHOLD - 1, frames.STREAM_THRESHOLD, 300_000])
        shapes.insert(rng.randrange(len(shapes)), (Command.SET_TENSOR, 0, {"tensor": [1, 0, n]},
                                                    rng.randbytes(n)))
    rng.shuffle(shapes)
    data = stream_of(shapes)
    expected = [
        (int(c), int(fl), s, b or {}, p) for s, (c, fl, b, p) in enumerate(shapes, start=1)
    ]
    dec = FrameDecoder()
    got: list[Frame] = []
    pos = 0
    while pos < len(data):
        n = rng.choice([1, 2, 3, 7, 23, 24, 25, 100, 4096, 70_000, 1 << 20])
        got += dec.feed(data[pos : pos + n])
        pos += n
    assert as_tuples(got) == expected


def test_get_buffer_protocol_with_partial_writes() -> None:
    """The BufferedProtocol pattern: write fewer bytes than offered, repeatedly."""
    data = stream_of(SHAPES)
    dec = FrameDecoder()
    got: list[Frame] = []
    rng = random.Random(7)
    pos = 0
    while pos < len(data):
        buf = dec.get_buffer(-1)
        assert len(buf) > 0
        n = min(len(buf), rng.randint(1, 50), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        dec.buffer_updated(n)
        pos += n
        while (f := dec.next_frame()) is not None:
            got.append(f)
    assert as_tuples(got) == EXPECTED


def test_body_larger_than_read_chunk() -> None:
    tensors = [[1, i * 8, 8] for i in range(40_000)]  # ~ 400 KiB of msgpack
    raw = encode_frame(Command.GET_TENSORS, 0, 3, {"tensors": tensors})
    assert decode_header(raw).body_len > frames.READ_CHUNK
    dec = FrameDecoder()
    got: list[Frame] = []
    for i in range(0, len(raw), 10_000):
        got += dec.feed(raw[i : i + 10_000])
    (f,) = got
    assert f.body["tensors"] == tensors


# -- payload sinks -----------------------------------------------------------------------


def test_payload_scatters_into_several_memoryviews() -> None:
    payload = random.Random(1).randbytes(100_000)
    dests = [bytearray(10), bytearray(0), bytearray(60_000), bytearray(39_990)]
    seen: list[Frame] = []

    def sink(frame: Frame) -> list[memoryview]:
        seen.append(frame)
        return [memoryview(d) for d in dests]

    dec = FrameDecoder(payload_sink=sink)
    raw = encode_frame(Command.SET_TENSORS, 0, 5, {"tensors": []}, len(payload)) + payload
    got: list[Frame] = []
    for i in range(0, len(raw), 777):
        got += dec.feed(raw[i : i + 777])
    (f,) = got
    assert seen and seen[0].seq == 5 and seen[0].body == {"tensors": []}
    assert f.payload is None and not f.discarded
    assert hashlib.sha256(b"".join(dests)).digest() == hashlib.sha256(payload).digest()


def test_sink_accepts_non_byte_formats() -> None:
    import array

    dest = array.array("I", [0] * 4)
    payload = bytes(range(16))
    dec = FrameDecoder(payload_sink=lambda f: [memoryview(dest)])
    dec.feed(encode_frame(Command.SET_TENSOR, 0, 1, None, 16) + payload)
    assert dest.tobytes() == payload


def test_discard_sink_swallows_payload_and_keeps_the_stream_in_step() -> None:
    big = random.Random(2).randbytes(200_000)
    follow = b"after"
    dec = FrameDecoder(payload_sink=lambda f: DISCARD if f.seq == 1 else None)
    raw = (
        encode_frame(Command.SET_TENSOR, 0, 1, {"tensor": [9, 0, len(big)]}, len(big))
        + big
        + encode_frame(Command.SET_TENSOR, 0, 2, {"tensor": [9, 0, 5]}, 5)
        + follow
    )
    got: list[Frame] = []
    for i in range(0, len(raw), 4096):
        got += dec.feed(raw[i : i + 4096])
    a, b = got
    assert a.discarded and a.payload is None and a.payload_len == len(big)
    assert not b.discarded and b.payload == bytearray(follow) and b.seq == 2


def test_none_sink_collects_into_a_bytearray() -> None:
    dec = FrameDecoder(payload_sink=lambda f: None)
    (f,) = dec.feed(encode_frame(Command.GET_TENSOR, Flag.REPLY, 1, None, 3) + b"xyz")
    assert isinstance(f.payload, bytearray) and f.payload == b"xyz"


def test_sink_asked_once_per_payload_frame_and_never_for_empty_payloads() -> None:
    asked: list[int] = []

    def sink(frame: Frame) -> None:
        asked.append(frame.seq)
        return None

    dec = FrameDecoder(payload_sink=sink)
    dec.feed(stream_of(SHAPES))
    expect = [seq for seq, s in enumerate(SHAPES, start=1) if s[3]]
    assert asked == expect


def test_sink_for_next_frame_is_asked_only_after_previous_is_taken() -> None:
    """A consumer that executes frame N before pulling N+1 is never overtaken."""
    asked: list[int] = []
    dec = FrameDecoder(payload_sink=lambda f: asked.append(f.seq))
    raw = (
        encode_frame(Command.SET_TENSOR, 0, 1, None, 2) + b"ab"
        + encode_frame(Command.SET_TENSOR, 0, 2, None, 2) + b"cd"
    )
    buf = dec.get_buffer(-1)
    buf[: len(raw)] = raw
    dec.buffer_updated(len(raw))
    assert asked == []
    f1 = dec.next_frame()
    assert f1 is not None and f1.seq == 1 and asked == [1]
    f2 = dec.next_frame()
    assert f2 is not None and f2.seq == 2 and asked == [1, 2]


def test_large_payload_is_received_straight_into_the_sink() -> None:
    size = 4 * frames.STREAM_THRESHOLD
    dest = bytearray(size)
    dec = FrameDecoder(payload_sink=lambda f: [memoryview(dest)])
    head = encode_frame(Command.SET_TENSOR, 0, 1, {"tensor": [1, 0, size]}, size)
    assert dec.feed(head) == []
    buf = dec.get_buffer(-1)
    # The decoder hands out the destination itself: writing there is writing into dest.
    buf[:5] = b"HELLO"
    assert dest[:5] == b"HELLO"
    assert len(buf) == size
    payload = random.Random(3).randbytes(size)
    buf[:] = payload
    dec.buffer_updated(size)
    f = dec.next_frame()
    assert f is not None and f.payload is None
    assert hashlib.sha256(dest).hexdigest() == hashlib.sha256(payload).hexdigest()


def test_direct_path_crosses_segments() -> None:
    n = frames.STREAM_THRESHOLD
    dests = [bytearray(n), bytearray(2 * n)]
    dec = FrameDecoder(payload_sink=lambda f: [memoryview(d) for d in dests])
    dec.feed(encode_frame(Command.SET_TENSORS, 0, 1, None, 3 * n))
    first = dec.get_buffer(-1)
    assert len(first) == n
    first[:] = b"\x01" * n
    dec.buffer_updated(n)
    second = dec.get_buffer(-1)
    assert len(second) == 2 * n
    second[: n // 2] = b"\x02" * (n // 2)
    dec.buffer_updated(n // 2)
    rest = dec.get_buffer(-1)
    assert len(rest) == 2 * n - n // 2
    rest[:] = b"\x03" * len(rest)
    dec.buffer_updated(len(rest))
    f = dec.next_frame()
    assert f is not None and f.seq == 1
    assert dests[0] == b"\x01" * n
    assert dests[1] == b"\x02" * (n // 2) + b"\x03" * (2 * n - n // 2)


def test_small_payload_stays_in_the_internal_buffer() -> None:
    dest = bytearray(100)
    dec = FrameDecoder(payload_sink=lambda f: [memoryview(dest)])
    dec.feed(encode_frame(Command.SET_TENSOR, 0, 1, None, 100))
    buf = dec.get_buffer(-1)
    buf[:3] = b"abc"
    assert dest[:3] == b"\0\0\0"  # not the sink's memory
    dec.buffer_updated(3)
    dec.feed(b"d" * 97)
    assert dest == b"abc" + b"d" * 97


def test_sink_of_wrong_size_is_refused() -> None:
    # A payload that does not fit what its request set up breaks the protocol.
    dec = FrameDecoder(payload_sink=lambda f: [memoryview(bytearray(3))])
    with pytest.raises(BadFrame, match="payload of 4 bytes where 3 were expected") as ei:
        dec.feed(encode_frame(Command.SET_TENSOR, 0, 1, None, 4) + b"abcd")
    assert ei.value.seq == 1
    with pytest.raises(BadFrame):
        dec.next_frame()


# -- malformed input -------------------------------------------------------------------


def bad_header(**kw: Any) -> bytes:
    fields = {"magic": MAGIC, "cmd": Command.GET_TENSOR, "flags": 0, "seq": 77,
              "body_len": 0, "reserved": 0, "payload_len": 0}
    fields.update(kw)
    return HEADER.pack(*fields.values())


@pytest.mark.parametrize(
    ("header", "code"),
    [
        (bad_header(magic=b"XX"), ErrorCode.BAD_FRAME),
        (bad_header(magic=b"DT"), ErrorCode.BAD_FRAME),
        (bad_header(magic=b"\0\0"), ErrorCode.BAD_FRAME),
        (bad_header(reserved=1), ErrorCode.BAD_FRAME),
        (bad_header(reserved=0x80000000), ErrorCode.BAD_FRAME),
        (bad_header(flags=0x10), ErrorCode.BAD_FRAME),
        (bad_header(flags=0x80 | Flag.REPLY), ErrorCode.BAD_FRAME),
        (bad_header(body_len=1025), ErrorCode.TOO_LARGE),
        (bad_header(body_len=0xFFFFFFFF), ErrorCode.TOO_LARGE),
        (bad_header(payload_len=4097), ErrorCode.TOO_LARGE),
        (bad_header(payload_len=(1 << 64) - 1), ErrorCode.TOO_LARGE),
    ],
    ids=[
        "magic-XX", "magic-swapped", "magic-zero", "reserved-1", "reserved-high", "flag-0x10",
        "flag-0x80", "body-over", "body-max", "payload-over", "payload-max",
    ],
)
def test_malformed_header(header: bytes, code: ErrorCode) -> None:
    dec = FrameDecoder(max_body=1024, max_payload=4096)
    with pytest.raises(ProtocolError) as info:
        dec.feed(header)
    err = info.value
    assert err.code == code
    assert err.seq == 77
    assert err.fatal
    assert isinstance(err, TooLarge if code == ErrorCode.TOO_LARGE else BadFrame)
    assert dec.current_cmd == Command.GET_TENSOR  # an error reply can name the frame's cmd
    # Once broken, the decoder refuses to go on.
    with pytest.raises(BadFrame):
        dec.next_frame()
    with pytest.raises(BadFrame):
        dec.get_buffer(-1)
    with pytest.raises(BadFrame):
        dec.feed(encode_frame(Command.STATS, 0, 1))


def test_limits_are_inclusive() -> None:
    dec = FrameDecoder(max_body=1024, max_payload=4096)
    pad = "a" * 1018  # fixmap (1) + "x" (2) + str16 header (3) + 1018 = 1024 bytes
    raw = pack_body({"x": pad})
    assert len(raw) == 1024
    (f,) = dec.feed(
        encode_header(Command.SET_TENSOR, 0, 1, 1024, 4096) + raw + b"p" * 4096
    )
    assert f.body == {"x": pad} and f.payload is not None and len(f.payload) == 4096


def test_bad_header_after_good_frames_keeps_the_good_ones() -> None:
    dec = FrameDecoder(max_body=1024)
    good = encode_frame(Command.STATS, 0, 1) + encode_frame(Command.SYNCHRONIZE, 0, 2)
    got = dec.feed(good)
    assert [f.seq for f in got] == [1, 2]
    with pytest.raises(BadFrame) as info:
        dec.feed(bad_header(magic=b"NO", seq=3))
    assert info.value.seq == 3


def body_frame(raw_body: bytes, seq: int = 55) -> bytes:
    return encode_header(Command.GET_DEVICES, 0, seq, len(raw_body), 0) + raw_body


@pytest.mark.parametrize(
    "raw_body",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x81\xa1a",  # map missing its value (truncated)
        msgpack.packb({"a": 1}) + b"\x00",  # trailing garbage
        b"\xff" * 8,
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb("a string"),
        msgpack.packb(7),
        msgpack.packb(None),
        msgpack.packb({1: "x"}),  # non-string key
        msgpack.packb({"ok": 1, 2: "x"}),
        msgpack.packb({b"bin": 1}, use_bin_type=True),  # binary key is not a string
        msgpack.packb({(1, 2): 1}),
    ],
    ids=[
        "c1", "truncated", "trailing", "ff", "list", "str", "int", "nil", "int-key",
        "mixed-keys", "bin-key", "array-key",
    ],
)
def test_bad_body(raw_body: bytes) -> None:
    dec = FrameDecoder()
    with pytest.raises(BadFrame) as info:
        dec.feed(body_frame(raw_body, seq=55))
    assert info.value.seq == 55 and info.value.code == ErrorCode.BAD_FRAME
    assert dec.current_cmd == Command.GET_DEVICES
    with pytest.raises(BadFrame):
        dec.next_frame()


def test_bad_body_split_over_many_feeds_is_still_reported() -> None:
    raw = body_frame(msgpack.packb([1, 2]), seq=9)
    dec = FrameDecoder()
    with pytest.raises(BadFrame) as info:
        for b in raw:
            dec.feed(bytes([b]))
    assert info.value.seq == 9


def test_incomplete_frame_is_not_returned() -> None:
    raw = encode_frame(Command.SET_TENSOR, 0, 1, {"tensor": [1, 0, 10]}, 10) + b"0123456789"
    dec = FrameDecoder()
    assert dec.feed(raw[:-1]) == []
    assert dec.next_frame() is None
    (f,) = dec.feed(raw[-1:])
    assert f.payload == b"0123456789"


def test_tensor_value_helpers() -> None:
    t = Tensor(3, 16, 32)
    assert t.to_wire() == [3, 16, 32]
    (f,) = FrameDecoder().feed(encode_frame(Command.GET_TENSOR, 0, 1, {"tensor": t.to_wire()}))
    assert Tensor(*f.body["tensor"]) == t


def test_a_list_over_its_commands_cap_refuses_the_frame_not_the_stream() -> None:
    dec = FrameDecoder()
    dec.array_caps = {int(Command.GET_TENSORS): 4}
    over = encode_frame(Command.GET_TENSORS, 0, 7, {"tensors": [[1, 0, 1]] * 5})
    at_cap = encode_frame(Command.GET_TENSORS, 0, 8, {"tensors": [[1, 0, 1]] * 4})
    other = encode_frame(Command.SET_TENSORS, 0, 9, {"tensors": [[1, 0, 1]] * 5})
    f1, f2, f3 = dec.feed(b"".join(bytes(x) for x in (over, at_cap, other)))
    assert isinstance(f1.refused, TooLarge) and f1.refused.seq == 7 and f1.body == {}
    assert "more than 4 entries" in f1.refused.message
    assert f2.refused is None and len(f2.body["tensors"]) == 4
    assert f3.refused is None and len(f3.body["tensors"]) == 5  # no cap for SET_TENSORS
    # Invalid msgpack under a cap is still BAD_FRAME (framing cannot go on).
    with pytest.raises(BadFrame):
        dec.feed(encode_header(Command.GET_TENSORS, 0, 11, 1, 0) + b"\xc1")


def test_a_repeated_batch_body_is_the_same_list_in_a_new_dict() -> None:
    # The server decodes a batch that repeats its command's last one byte for byte once:
    # the same list (so the handler may reuse its check), a new dict every frame.
    dec = FrameDecoder()
    dec.array_caps = {int(Command.GET_TENSORS): 4, int(Command.SET_TENSORS): 4}
    body = {"tensors": [[1, 0, 4], [1, 4, 4]]}
    get1, set1, get2, set2 = (
        encode_frame(c, 0, s, body)
        for s, c in enumerate((Command.GET_TENSORS, Command.SET_TENSORS) * 2, 1))
    f1, f2, f3, f4 = dec.feed(b"".join((get1, set1, get2, set2)))
    assert [f.seq for f in (f1, f2, f3, f4)] == [1, 2, 3, 4]
    assert f3.body == f1.body == body and f3.body is not f1.body
    assert f3.body["tensors"] is f1.body["tensors"]  # GET after GET, with a SET between
    assert f4.body["tensors"] is f2.body["tensors"]
    assert f2.body["tensors"] is not f1.body["tensors"]  # one memory per command
    # One byte different (True for 1: what the handler refuses) is decoded anew.
    (f5,) = dec.feed(encode_frame(Command.GET_TENSORS, 0, 5, {"tensors": [[True, 0, 4],
                                                                           [1, 4, 4]]}))
    assert f5.body["tensors"] is not f1.body["tensors"] and f5.body["tensors"][0][0] is True
    (f6,) = dec.feed(get1)  # the last GET_TENSORS is f5's now
    assert f6.body["tensors"] is not f1.body["tensors"] and f6.body == body


def test_a_repeated_batch_over_a_lowered_cap_is_refused() -> None:
    dec = FrameDecoder()
    dec.array_caps = {int(Command.GET_TENSORS): 4}
    frame = encode_frame(Command.GET_TENSORS, 0, 1, {"tensors": [[1, 0, 1]] * 3})
    (f1,) = dec.feed(frame)
    assert f1.refused is None
    dec.array_caps = {int(Command.GET_TENSORS): 2}  # (a reload lowered max_tensors)
    (f2,) = dec.feed(frame)
    assert isinstance(f2.refused, TooLarge) and f2.body == {}
    (f3,) = dec.feed(frame)  # refused again, not remembered as good
    assert isinstance(f3.refused, TooLarge)
    # Commands without a cap (every command on the client side) remember nothing.
    (g1, g2) = FrameDecoder().feed(frame + frame)
    assert g1.body == g2.body and g1.body["tensors"] is not g2.body["tensors"]


def test_a_batch_body_over_repeat_body_is_not_remembered() -> None:
    # What a connection keeps between frames is bounded: a larger batch is decoded anew.
    dec = FrameDecoder()
    dec.array_caps = {int(Command.GET_TENSORS): 1 << 20}
    small = {"tensors": [[1, 0, 1]] * 10}
    big = {"tensors": [[1, 0, 1]] * (frames.REPEAT_BODY // 4)}
    assert len(pack_body(big)) > frames.REPEAT_BODY >= len(pack_body(small))
    b1, b2 = dec.feed(encode_frame(Command.GET_TENSORS, 0, 1, big) +
                      encode_frame(Command.GET_TENSORS, 0, 2, big))
    assert b1.body == b2.body and b1.body["tensors"] is not b2.body["tensors"]
    s1, s2 = dec.feed(encode_frame(Command.GET_TENSORS, 0, 3, small) +
                      encode_frame(Command.GET_TENSORS, 0, 4, small))
    assert s1.body["tensors"] is s2.body["tensors"]


def test_a_body_length_the_other_side_claims_is_not_allocated_before_its_bytes_come() -> None:
    """A client takes the server's announced max_body (any u64); a header claiming a
    3 GiB body, with nothing after it, must not make the decoder allocate 3 GiB: its
    buffer grows with the bytes that arrive (doubling), never to the size told."""
    import tracemalloc

    dec = FrameDecoder(max_body=1 << 62)
    tracemalloc.start()
    try:
        dec.feed(frames.encode_header(Command.GET_TENSORS, 0, 1, 3 << 30, 0))
        dec.feed(b"\x00" * 100_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * frames.READ_CHUNK, peak


def test_a_body_many_times_the_buffer_comes_whole_in_small_receives() -> None:
    """The growing buffer: a 6 MiB body fed in 64 KiB pieces (and one byte at a time at
    its end) decodes byte for byte, in memory bounded by twice what arrived."""
    import tracemalloc

    blob = random.Random(3).randbytes(6 << 20)
    raw = encode_frame(Command.GET_TENSORS, 0, 9, {"blob": blob})
    dec = FrameDecoder(max_body=1 << 62)
    got: list[Frame] = []
    tracemalloc.start()
    try:
        cut = len(raw) - 7
        for i in range(0, cut, 64 * 1024):
            got += dec.feed(raw[i : min(i + 64 * 1024, cut)])
        for i in range(cut, len(raw)):
            got += dec.feed(raw[i : i + 1])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    (f,) = got
    assert hashlib.sha256(f.body["blob"]).digest() == hashlib.sha256(blob).digest()
    assert peak < 3 * len(raw) + 4 * frames.READ_CHUNK, peak
