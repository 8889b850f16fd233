"""The rdma:// transport's message logic, over a real AF_UNIX SOCK_SEQPACKET socket pair
(which keeps message boundaries as RDMA SEND/RECV does): a frame cut into its messages,
payload continuation, each message received whole and scattered into the frame decoder,
and short, long or merged messages refused as BAD_FRAME."""

from __future__ import annotations

import hashlib
import socket
import threading
from collections.abc import Iterator

import pytest

from transferd.protocol.constants import HEADER_SIZE
from transferd.protocol.errors import BadFrame, TooLarge
from transferd.protocol.frames import Frame, FrameDecoder, encode_frame
from transferd.transports.continuation import (
    HELLO_MESSAGE,
    MIN_MAX_MESSAGE,
    MessageReader,
    cut,
    scatter,
)

MAX = MIN_MAX_MESSAGE


class Sink:
    """A BufferedProtocol-like sink: scattered bytes go into a real FrameDecoder."""

    def __init__(self) -> None:
        self.decoder = FrameDecoder(max_body=1 << 20, max_payload=1 << 30)
        self.frames: list[Frame] = []

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, n: int) -> None:
        self.decoder.buffer_updated(n)
        while (f := self.decoder.next_frame()) is not None:
            self.frames.append(f)

    # The transport's side of scatter(): always reading, never closing.
    def is_closing(self) -> bool:
        return False

    def is_reading(self) -> bool:
        return True


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * MAX)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * MAX)
        s.settimeout(5)
    yield a, b
    a.close()
    b.close()


def send_frame(sock: socket.socket, cmd: int, body: dict[str, object], payload: bytes,
               max_message: int = MAX) -> int:
    msgs = cut(encode_frame(cmd, 0, 7, body, len(payload)), [memoryview(payload)],
               len(payload), max_message)
    for views in msgs:
        assert sock.sendmsg(views) == sum(map(len, views))
    return len(msgs)


def receive(sock: socket.socket, reader: MessageReader, count: int) -> None:
    """``count`` messages, each whole: one recv of one byte more than allowed."""
    buf = memoryview(bytearray(max(reader.want, MAX) + 1))
    for _ in range(count):
        want = reader.want
        n = sock.recv_into(buf[: want + 1])
        reader.feed(buf[:n])


def reader_for(sink: Sink, first: int = 1 << 20) -> MessageReader:
    return MessageReader(lambda m: scatter(m, sink, sink), max_message=MAX, first_limit=first)


@pytest.mark.parametrize("size", [0, 1, MAX - 1, MAX, MAX + 1, 3 * MAX, 3 * MAX + 17])
def test_frames_cross_whole_and_scattered(pair, size: int) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    payload = bytes((i * 7 + size) % 251 for i in range(size))
    n = send_frame(a, 0x05, {"tensor": [1, 0, size]}, payload)
    assert n == 1 + -(-size // MAX)  # header+body, then ceil(payload / max_message)
    sink = Sink()
    r = reader_for(sink)
    receive(b, r, n)
    assert r.payload_left == 0 and len(sink.frames) == 1
    f = sink.frames[0]
    assert f.cmd == 0x05 and f.body == {"tensor": [1, 0, size]} and f.seq == 7
    got = bytes(f.payload or b"")
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()


def test_messages_are_exactly_max_message_but_the_last(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    send_frame(a, 0x05, {}, b"x" * (2 * MAX + 5))
    sizes = []
    buf = bytearray(4 * MAX)
    for _ in range(4):
        sizes.append(b.recv_into(buf))
    assert sizes == [HEADER_SIZE, MAX, MAX, 5]


def test_back_to_back_frames(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    counts: list[int] = []
    # The sender runs ahead of the receiver, as far as the socket buffers let it.
    t = threading.Thread(target=lambda: counts.extend(
        send_frame(a, 0x05, {"i": i}, bytes([i]) * (i * 30000)) for i in range(5)))
    t.start()
    sink = Sink()
    receive(b, reader_for(sink), 1 + 2 + 2 + 3 + 3)  # 1 + ceil(i * 30000 / 65536) each
    t.join(5)
    assert sum(counts) == 11
    assert [f.body["i"] for f in sink.frames] == list(range(5))
    assert [len(f.payload or b"") for f in sink.frames] == [i * 30000 for i in range(5)]


def test_a_short_continuation_is_bad_frame(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    head = encode_frame(0x05, 0, 1, {}, 2 * MAX)
    a.send(head)
    a.send(b"y" * (MAX - 1))  # one byte short of max_message
    r = reader_for(Sink())
    receive(b, r, 1)
    with pytest.raises(BadFrame, match=f"exactly {MAX}"):
        receive(b, r, 1)


def test_merged_header_and_payload_is_bad_frame(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    head = encode_frame(0x05, 0, 1, {"a": 1}, 10)
    a.send(head + b"0123456789")  # the payload merged into the header's message
    with pytest.raises(BadFrame, match="header and body are one message"):
        receive(b, reader_for(Sink()), 1)


def test_two_frames_merged_into_one_message_is_bad_frame(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    a.send(encode_frame(0x08, 0, 1) + encode_frame(0x08, 0, 2))
    with pytest.raises(BadFrame):
        receive(b, reader_for(Sink()), 1)


def test_a_too_long_continuation_is_bad_frame(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    a.send(encode_frame(0x05, 0, 1, {}, 10))
    a.send(b"z" * 11)
    r = reader_for(Sink())
    receive(b, r, 1)
    with pytest.raises(BadFrame, match="exactly 10"):
        receive(b, r, 1)


def test_before_hello_the_first_message_is_small(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    a.send(encode_frame(0x00, 0, 1, {"x": "y" * 5000}))
    r = reader_for(Sink(), first=HELLO_MESSAGE)
    with pytest.raises(TooLarge, match=f"limit of {HELLO_MESSAGE}"):
        receive(b, r, 1)


def test_shorter_than_a_header(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    a.send(b"TD\x00")
    with pytest.raises(BadFrame, match="shorter than a frame header"):
        receive(b, reader_for(Sink()), 1)


def test_reading_a_message_piecewise_loses_its_rest(pair) -> None:  # type: ignore[no-untyped-def]
    """Why every message is received whole: on a message socket (and on RDMA RECV) a
    receive smaller than the message drops the rest of it."""
    a, b = pair
    a.send(b"A" * 1000)
    a.send(b"B" * 10)
    first = b.recv(HEADER_SIZE)
    second = b.recv(4096)
    assert first == b"A" * HEADER_SIZE and second == b"B" * 10  # 976 bytes are gone


def test_cut_checks_its_arguments() -> None:
    with pytest.raises(ValueError):
        cut(b"h", [memoryview(b"abc")], 4, MAX)
    assert [len(m) for m in cut(b"h", [], 0, MAX)] == [1]
