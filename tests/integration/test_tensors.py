"""Devices, buffers and tensors against a real daemon: round trips checked by checksum,
copies, and every error leaving the target memory unchanged."""

from __future__ import annotations

import pytest

from client import Client
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, async_test, digest, pattern
from transferd.memory import charge_of
from transferd.protocol.constants import Command, ErrorCode, Flag
from transferd.protocol.errors import (
    BadRequest,
    NotFound,
    OutOfBounds,
    OutOfMemory,
    TransferdError,
)
from transferd.protocol.messages import Tensor

MiB = 1 << 20


@async_test()
async def test_get_devices(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(["-m", "64"])
    async with await Client.connect(d.url) as c:
        dev, shm = await c.get_devices()
        assert shm["name"] == "shm"  # shared memory, for clients on the Unix socket
        assert set(dev) >= {"name", "total", "free", "alignment", "max_size"}
        assert dev["name"] == "cpu"
        assert dev["total"] == 64 * MiB and dev["free"] == 64 * MiB
        assert dev["alignment"] > 0 and dev["alignment"] & (dev["alignment"] - 1) == 0
        assert 0 < dev["max_size"] <= 64 * MiB
        buf = await c.alloc_buffer(10 * MiB)
        dev, _ = await c.get_devices()
        # Charged by whole pages plus a page of bookkeeping.
        assert dev["free"] == 64 * MiB - charge_of(10 * MiB) == 54 * MiB - dev["per_buffer"]
        await c.free_buffer(buf)
        dev, _ = await c.get_devices()
        assert dev["free"] == 64 * MiB


@async_test()
async def test_alloc_free_clear(url: str) -> None:
    async with await Client.connect(url) as c:
        a = await c.alloc_buffer(4096)
        b = await c.alloc_buffer(4096, device="cpu")
        assert a.id != b.id and a.size == b.size == 4096
        # Fresh buffers are zero-filled.
        assert await c.get_tensor(a.tensor()) == bytes(4096)
        for value in (0xFF, 0x00, 0x5A):
            await c.buffer_clear(a, value)
            assert await c.get_tensor(a.tensor()) == bytes([value]) * 4096
        assert await c.get_tensor(b.tensor()) == bytes(4096)  # the other one is untouched
        await c.free_buffer(a)
        with pytest.raises(NotFound):
            await c.get_tensor(a.tensor())
        with pytest.raises(NotFound):
            await c.free_buffer(a)
        with pytest.raises(NotFound):
            await c.buffer_clear(a, 1)
        # Buffer ids are not reused.
        a2 = await c.alloc_buffer(4096)
        assert a2.id not in (a.id, b.id)
        await c.free_buffer(a2)
        await c.free_buffer(b.id)


@async_test()
async def test_alloc_errors(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(["-m", "8"])
    async with await Client.connect(d.url) as c:
        with pytest.raises(OutOfMemory):
            await c.alloc_buffer(8 * MiB + 1)
        big = await c.alloc_buffer(6 * MiB)
        with pytest.raises(OutOfMemory):
            await c.alloc_buffer(3 * MiB)
        await c.free_buffer(big)
        # The largest buffer: the limit less one page of bookkeeping.
        dev, _ = await c.get_devices()
        assert dev["max_size"] == 8 * MiB - dev["per_buffer"] == 8 * MiB - charge_of(0) + 4096
        again = await c.alloc_buffer(dev["max_size"])  # the memory came back, all of it
        (dev2, _) = await c.get_devices()
        assert dev2["free"] == 0
        with pytest.raises(OutOfMemory):
            await c.alloc_buffer(0)  # not even a page of bookkeeping is left
        await c.free_buffer(again)
        with pytest.raises(OutOfMemory):
            await c.alloc_buffer(dev["max_size"] + 1)  # one more page would be over the limit
        with pytest.raises(NotFound):
            await c.alloc_buffer(16, device="cuda:0")
        with pytest.raises(BadRequest):
            await c.conn.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": -1})
        with pytest.raises(BadRequest):
            await c.conn.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": True})
        with pytest.raises(BadRequest):
            await c.conn.request(Command.ALLOC_BUFFER, {"device": "cpu"})
        zero = await c.alloc_buffer(0)
        assert zero.size == 0
        assert await c.get_tensor(zero.tensor()) == b""
        await c.free_buffer(zero)


@async_test()
async def test_clear_value_must_be_a_byte(url: str) -> None:
    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(16)
        await c.buffer_clear(buf, 3)
        for bad in (256, -1):
            with pytest.raises(BadRequest):
                await c.buffer_clear(buf, bad)
        assert await c.get_tensor(buf.tensor()) == b"\x03" * 16
        await c.free_buffer(buf)


@pytest.mark.parametrize("size", [0, 1, 4096, MiB + 13], ids=["0", "1", "4KiB", "1MiB+13"])
@async_test()
async def test_set_get_round_trip(url: str, size: int) -> None:
    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(size + 64)
        await c.buffer_clear(buf, 0xEE)
        data = pattern(size, size)
        t = buf.tensor(32, size)
        await c.set_tensor(t, data)
        got = await c.get_tensor(t)
        assert isinstance(got, bytearray) and len(got) == size
        assert digest(got) == digest(data)
        # The bytes around the tensor were not touched.
        whole = await c.get_tensor(buf.tensor())
        assert digest(whole) == digest(b"\xee" * 32 + data + b"\xee" * 32)
        # Queued path, same bytes.
        fut = c.get_tensor_async(t)
        await c.flush()
        assert digest(fut.result()) == digest(data)
        await c.free_buffer(buf)


@async_test(timeout=90)
async def test_64_mib_round_trip(url: str) -> None:
    size = 64 * MiB
    data = pattern(size, 64)
    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(size)
        await c.set_tensor(buf.tensor(), data)
        out = bytearray(size)
        res = await c.get_tensor(buf.tensor(), out=out)
        assert res is out
        assert digest(out) == digest(data)
        # And through the queue, split over two tensors, into numpy memory.
        import numpy as np

        half = size // 2
        arr = np.zeros(size, dtype=np.uint8)
        c.set_tensor_async(buf.tensor(0, half), data[half:])
        c.set_tensor_async(buf.tensor(half, half), data[:half])
        f1 = c.get_tensor_async(buf.tensor(0, half), out=arr[:half])
        f2 = c.get_tensor_async(buf.tensor(half, half), out=arr[half:])
        await c.flush()
        await f1
        await f2
        assert digest(arr) == digest(data[half:] + data[:half])
        await c.free_buffer(buf)


@async_test()
async def test_data_of_many_kinds(url: str) -> None:
    import array

    import numpy as np

    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(64)
        src = np.arange(16, dtype=np.float32)
        await c.set_tensor(buf.tensor(0, 64), src)
        back = np.frombuffer(await c.get_tensor(buf.tensor()), dtype=np.float32)
        assert np.array_equal(back, src)
        await c.set_tensor(buf.tensor(0, 16), array.array("I", [1, 2, 3, 4]))
        await c.set_tensor(buf.tensor(16, 16), memoryview(b"m" * 16))
        await c.set_tensor(buf.tensor(32, 16), bytearray(b"b" * 16))
        got = await c.get_tensor(buf.tensor(0, 48))
        assert bytes(got[:16]) == array.array("I", [1, 2, 3, 4]).tobytes()
        assert got[16:] == b"m" * 16 + b"b" * 16
        # A tensor given as a plain triple.
        assert await c.get_tensor((buf.id, 16, 4)) == b"mmmm"
        with pytest.raises(BadRequest):
            await c.set_tensor(buf.tensor(0, 8), b"short")
        await c.free_buffer(buf)


# -- copies -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src", "dst", "n"),
    [(0, 5000, 4000), (0, 100, 4000), (100, 0, 4000), (0, 0, 4000), (1, 2, 9000), (7, 3, 1)],
    ids=["disjoint", "overlap-forward", "overlap-backward", "same", "overlap-by-one", "tiny"],
)
@async_test()
async def test_copy_tensor_within_a_buffer(
    url: str, src: int, dst: int, n: int
) -> None:
    size = 10_000
    data = pattern(size, 11)
    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(size)
        await c.set_tensor(buf.tensor(), data)
        await c.copy_tensor(buf.tensor(src, n), buf.tensor(dst, n))
        expect = bytearray(data)
        expect[dst : dst + n] = data[src : src + n]  # memmove semantics
        assert digest(await c.get_tensor(buf.tensor())) == digest(expect)
        await c.free_buffer(buf)


@async_test()
async def test_copy_tensor_between_buffers(url: str) -> None:
    async with await Client.connect(url) as c:
        a = await c.alloc_buffer(MiB)
        b = await c.alloc_buffer(MiB)
        data = pattern(MiB, 12)
        await c.set_tensor(a.tensor(), data)
        await c.copy_tensor(a.tensor(0, MiB // 2), b.tensor(MiB // 2, MiB // 2))
        got = await c.get_tensor(b.tensor())
        assert digest(got) == digest(bytes(MiB // 2) + data[: MiB // 2])
        # The copy is ordered with the queue: a queued write before it is seen.
        c.set_tensor_async(a.tensor(0, 4), b"ABCD")
        await c.copy_tensor(a.tensor(0, 4), b.tensor(0, 4))
        assert await c.get_tensor(b.tensor(0, 4)) == b"ABCD"
        await c.free_buffer(a)
        await c.free_buffer(b)


@async_test()
async def test_copy_tensor_errors_change_nothing(url: str) -> None:
    async with await Client.connect(url) as c:
        a = await c.alloc_buffer(4096)
        data = pattern(4096, 13)
        await c.set_tensor(a.tensor(), data)
        cases = [
            (Tensor(a.id, 0, 100), Tensor(a.id, 4000, 100), OutOfBounds),
            (Tensor(a.id, 4000, 100), Tensor(a.id, 0, 100), OutOfBounds),
            (Tensor(a.id, 0, 100), Tensor(a.id, 0, 99), BadRequest),
            (Tensor(a.id + 1000, 0, 100), Tensor(a.id, 0, 100), NotFound),
            (Tensor(a.id, 0, 100), Tensor(a.id + 1000, 0, 100), NotFound),
        ]
        for src, dst, exc in cases:
            with pytest.raises(exc):
                await c.copy_tensor(src, dst)
            assert digest(await c.get_tensor(a.tensor())) == digest(data), (src, dst)
        await c.free_buffer(a)


# -- errors leave memory unchanged -----------------------------------------------------------


@async_test()
async def test_out_of_bounds_and_unknown_buffer_sync(url: str) -> None:
    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(4096)
        data = pattern(4096, 21)
        await c.set_tensor(buf.tensor(), data)
        before = digest(await c.get_tensor(buf.tensor()))
        bad = [
            (Tensor(buf.id, 4000, 97), OutOfBounds),
            (Tensor(buf.id, 4096, 1), OutOfBounds),
            (Tensor(buf.id, 0, 4097), OutOfBounds),
            (Tensor(buf.id + 999, 0, 16), NotFound),
        ]
        for t, exc in bad:
            with pytest.raises(exc):
                await c.set_tensor(t, b"\xff" * t.size)
            with pytest.raises(exc):
                await c.get_tensor(t)
            assert digest(await c.get_tensor(buf.tensor())) == before, t
        # Offsets and sizes near 2**64 (raw, so the client allocates nothing that big).
        u64 = (1 << 64) - 1
        for wire in ([buf.id, 1 << 62, 1 << 62], [buf.id, u64, 1], [buf.id, 1, u64]):
            with pytest.raises(OutOfBounds):
                await c.conn.request(Command.GET_TENSOR, {"tensor": wire})
            with pytest.raises(OutOfBounds):
                await c.conn.request(Command.SET_TENSOR, {"tensor": wire}, [b"\xff"])
            with pytest.raises(OutOfBounds):
                await c.conn.request(Command.GET_TENSORS, {"tensors": [[buf.id, 0, 1], wire]})
        assert digest(await c.get_tensor(buf.tensor())) == before
        await c.free_buffer(buf)


@async_test()
async def test_zero_size_tensors_are_bounds_checked(url: str) -> None:
    """PROTOCOL.md: every access is checked, whatever its size."""
    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(64)
        assert await c.get_tensor(Tensor(buf.id, 64, 0)) == b""  # the end is inside
        await c.set_tensor(Tensor(buf.id, 64, 0), b"")
        for t, exc in [
            (Tensor(buf.id, 65, 0), OutOfBounds),
            (Tensor(buf.id + 999, 0, 0), NotFound),
        ]:
            with pytest.raises(exc):
                await c.get_tensor(t)
            with pytest.raises(exc):
                await c.set_tensor(t, b"")
        await c.free_buffer(buf)


@async_test()
async def test_oversized_set_payload_is_refused(url: str) -> None:
    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(16)
        # Payload length disagrees with the tensor: refused, nothing written.
        with pytest.raises(BadRequest):
            await c.conn.request(Command.SET_TENSOR, {"tensor": [buf.id, 0, 8]}, [b"x" * 9])
        with pytest.raises(BadRequest):
            await c.conn.request(Command.SET_TENSOR, {"tensor": [buf.id, 0, 8]}, [b"x" * 7])
        assert await c.get_tensor(buf.tensor()) == bytes(16)
        await c.free_buffer(buf)


@async_test()
async def test_one_way_write_failure_is_raised_at_the_next_flush_point(
    url: str,
) -> None:
    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(4096)
        data = pattern(4096, 22)
        await c.set_tensor(buf.tensor(), data)
        before = digest(data)

        # Out of bounds, through the queue: a NO_REPLY SET_TENSORS answered by an EVENT.
        c.set_tensor_async(Tensor(buf.id, 4090, 10), b"\xff" * 10)
        with pytest.raises(OutOfBounds) as info:
            await c.synchronize()
        assert info.value.seq is not None
        assert digest(await c.get_tensor(buf.tensor())) == before

        # Unknown buffer, raised by flush() when a read waits behind it.
        c.set_tensor_async(Tensor(buf.id + 999, 0, 10), b"\xff" * 10)
        fut = c.get_tensor_async(buf.tensor())
        with pytest.raises(NotFound):
            await c.flush()
        assert digest(fut.result()) == before  # the read itself was fine

        # Unbatched path too (one SET_TENSOR per write, still one-way).
        c.switches = type(c.switches)(batched_set=False)
        c.set_tensor_async(Tensor(buf.id, 4096, 1), b"\xff")
        with pytest.raises(OutOfBounds):
            await c.synchronize()

        # Several failures: the first is raised, the others are noted on it.
        c.set_tensor_async(Tensor(buf.id, 5000, 1), b"\xff")
        await c.flush()
        c.set_tensor_async(Tensor(buf.id + 999, 0, 1), b"\xff")
        with pytest.raises(TransferdError) as many:
            await c.synchronize()
        assert many.value.code == ErrorCode.OUT_OF_BOUNDS
        assert any("1 more" in n for n in getattr(many.value, "__notes__", []))

        # The connection is still in order.
        assert digest(await c.get_tensor(buf.tensor())) == before
        await c.synchronize()
        await c.free_buffer(buf)


@async_test()
async def test_set_tensors_with_one_bad_tensor_writes_nothing(url: str) -> None:
    async with await Client.connect(url) as c:
        a = await c.alloc_buffer(4096)
        b = await c.alloc_buffer(4096)
        da, db = pattern(4096, 31), pattern(4096, 32)
        await c.set_tensor(a.tensor(), da)
        await c.set_tensor(b.tensor(), db)
        for bad in (Tensor(b.id, 4095, 2), Tensor(b.id + 999, 0, 2)):
            c.set_tensor_async(a.tensor(0, 100), b"\x01" * 100)
            c.set_tensor_async(b.tensor(0, 100), b"\x02" * 100)
            c.set_tensor_async(bad, b"\x03\x03")
            c.set_tensor_async(a.tensor(200, 100), b"\x04" * 100)
            before = c.stats()["commands"]
            with pytest.raises((OutOfBounds, NotFound)):
                await c.synchronize()
            after = c.stats()["commands"]
            # It went as one SET_TENSORS.
            assert after.get("SET_TENSOR") == before.get("SET_TENSOR")
            assert after["SET_TENSORS"] == before.get("SET_TENSORS", 0) + 1
            assert digest(await c.get_tensor(a.tensor())) == digest(da)
            assert digest(await c.get_tensor(b.tensor())) == digest(db)
        await c.free_buffer(a)
        await c.free_buffer(b)


@async_test()
async def test_get_tensors_with_one_bad_tensor_fails_every_read(url: str) -> None:
    async with await Client.connect(url) as c:
        a = await c.alloc_buffer(100)
        f1 = c.get_tensor_async(a.tensor(0, 10))
        f2 = c.get_tensor_async(Tensor(a.id, 95, 10))
        with pytest.raises(OutOfBounds):
            await c.flush()
        for f in (f1, f2):
            with pytest.raises(OutOfBounds):
                f.result()
        assert await c.get_tensor(a.tensor(0, 10)) == bytes(10)
        await c.free_buffer(a)


def test_bad_request_bodies_are_answered(daemon: DaemonProcess) -> None:
    with RawConn.to(daemon) as raw:
        raw.hello()
        buf = raw.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 64}).body["buffer"]
        cases = [
            (Command.GET_TENSOR, {}),
            (Command.GET_TENSOR, {"tensor": [buf, 0]}),
            (Command.GET_TENSOR, {"tensor": [buf, 0, True]}),
            (Command.GET_TENSOR, {"tensor": "t"}),
            (Command.GET_TENSORS, {"tensors": [buf, 0, 4]}),
            (Command.COPY_TENSOR, {"src": [buf, 0, 4]}),
            (Command.FREE_BUFFER, {"buffer": -1}),
            (Command.BUFFER_CLEAR, {"buffer": buf, "value": 1.5}),
            (Command.ALLOC_BUFFER, {"device": 7, "size": 1}),
        ]
        for cmd, body in cases:
            f = raw.request(cmd, body)
            assert f.flags == Flag.REPLY | Flag.ERROR, (cmd, body)
            assert f.cmd == cmd and f.body["code"] == ErrorCode.BAD_REQUEST, (cmd, body)
            assert isinstance(f.body["message"], str) and f.body["message"]
        # A payload on a command that takes none is refused, and skipped over.
        f = raw.request(Command.GET_TENSOR, {"tensor": [buf, 0, 4]}, payload=b"junk")
        assert f.body["code"] == ErrorCode.BAD_REQUEST
        # Request flags a client may not set.
        seq = raw.send(Command.SYNCHRONIZE, flags=Flag.EVENT)
        f = raw.recv()
        assert f.seq == seq and f.body["code"] == ErrorCode.BAD_REQUEST
        f = raw.request(Command.GET_TENSOR, {"tensor": [buf, 0, 4]})
        assert f.flags == Flag.REPLY and f.payload == bytes(4)


def test_a_repeated_batch_is_checked_against_the_buffers_of_now(daemon: DaemonProcess) -> None:
    # The daemon decodes and checks a batch that repeats the last one once (a decode
    # loop's step), then reuses that check: the same list must still meet the same
    # buffer, every bound, the payload's length, or get the error any batch gets.
    with RawConn.to(daemon) as raw:
        raw.hello()
        a = raw.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 64}).body["buffer"]
        batch = {"tensors": [[a, 0, 4], [a, 4, 4], [a, 16, 8]]}
        for step in range(3):
            data = pattern(16, step)
            f = raw.request(Command.SET_TENSORS, batch, payload=data)
            assert f.flags == Flag.REPLY, f.body
            f = raw.request(Command.GET_TENSORS, batch)
            assert f.flags == Flag.REPLY and f.payload == data, (step, f.body)
            # The same batch with one byte of payload too many, or too few.
            for wrong in (data + b"x", data[:-1]):
                f = raw.request(Command.SET_TENSORS, batch, payload=wrong)
                assert f.body["code"] == ErrorCode.BAD_REQUEST, f.body
        # A bool for an offset is one byte away on the wire: decoded and refused anew.
        f = raw.request(Command.GET_TENSORS, {"tensors": [[a, True, 4]]})
        assert f.body["code"] == ErrorCode.BAD_REQUEST
        f = raw.request(Command.GET_TENSORS, {"tensors": [[a, 1, 4]]})
        assert f.flags == Flag.REPLY and len(f.payload) == 4
        assert raw.request(Command.GET_TENSORS, batch).flags == Flag.REPLY
        assert raw.request(Command.FREE_BUFFER, {"buffer": a}).flags == Flag.REPLY
        for _ in range(2):  # the buffer checked before is gone: NOT_FOUND, each time
            f = raw.request(Command.GET_TENSORS, batch)
            assert f.body["code"] == ErrorCode.NOT_FOUND, f.body
            f = raw.request(Command.SET_TENSORS, batch, payload=bytes(16))
            assert f.body["code"] == ErrorCode.NOT_FOUND, f.body
        # A new, smaller buffer: the same list (under its id) meets its bounds.
        b = raw.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 8}).body["buffer"]
        small = {"tensors": [[b, 0, 4], [b, 4, 4]]}
        assert raw.request(Command.GET_TENSORS, small).payload == bytes(8)
        over = {"tensors": [[b, 0, 4], [b, 4, 8]]}
        for _ in range(2):
            assert raw.request(Command.GET_TENSORS, over).body["code"] == ErrorCode.OUT_OF_BOUNDS
        assert raw.request(Command.GET_TENSORS, small).payload == bytes(8)
        # A batch of more runs than a session keeps (REPEAT_RUNS): checked every time.
        c = raw.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 1024}).body["buffer"]
        data = pattern(1024, 7)
        assert raw.request(Command.SET_TENSORS, {"tensors": [[c, 0, 1024]]},
                           payload=data).flags == Flag.REPLY
        sparse = {"tensors": [[c, 8 * i, 4] for i in range(100)]}  # 100 runs
        want = b"".join(data[8 * i: 8 * i + 4] for i in range(100))
        for _ in range(3):
            assert raw.request(Command.GET_TENSORS, sparse).payload == want
