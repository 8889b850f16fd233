"""The rdma:// transport's logic (MessageTransport) over a real AF_UNIX SOCK_SEQPACKET
socket pair as its carrier of whole messages, in place of the RC queue pair: frames
written with write_frame arrive whole at the other side's protocol with their payload
cut into max_message continuations; a protocol that pauses mid-message gets the rest on
resume; short, long and merged messages are BAD_FRAME and close the connection."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
from collections.abc import Callable, Sequence

from tests.helpers import async_test
from transferd.protocol.errors import BadFrame, ProtocolError, TooLarge, TransferdError
from transferd.protocol.frames import Frame, FrameDecoder, encode_frame
from transferd.transports.continuation import HELLO_MESSAGE, MIN_MAX_MESSAGE
from transferd.transports.msgtransport import MessageTransport

MAX = MIN_MAX_MESSAGE


class SeqpacketCarrier:
    """Whole messages over a SOCK_SEQPACKET socket: one recv per message."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self.loop, self.sock = loop, sock
        sock.setblocking(False)
        self.on_message: Callable[[memoryview], None] = lambda m: None
        self.on_close: Callable[[TransferdError | None], None] = lambda e: None
        self.on_drain: Callable[[], None] | None = None
        self.queued = 0
        self.sent: list[int] = []  # sizes of the messages sent
        self._buf = memoryview(bytearray(4 * MAX + 1))
        self._closed = False
        loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            n = self.sock.recv_into(self._buf)
        except BlockingIOError:
            return
        if n == 0:
            self.close()
            return
        self.on_message(self._buf[:n])

    def send(self, views: Sequence[memoryview]) -> None:
        self.sent.append(sum(map(len, views)))
        self.sock.setblocking(True)  # small tests: let the kernel hold them
        try:
            self.sock.sendmsg(list(views))
        finally:
            self.sock.setblocking(False)

    def pause(self) -> None:
        self.loop.remove_reader(self.sock.fileno())

    def resume(self) -> None:
        self.loop.add_reader(self.sock.fileno(), self._readable)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        self.loop.call_soon(self.on_close, None)


class Recorder(asyncio.BufferedProtocol):
    def __init__(self, pause_after: int | None = None) -> None:
        self.decoder = FrameDecoder(max_body=1 << 20, max_payload=1 << 30)
        self.frames: list[Frame] = []
        self.errors: list[ProtocolError] = []
        self.lost = asyncio.get_running_loop().create_future()
        self.transport: MessageTransport | None = None
        self.pause_after = pause_after

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, MessageTransport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, n: int) -> None:
        self.decoder.buffer_updated(n)
        while (f := self.decoder.next_frame()) is not None:
            self.frames.append(f)
            if self.pause_after is not None and len(self.frames) == self.pause_after:
                assert self.transport is not None
                self.transport.pause_reading()

    def transport_error(self, exc: ProtocolError) -> None:
        self.errors.append(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


def pair(loop: asyncio.AbstractEventLoop, rx: Recorder, *, first: int = MAX
         ) -> tuple[MessageTransport, SeqpacketCarrier, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    carrier = SeqpacketCarrier(loop, b)
    t = MessageTransport(loop, carrier, rx, max_message=MAX, recv_limit=first)
    return t, carrier, a


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met in time")


@async_test(timeout=30)
async def test_frames_cross_with_continuation_and_checksums() -> None:
    loop = asyncio.get_running_loop()
    rx = Recorder()
    t_rx, _, a = pair(loop, rx)
    # The sending side: a MessageTransport over the other end.
    tx_proto = Recorder()
    tx_carrier = SeqpacketCarrier(loop, a)
    t_tx = MessageTransport(loop, tx_carrier, tx_proto, max_message=MAX)
    sizes = [0, 1, MAX, MAX + 1, 3 * MAX + 5]
    payloads = [bytes((i + n) % 256 for i in range(n)) for n in sizes]
    for k, p in enumerate(payloads):
        t_tx.write_frame(encode_frame(0x06, 0x01, k, {"k": k}, len(p)),
                         [memoryview(p)[: len(p) // 2], memoryview(p)[len(p) // 2 :]], len(p))
    await until(lambda: len(rx.frames) == len(sizes))
    # Each frame: its head, then ceil(payload / max_message) messages of max_message.
    assert tx_carrier.sent[:1] == [len(encode_frame(0x06, 0x01, 0, {"k": 0}))]
    assert tx_carrier.sent[1:3] == [len(encode_frame(0x06, 0x01, 1, {"k": 1}, 1)), 1]
    assert sum(1 for s in tx_carrier.sent if s == MAX) == 1 + 1 + 3
    for k, (f, p) in enumerate(zip(rx.frames, payloads, strict=True)):
        assert f.seq == k and f.body == {"k": k}
        assert hashlib.sha256(bytes(f.payload or b"")).digest() == hashlib.sha256(p).digest()
    assert t_rx.get_extra_info("transferd_message") is True
    assert t_rx.get_extra_info("transferd_fds") is False
    t_tx.close()
    assert await asyncio.wait_for(rx.lost, 5) is None  # the other end's close arrives


@async_test(timeout=30)
async def test_a_protocol_that_pauses_mid_stream_gets_the_rest_on_resume() -> None:
    loop = asyncio.get_running_loop()
    rx = Recorder(pause_after=1)
    t, _, a = pair(loop, rx)
    for k in range(3):
        a.send(encode_frame(0x08, 0, k))
    a.send(encode_frame(0x05, 0, 9, {}, 10))
    a.send(b"0123456789")
    await until(lambda: len(rx.frames) == 1)
    await asyncio.sleep(0.05)
    assert len(rx.frames) == 1 and not t.is_reading()
    rx.pause_after = None
    t.resume_reading()
    await until(lambda: len(rx.frames) == 4)
    assert [f.seq for f in rx.frames] == [0, 1, 2, 9] and rx.frames[3].payload == b"0123456789"
    t.close()


async def _refused(raw: Sequence[bytes], first: int = MAX) -> ProtocolError:
    loop = asyncio.get_running_loop()
    rx = Recorder()
    _t, _, a = pair(loop, rx, first=first)
    for m in raw:
        a.send(m)
    await asyncio.wait_for(rx.lost, 5)  # the connection is closed
    assert len(rx.errors) == 1
    a.close()
    return rx.errors[0]


@async_test(timeout=30)
async def test_short_long_and_merged_messages_are_bad_frame() -> None:
    head = encode_frame(0x05, 0, 1, {}, 2 * MAX)
    # a continuation one byte short
    e = await _refused([head, b"x" * (MAX - 1)])
    assert isinstance(e, BadFrame) and f"exactly {MAX}" in str(e)
    # a continuation one byte long
    e = await _refused([encode_frame(0x05, 0, 1, {}, 10), b"x" * 11])
    assert isinstance(e, BadFrame)
    # payload merged into the head's message
    e = await _refused([encode_frame(0x05, 0, 1, {}, 4) + b"abcd"])
    assert isinstance(e, BadFrame) and "one message" in str(e)
    # two frames merged into one message
    e = await _refused([encode_frame(0x08, 0, 1) + encode_frame(0x08, 0, 2)])
    assert isinstance(e, BadFrame)
    # before HELLO is done, a head over HELLO's limit
    e = await _refused([encode_frame(0x00, 0, 1, {"pad": "p" * 5000})], first=HELLO_MESSAGE)
    assert isinstance(e, TooLarge)
