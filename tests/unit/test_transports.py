"""The transports: the registry, the message discipline on SOCK_SEQPACKET, descriptors.

Real AF_UNIX sockets (socketpair), a real event loop; no daemon.  A small
frame-collecting protocol stands on each end.
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
from typing import Any

import pytest

from tests.helpers import async_test, digest, pattern
from transferd import transports
from transferd.protocol.errors import BadFrame, BadRequest, ProtocolError, TooLarge
from transferd.protocol.frames import Frame, FrameDecoder, encode_frame
from transferd.transports.sockets import SocketTransport


class Collector(asyncio.BufferedProtocol):
    """Decodes frames; keeps them, the errors the transport reported, and its fate."""

    def __init__(self) -> None:
        self.decoder = FrameDecoder()
        self.frames: list[Frame] = []
        self.errors: list[ProtocolError] = []
        self.lost = asyncio.get_running_loop().create_future()
        self.transport: Any = None
        self.arrived = asyncio.Event()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.decoder.buffer_updated(nbytes)
        while (f := self.decoder.next_frame()) is not None:
            self.frames.append(f)
            self.arrived.set()

    def transport_error(self, exc: ProtocolError) -> None:
        self.errors.append(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)

    async def wait_frames(self, n: int, timeout: float = 5.0) -> list[Frame]:
        async def wait() -> None:
            while len(self.frames) < n:
                self.arrived.clear()
                await self.arrived.wait()

        await asyncio.wait_for(wait(), timeout)
        return self.frames


def pair(kind: int, *, message: bool, max_message: int = 65536) -> tuple[Any, Collector, Any,
                                                                         Collector]:
    a, b = socket.socketpair(socket.AF_UNIX, kind)
    for s in (a, b):
        s.setblocking(False)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            s.setsockopt(socket.SOL_SOCKET, opt, 1 << 20)
    loop = asyncio.get_running_loop()
    pa, pb = Collector(), Collector()
    ta = SocketTransport(loop, a, pa, message=message, max_message=max_message)
    tb = SocketTransport(loop, b, pb, message=message, max_message=max_message)
    return ta, pa, tb, pb


# -- the registry ------------------------------------------------------------------------


def test_registry_knows_the_four_schemes() -> None:
    assert {"tcp", "tls", "unix", "seqpacket"} <= set(transports.schemes())
    assert transports.get("seqpacket:///x").kind == "message"
    assert transports.get("unix:///x").fds and not transports.get("tcp://h:1").fds
    assert transports.parse("tcp://[::1]:80") == transports.Endpoint("tcp", "::1", 80)
    assert transports.parse("unix:///run/t.sock").path == "/run/t.sock"
    assert transports.parse("unix:///run/t.sock").url == "unix:///run/t.sock"


@pytest.mark.parametrize(
    "url", ["ftp://x:1", "tcp://nohost", "tcp://h:99999", "tcp://h:", "unix://", "plain"]
)
def test_bad_urls_are_bad_requests(url: str) -> None:
    with pytest.raises(BadRequest):
        transports.parse(url)


# -- the message discipline --------------------------------------------------------------


def test_a_seqpacket_message_read_piecewise_loses_bytes() -> None:
    """Why every message is received whole: the kernel drops what a short read left."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        a.send(b"A" * 100)
        a.send(b"B" * 100)
        assert b.recv(10) == b"A" * 10
        # The other 90 bytes of the first message are gone: the next read is
        # the second message.
        assert b.recv(1000) == b"B" * 100
        # A stream socket keeps them, for contrast.
    c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with c, d:
        c.send(b"A" * 100)
        assert d.recv(10) == b"A" * 10
        assert d.recv(1000) == b"A" * 90


