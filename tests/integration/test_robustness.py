"""Bad peers and many peers: garbage, frames before HELLO, limits, clients that vanish,
a daemon that dies, concurrent clients, connections that must not wait on each other."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import threading
import time

import pytest

from client import Client, SyncClient
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, async_test, digest, pattern
from transferd.protocol.constants import MAGIC, Command, ErrorCode, Flag
from transferd.protocol.errors import ConnectionLost, Timeout
from transferd.protocol.frames import HEADER, encode_frame, encode_header

MiB = 1 << 20


async def check_works(c: Client, seed: int = 0, size: int = 4096) -> None:
    """A full round trip on an existing connection, checked by checksum."""
    buf = await c.alloc_buffer(size)
    data = pattern(size, seed)
    c.set_tensor_async(buf.tensor(), data)
    fut = c.get_tensor_async(buf.tensor())
    await c.flush()
    assert digest(fut.result()) == digest(data)
    assert digest(await c.get_tensor(buf.tensor())) == digest(data)
    await c.free_buffer(buf)


def header(**kw: int | bytes) -> bytes:
    f: dict[str, int | bytes] = {"magic": MAGIC, "cmd": int(Command.STATS), "flags": 0,
                                 "seq": 4242, "body_len": 0, "reserved": 0, "payload_len": 0}
    f.update(kw)
    return HEADER.pack(*f.values())


# -- one bad connection, the others unaffected ----------------------------------------------

BAD_AFTER_HELLO = {
    "bad-magic": (header(magic=b"XY"), ErrorCode.BAD_FRAME),
    "http": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", ErrorCode.BAD_FRAME),
    "reserved": (header(reserved=7), ErrorCode.BAD_FRAME),
    "flags": (header(flags=0x40), ErrorCode.BAD_FRAME),
    "body-not-msgpack": (encode_header(Command.STATS, 0, 4242, 1, 0) + b"\xc1",
                         ErrorCode.BAD_FRAME),
    "body-not-map": (encode_header(Command.STATS, 0, 4242, 4, 0) + b"\x93\x01\x02\x03",
                     ErrorCode.BAD_FRAME),
    "body-int-keys": (encode_header(Command.STATS, 0, 4242, 3, 0) + b"\x81\x01\x02",
                      ErrorCode.BAD_FRAME),
    "body-too-large": (header(body_len=(4 << 20) + 1), ErrorCode.TOO_LARGE),
    "payload-too-large": (header(cmd=int(Command.SET_TENSOR), payload_len=(1 << 34) + 1),
                          ErrorCode.TOO_LARGE),
}


@pytest.mark.parametrize("case", list(BAD_AFTER_HELLO))
@async_test()
async def test_garbage_closes_only_that_connection(daemon: DaemonProcess, case: str) -> None:
    data, code = BAD_AFTER_HELLO[case]
    async with await Client.connect(daemon.url) as good:
        await check_works(good, 1)
        with RawConn.to(daemon) as raw:
            raw.hello()
            await asyncio.to_thread(raw.send_raw, data)
            f = await asyncio.to_thread(raw.recv)
            assert f.flags == Flag.REPLY | Flag.ERROR
            assert f.body["code"] == code
            assert isinstance(f.body["message"], str)
            assert f.cmd == data[2]  # the offending frame's cmd byte
            if data[:2] == MAGIC:
                assert f.seq == 4242  # and its seq
            assert await asyncio.to_thread(raw.closed_by_peer)
        await check_works(good, 2)
    async with await Client.connect(daemon.url) as fresh:
        await check_works(fresh, 3)


def test_too_large_is_judged_against_the_announced_limits(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(env={"TRANSFERD_SERVER_MAX_BODY": "2048",
                            "TRANSFERD_SERVER_MAX_PAYLOAD": "65536"})
    with RawConn.to(d) as raw:
        hello = raw.hello().body
        assert (hello["max_body"], hello["max_payload"]) == (2048, 65536)
        buf = raw.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 65536}).body["buffer"]
        # Exactly at the limits: accepted.
        body = {"tensor": [buf, 0, 65536], "pad": "p" * 1000}
        f = raw.request(Command.SET_TENSOR, body, payload=b"\x01" * 65536)
        assert f.flags == Flag.REPLY
        raw.send_raw(header(body_len=2049, seq=77))
        f = raw.recv()
        assert f.body["code"] == ErrorCode.TOO_LARGE and f.seq == 77
        assert raw.closed_by_peer()
    with RawConn.to(d) as raw:
        raw.hello()
        raw.send_raw(header(cmd=int(Command.SET_TENSOR), payload_len=65537, seq=78))
        f = raw.recv()
        assert f.body["code"] == ErrorCode.TOO_LARGE and f.seq == 78
        assert raw.closed_by_peer()


@pytest.mark.parametrize(
    "first",
    [
        encode_frame(Command.GET_DEVICES, 0, 9),
        encode_frame(Command.STATS, 0, 9),
        encode_frame(Command.SET_TENSOR, 0, 9, {"tensor": [1, 0, 5000]}, 5000) + b"z" * 5000,
        encode_frame(Command.GET_TENSORS, 0, 9, {"tensors": [[1, 0, 5]]}),
        encode_frame(0x7E, 0, 9),
    ],
    ids=["get-devices", "stats", "set-with-payload", "get-tensors", "unknown-cmd"],
)
@async_test()
async def test_frame_before_hello_gets_no_hello(daemon: DaemonProcess, first: bytes) -> None:
    async with await Client.connect(daemon.url) as good:
        buf = await good.alloc_buffer(5000)
        with RawConn.to(daemon) as raw:
            await asyncio.to_thread(raw.send_raw, first)
            f = await asyncio.to_thread(raw.recv)
            assert f.flags == Flag.REPLY | Flag.ERROR and f.seq == 9
            assert f.body["code"] == ErrorCode.NO_HELLO
            assert await asyncio.to_thread(raw.closed_by_peer)
        # Nothing of the refused frame landed anywhere.
        assert await good.get_tensor(buf.tensor()) == bytes(5000)
        await good.free_buffer(buf)
        await check_works(good)


@async_test(timeout=60)
async def test_random_garbage_never_takes_the_daemon_down(daemon: DaemonProcess) -> None:
    rng = random.Random(1234)
    async with await Client.connect(daemon.url) as good:
        for i in range(40):
            with RawConn.to(daemon, timeout=5) as raw:
                if i % 2:
                    raw.hello()
                junk = rng.randbytes(rng.randint(1, 300))
                if i % 4 == 3:
                    junk = MAGIC + junk  # get past the magic now and then
                await asyncio.to_thread(raw.send_raw, junk)
                # Either an error and a close, or (a header still incomplete) silence;
                # half-close our side so the daemon sees EOF either way.
                raw.sock.shutdown(socket.SHUT_WR)
                closed = await asyncio.to_thread(raw.closed_by_peer, 5.0)
                assert closed, f"case {i}: connection left open after EOF"
                for f in raw.frames:
                    if f.is_error:
                        assert f.body["code"] in {c.value for c in ErrorCode}
            if i % 10 == 9:
                await check_works(good, i)
    assert daemon.alive()


@async_test()
async def test_client_vanishing_mid_payload(daemon: DaemonProcess) -> None:
    async with await Client.connect(daemon.url) as good:
        buf = await good.alloc_buffer(4 * MiB)
        data = pattern(4 * MiB, 8)
        await good.set_tensor(buf.tensor(), data)
        for cut in (0, 1, 100_000, 4 * MiB - 1):
            with RawConn.to(daemon) as raw:
                raw.hello()
                raw.send_raw(encode_frame(Command.SET_TENSOR, 0, 5, {"tensor": buf.tensor()
                                                                     .to_wire()}, 4 * MiB))
                raw.send_raw(b"\xaa" * cut)
            # Bytes that did arrive may have landed (they were in flight); the daemon
            # stays up and the rest of the buffer keeps its contents.
            got = await good.get_tensor(buf.tensor())
            assert got[cut:] == data[cut:]
        with RawConn.to(daemon) as raw:
            raw.hello()
            raw.send(Command.GET_TENSOR, {"tensor": buf.tensor().to_wire()})
            # Close without reading the 4 MiB reply.
        await check_works(good)
        await good.free_buffer(buf)


# -- connections never wait on each other -----------------------------------------------------


@async_test(timeout=60)
async def test_a_stalled_upload_does_not_block_another_connection(
    daemon: DaemonProcess,
) -> None:
    size = 32 * MiB
    data = pattern(size, 9)
    async with await Client.connect(daemon.url) as c:
        big = await c.alloc_buffer(size)
        with RawConn.to(daemon, timeout=30) as raw:
            raw.hello()
            raw.send_raw(encode_frame(Command.SET_TENSOR, 0, 7, {"tensor": big.tensor()
                                                                 .to_wire()}, size))
            half = size // 2
            await asyncio.to_thread(raw.send_raw, data[:half])
            # The upload is stuck half-way; another connection is served meanwhile.
            t0 = time.monotonic()
            for i in range(20):
                await check_works(c, 100 + i)
            assert time.monotonic() - t0 < 20
            await asyncio.to_thread(raw.send_raw, data[half:])
            f = await asyncio.to_thread(raw.recv)
            assert f.seq == 7 and f.flags == Flag.REPLY
        assert digest(await c.get_tensor(big.tensor())) == digest(data)
        await c.free_buffer(big)


@async_test(timeout=60)
async def test_an_unread_download_does_not_block_another_connection(
    daemon: DaemonProcess,
) -> None:
    size = 64 * MiB
    data = pattern(size, 10)
    async with await Client.connect(daemon.url) as c:
        big = await c.alloc_buffer(size)
        await c.set_tensor(big.tensor(), data)
        with RawConn.to(daemon, timeout=30) as raw:
            raw.hello()
            raw.send(Command.GET_TENSOR, {"tensor": big.tensor().to_wire()})
            # 64 MiB do not fit in socket buffers: the daemon's send is stalled on us.
            await asyncio.sleep(0.2)
            for i in range(20):
                await check_works(c, 200 + i)
            f = await asyncio.to_thread(raw.recv)
            assert f.payload is not None and digest(f.payload) == digest(data)
        # Same with the real client: one connection mid-way through a big read.
        async with await Client.connect(daemon.url) as c2:
            slow = asyncio.ensure_future(c2.get_tensor(big.tensor()))
            await check_works(c, 300)
            assert digest(await slow) == digest(data)
        await c.free_buffer(big)


@async_test(timeout=90)
async def test_concurrent_clients(daemon: DaemonProcess) -> None:
    clients, loops = 8, 15

    async def worker(k: int) -> int:
        async with await Client.connect(daemon.url) as c:
            size = 64 * 1024 + k
            buf = await c.alloc_buffer(4 * size)
            n = 0
            for i in range(loops):
                data = [pattern(size, k * 1000 + i * 4 + j) for j in range(4)]
                for j in range(4):
                    c.set_tensor_async(buf.tensor(j * size, size), data[j])
                futs = [c.get_tensor_async(buf.tensor(j * size, size)) for j in range(4)]
                if i % 3 == 0:
                    await c.set_tensor(buf.tensor(0, size), data[0])
                await c.flush()
                assert [digest(f.result()) for f in futs] == [digest(d) for d in data]
                whole = await c.get_tensor(buf.tensor())
                assert digest(whole) == digest(b"".join(data))
                n += 1
            await c.free_buffer(buf)
            return n

    done = await asyncio.gather(*(worker(k) for k in range(clients)))
    assert done == [loops] * clients


def test_concurrent_sync_clients_in_threads(daemon: DaemonProcess) -> None:
    errors: list[BaseException] = []
    results: dict[int, str] = {}

    def worker(k: int) -> None:
        try:
            with SyncClient(daemon.url) as c:
                buf = c.alloc_buffer(256 * 1024)
                for i in range(10):
                    data = pattern(256 * 1024, k * 100 + i)
                    c.set_tensor(buf.tensor(), data)
                    got = c.get_tensor(buf.tensor())
                    assert digest(got) == digest(data)
                    results[k] = digest(got)
                c.free_buffer(buf)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert len(results) == 4


@async_test()
async def test_many_connections_of_one_client_share_buffers(daemon: DaemonProcess) -> None:
    conns = [await Client.connect(daemon.url) for _ in range(4)]
    try:
        buf = await conns[0].alloc_buffer(4 * 4096)
        parts = [pattern(4096, 50 + i) for i in range(4)]
        await asyncio.gather(
            *(c.set_tensor(buf.tensor(i * 4096, 4096), parts[i]) for i, c in enumerate(conns))
        )
        for c in conns:
            assert digest(await c.get_tensor(buf.tensor())) == digest(b"".join(parts))
        await conns[3].free_buffer(buf)
    finally:
        for c in conns:
            await c.close()


# -- a daemon that stops answering or dies ------------------------------------------------------


@async_test()
async def test_killed_daemon_fails_pending_requests(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    c = await Client.connect(d.url)
    buf = await c.alloc_buffer(4096)
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGSTOP)  # frozen: requests stay pending
    try:
        queued = c.get_tensor_async(buf.tensor())
        flushing = asyncio.ensure_future(c.flush())
        sync_get = asyncio.ensure_future(c.get_tensor(buf.tensor()))
        await asyncio.sleep(0.3)
        assert not sync_get.done() and not queued.done() and not flushing.done()
    finally:
        d.kill()
    for fut in (sync_get, queued, flushing):
        with pytest.raises(ConnectionLost):
            await asyncio.wait_for(fut, 10)
    # Later calls fail at once instead of hanging.
    with pytest.raises(ConnectionLost):
        await asyncio.wait_for(c.get_devices(), 5)
    with pytest.raises(ConnectionLost):
        c.set_tensor_async(buf.tensor(), bytes(4096))
        await asyncio.wait_for(c.flush(), 5)
    await asyncio.wait_for(c.close(), 5)


@async_test()
async def test_request_timeout(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    assert d.proc is not None
    async with Client(d.url, timeout=0.3) as c:
        buf = await c.alloc_buffer(16)
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(Timeout):
                await c.get_tensor(buf.tensor())
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        # The late reply is dropped; the connection still works.
        await check_works(c)


@async_test()
async def test_connect_to_nothing_fails_fast() -> None:
    from transferd.protocol.errors import PeerUnreachable

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    with pytest.raises(PeerUnreachable):
        await Client.connect(f"tcp://127.0.0.1:{port}", connect_timeout=5)
    from transferd.protocol.errors import BadRequest

    with pytest.raises(BadRequest):
        await Client.connect("http://127.0.0.1:1")


@async_test()
async def test_flush_waits_for_reads_another_task_sent(daemon_factory: DaemonFactory) -> None:
    """A read queued by one task and drained by another task's synchronous call is
    still complete when the first task's flush() returns."""
    d = daemon_factory()
    assert d.proc is not None
    async with await Client.connect(d.url) as c:
        buf = await c.alloc_buffer(8)
        await c.set_tensor(buf.tensor(), b"abcdefgh")
        os.kill(d.proc.pid, signal.SIGSTOP)  # hold the replies back
        try:
            mine = c.get_tensor_async(buf.tensor())
            other = asyncio.ensure_future(c.get_devices())  # drains the queue
            await asyncio.sleep(0.05)
            flushing = asyncio.ensure_future(c.flush())  # nothing left to send
            await asyncio.sleep(0.2)
            assert not mine.done() and not flushing.done()
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        await flushing
        assert mine.done() and mine.result() == b"abcdefgh"
        await other


@async_test()
async def test_cancelled_flush_leaves_no_read_pending(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    assert d.proc is not None
    async with await Client.connect(d.url) as c:
        buf = await c.alloc_buffer(8)
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            read = c.get_tensor_async(buf.tensor())
            flushing = asyncio.ensure_future(c.flush())
            await asyncio.sleep(0.1)
            flushing.cancel()
            await asyncio.sleep(0.05)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        # The read is settled (cancelled with its flush), never left hanging.
        await asyncio.wait([read], timeout=5)
        assert read.done()
        await check_works(c)


def test_daemon_stops_cleanly_on_sigterm(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    with SyncClient(d.url) as c:
        c.alloc_buffer(1 << 20)
        assert d.stop() == 0
