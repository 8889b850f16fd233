"""While a GET streams its payload from device memory, the connection's other frames are
held (Session.hold_frames) until its last byte.  Held frames are not in the transport, so
whatever paces itself on the connection's write buffer must wait for them too: a message
handed to a receive of this connection (SUBMIT_RECVS) is acknowledged to its sender only
once it is out, and the next is handed only then.  Before, ``write_blocked`` looked at the
transport alone: every message sent meanwhile was taken into the held list at once,
uncharged, and its sender told ok (a list as long as the senders cared to make it).

On the stand-in device (tests/standin_daemon.py) made slow, so the GET streams for a
second while the test's client reads nothing and the socket's buffers take the bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
from collections.abc import Iterator

import pytest

from client import Client
from tests.helpers import DaemonProcess, RawConn, async_test
from tests.integration.engine_cluster import STANDIN_COMMAND
from transferd.protocol.constants import HEADER_SIZE, Command, Flag

KiB = 1 << 10
SIZE = 1 << 20  # the GET: 4 chunks of 256 KiB at 0.3 s each
MSG = 16 * KiB
N = 12


@pytest.fixture(scope="module")
def slow_standin() -> Iterator[DaemonProcess]:
    d = DaemonProcess(
        command=STANDIN_COMMAND,
        env={"STANDIN_CHUNK": str(256 * KiB), "STANDIN_CHUNKS": "1",
             "STANDIN_DELAY_S": "0.3"},
    )
    with d:
        yield d


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(min(1 << 20, n - len(out)))
        if not got:
            raise ConnectionError("closed")
        out += got
    return bytes(out)


@async_test(timeout=60)
async def test_messages_wait_for_frames_held_behind_a_streamed_reply(
        slow_standin: DaemonProcess) -> None:
    with RawConn.to(slow_standin, timeout=20) as c1:
        c1.hello()
        r = c1.request(Command.SUBMIT_RECVS, {"len": MSG, "count": 4})
        assert r.flags == int(Flag.REPLY), r.body
        buf = c1.request(Command.ALLOC_BUFFER, {"device": "standin:0", "size": SIZE})
        assert buf.flags == int(Flag.REPLY), buf.body
        bid = buf.body["buffer"]
        data = os.urandom(SIZE)
        s = c1.request(Command.SET_TENSOR, {"tensor": [bid, 0, SIZE]}, data)
        assert s.flags == int(Flag.REPLY), s.body
        async with await Client.connect(slow_standin.url, timeout=20) as c2:
            addr = await c2.main_address()
            seq = c1.send(Command.GET_TENSOR, {"tensor": [bid, 0, SIZE]})
            head = await asyncio.to_thread(_read_exactly, c1.sock, HEADER_SIZE)
            started = time.monotonic()  # the reply streams: every other frame is held
            msgs = [os.urandom(MSG) for _ in range(N)]
            sends = [await c2.submit_send(addr, m) for m in msgs]
            await asyncio.sleep(0.4)
            acked = sum(c.done() for c in sends)
            rest = await asyncio.to_thread(_read_exactly, c1.sock, SIZE)
            streamed = time.monotonic() - started
            assert streamed > 0.5, f"the GET streamed for {streamed:.2f} s only: no proof"
            # Nothing was out while the reply streamed: at most the first message was
            # handed (held behind the reply, unacknowledged).
            assert acked == 0, f"{acked} of {N} messages acknowledged while held"
            frames = c1.decoder.feed(head + rest)
            reply = frames.pop(0) if frames else c1.recv()
            assert reply.seq == seq and reply.flags == int(Flag.REPLY)
            assert hashlib.sha256(reply.payload or b"").digest() == hashlib.sha256(
                data).digest()
            # Then every message arrives, whole and in order, and each sender is told ok.
            got = []
            c1.frames += frames
            while len(got) < N:
                f = c1.recv()
                assert f.cmd == Command.SUBMIT_RECVS and f.flags == int(Flag.EVENT), f
                got.append(bytes(f.payload or b""))
            assert got == msgs
            for c in sends:
                await c.wait(20)