@async_test()
async def test_payload_travels_as_exact_max_message_continuations() -> None:
    ta, _pa, tb, pb = pair(socket.SOCK_SEQPACKET, message=True, max_message=65536)
    # Watch the wire: read the messages raw from the socket the receiver owns.
    payload = pattern(3 * 65536 + 123, 7)
    head = encode_frame(5, 0, 1, {"k": 1}, len(payload))
    raw_a, raw_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    raw_b.setblocking(False)
    for s in (raw_a, raw_b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    loop = asyncio.get_running_loop()
    sender = SocketTransport(loop, raw_a, Collector(), message=True, max_message=65536)
    sender.write_frame(head, [memoryview(payload)], len(payload))
    sizes = []
    for _ in range(5):
        sizes.append(len(raw_b.recv(1 << 20)))
    assert sizes == [len(head), 65536, 65536, 65536, 123]
    sender.close()
    raw_b.close()
    # And end to end the receiver gets one frame with every byte in place.
    ta.write_frame(head, [memoryview(payload)], len(payload))
    (f,) = await pb.wait_frames(1)
    assert f.body == {"k": 1} and f.payload is not None
    assert digest(f.payload) == digest(payload)
    ta.close()
    tb.close()


def _raw_seqpacket(max_message: int = 65536) -> tuple[socket.socket, Any, Collector]:
    raw, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.setblocking(False)
    pb = Collector()
    tb = SocketTransport(asyncio.get_running_loop(), b, pb, message=True,
                         max_message=max_message)
    return raw, tb, pb


async def _refused(pb: Collector, kind: type[ProtocolError]) -> ProtocolError:
    await asyncio.wait_for(pb.lost, 5)
    assert pb.errors and isinstance(pb.errors[0], kind), pb.errors
    return pb.errors[0]


@async_test()
async def test_a_short_continuation_message_is_bad_frame() -> None:
    raw, _tb, pb = _raw_seqpacket()
    with raw:
        raw.send(encode_frame(5, 0, 1, None, 70000))
        raw.send(b"x" * 65535)  # one short of max_message
        err = await _refused(pb, BadFrame)
        assert "exactly 65536" in err.message
        assert not pb.frames


@async_test()
async def test_a_long_last_continuation_is_bad_frame() -> None:
    raw, _tb, pb = _raw_seqpacket()
    with raw:
        raw.send(encode_frame(5, 0, 1, None, 100))
        raw.send(b"x" * 101)  # one more than the remainder
        await _refused(pb, BadFrame)


@async_test()
async def test_header_and_body_split_over_two_messages_is_bad_frame() -> None:
    raw, _tb, pb = _raw_seqpacket()
    with raw:
        frame = encode_frame(9, 0, 1, {"padding": "y" * 50})
        raw.send(frame[:30])
        raw.send(frame[30:])
        await _refused(pb, BadFrame)


@async_test()
async def test_two_frames_merged_into_one_message_is_bad_frame() -> None:
    raw, _tb, pb = _raw_seqpacket()
    with raw:
        raw.send(encode_frame(9, 0, 1, {"a": 1}) + encode_frame(9, 0, 2, {"a": 2}))
        await _refused(pb, BadFrame)
        assert not pb.frames


@async_test()
async def test_a_message_over_the_limit_is_too_large() -> None:
    raw, tb, pb = _raw_seqpacket()
    tb.continuation.first_limit = 4096 + 24
    with raw:
        raw.send(encode_frame(9, 0, 1, {"a": "z" * 5000}))
        await _refused(pb, TooLarge)


@async_test()
async def test_a_header_shorter_than_24_bytes_is_bad_frame() -> None:
    raw, _tb, pb = _raw_seqpacket()
    with raw:
        raw.send(b"TD\x09")
        await _refused(pb, BadFrame)


@async_test()
async def test_many_small_tensors_are_joined_under_the_iov_limit() -> None:
    ta, _pa, tb, pb = pair(socket.SOCK_SEQPACKET, message=True, max_message=65536)
    views = [memoryview(pattern(4, i)) for i in range(40000)]  # 160000 bytes, 40000 views
    total = b"".join(views)
    ta.write_frame(encode_frame(17, 0, 3, None, len(total)), views, len(total))
    (f,) = await pb.wait_frames(1)
    assert f.payload is not None and digest(f.payload) == digest(total)
    ta.close()
    tb.close()


# -- back-pressure -----------------------------------------------------------------------


@async_test()
async def test_write_buffer_limits_pause_and_resume_the_writer() -> None:
    for kind, message in ((socket.SOCK_STREAM, False), (socket.SOCK_SEQPACKET, True)):
        ta, pa, tb, pb = pair(kind, message=message)
        paused: list[bool] = []
        pa.pause_writing = lambda p=paused: p.append(True)  # type: ignore[method-assign]
        pa.resume_writing = lambda p=paused: p.append(False)  # type: ignore[method-assign]
        ta.set_write_buffer_limits(high=0, low=0)
        tb.pause_reading()
        big = pattern(8 << 20, 3)
        ta.write_frame(encode_frame(5, 0, 1, None, len(big)), [memoryview(big)], len(big))
        assert ta.get_write_buffer_size() > 0 and paused == [True]
        tb.resume_reading()
        (f,) = await pb.wait_frames(1)
        assert f.payload is not None and digest(f.payload) == digest(big)
        for _ in range(100):
            if ta.get_write_buffer_size() == 0:
                break
            await asyncio.sleep(0.01)
        assert paused == [True, False] and ta.get_write_buffer_size() == 0
        ta.close()
        tb.close()


class _Sipping(Collector):
    """Takes a message 100 bytes at a time and pauses the transport after the first 100
    of each: the rest of the message must wait for resume_reading, bytes intact."""

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)[:100]

    def buffer_updated(self, nbytes: int) -> None:
        super().buffer_updated(nbytes)
        self.transport.pause_reading()


@async_test()
async def test_a_pause_mid_message_keeps_the_rest_until_resume() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setblocking(False)
    b.setblocking(False)
    pb = _Sipping()
    tb = SocketTransport(asyncio.get_running_loop(), b, pb, message=True, max_message=65536)
    body = {"blob": pattern(1000, 5).hex()}
    with a:
        a.send(encode_frame(9, 0, 1, body) + b"")
        a.send(encode_frame(9, 0, 2, {"n": 2}))
        for _ in range(200):  # a 100-byte sip a resume, bounded
            if len(pb.frames) == 2:
                break
            await asyncio.sleep(0.005)
            assert not tb.is_reading()
            tb.resume_reading()
        assert [f.seq for f in pb.frames] == [1, 2] and pb.frames[0].body == body
        assert not pb.errors
    tb.close()


# -- descriptors -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["stream", "seqpacket"])
@async_test()
async def test_descriptors_travel_both_ways_with_their_frame(kind: str) -> None:
    sock_type = socket.SOCK_STREAM if kind == "stream" else socket.SOCK_SEQPACKET
    ta, pa, tb, pb = pair(sock_type, message=kind == "seqpacket")
    with tempfile.TemporaryFile() as f1, tempfile.TemporaryFile() as f2:
        f1.write(b"one")
        f1.flush()
        f2.write(b"two")
        f2.flush()
        ta.send_fds([f1.fileno(), f2.fileno()])
        ta.write_frame(encode_frame(9, 0, 1, {"fds": 2}), [], 0)
        ta.write_frame(encode_frame(9, 0, 2, {"fds": 0}), [], 0)
        frames = await pb.wait_frames(2)
        assert frames[0].body == {"fds": 2}
        got = tb.take_fds(2)
        try:
            assert [os.pread(fd, 3, 0) for fd in got] == [b"one", b"two"]
            assert all(fd not in (f1.fileno(), f2.fileno()) for fd in got)
        finally:
            for fd in got:
                os.close(fd)
        with pytest.raises(BadFrame):
            tb.take_fds(1)
        # And back the other way.
        tb.send_fds([f2.fileno()])
        tb.write_frame(encode_frame(9, 1, 1, {"fds": 1}), [], 0)
        await pa.wait_frames(1)
        (back,) = ta.take_fds(1)
        assert os.pread(back, 3, 0) == b"two"
        os.close(back)
    ta.close()
    tb.close()


@async_test()
async def test_descriptors_nobody_took_are_closed_with_the_transport() -> None:
    ta, _pa, tb, pb = pair(socket.SOCK_STREAM, message=False)
    r, w = os.pipe()
    try:
        ta.send_fds([r])
        ta.write_frame(encode_frame(9, 0, 1, None), [], 0)
        await pb.wait_frames(1)
        (held,) = list(tb.received_fds)
        os.fstat(held)
        tb.close()
        await asyncio.wait_for(pb.lost, 5)
        with pytest.raises(OSError):
            os.fstat(held)
    finally:
        os.close(r)
        os.close(w)
        ta.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@async_test()
async def test_descriptors_past_the_cap_are_all_closed_not_only_the_first() -> None:
    """A flood of descriptors: BAD_FRAME, and none of the flood's leaks (the rest of the
    message that found the table full used to stay open: 15 of every 16)."""
    ta, _pa, tb, pb = pair(socket.SOCK_STREAM, message=False)
    r, w = os.pipe()
    try:
        before = _open_fds()
        for i in range(6):  # 6 x 16 > 64
            ta.send_fds([r] * 16)
            ta.write_frame(encode_frame(9, 0, i, None), [], 0)
        await asyncio.wait_for(pb.lost, 5)
        assert [str(e) for e in pb.errors] == ["BAD_FRAME: more than 64 file descriptors not taken"]
        tb.close()
        await asyncio.sleep(0.05)
        assert _open_fds() <= before, (before, _open_fds())
    finally:
        ta.close()
        os.close(r)
        os.close(w)
