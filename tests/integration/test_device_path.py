"""The daemon's device path end to end, on the host stand-in device (no GPU needed).

``tests/standin_daemon.py`` runs a real rpc-server with one extra device,
``standin:0``: memory without a host view, reached only through a stand-in
stream and staging, as a GPU's is.  Everything a client does with a device
buffer goes through rpc_server/device_io.py and the staging pipeline here,
exactly as it does with ``cuda:N``; tests/gpu/ repeats the essentials on a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Iterator

import pytest

from client import Client
from tests.helpers import DaemonProcess, async_test
from tests.integration.engine_cluster import STANDIN_COMMAND
from transferd.protocol.constants import Command
from transferd.protocol.errors import BadRequest, ConnectionLost, Internal, OutOfBounds

KiB, MiB = 1024, 1 << 20


def _sha(b: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("standin") / "fault")


@pytest.fixture(scope="module")
def standin(fault_file: str) -> Iterator[DaemonProcess]:
    d = DaemonProcess(
        command=STANDIN_COMMAND,
        env={"STANDIN_CHUNK": str(256 * KiB), "STANDIN_CHUNKS": "4", "STANDIN_DELAY_S": "0.001",
             "STANDIN_FAULT_FILE": fault_file},
    )
    with d:
        yield d


@async_test(timeout=60)
async def test_device_is_listed_and_round_trips(standin: DaemonProcess) -> None:
    async with await Client.connect(standin.url) as c:
        devs = {d["name"]: d for d in await c.get_devices()}
        assert devs["standin:0"]["alignment"] == 256 and devs["cpu"]["alignment"] == 4096
        buf = await c.alloc_buffer(8 * MiB, device="standin:0")
        for size, off in ((1000, 0), (600 * KiB, 4096), (3 * MiB + 77, MiB)):
            data = os.urandom(size)
            # 600 KiB lands straight in staging (1 MiB of chunks free); 3 MiB does
            # not fit and is collected, then pushed through with back-pressure.
            await c.set_tensor(buf.tensor(off, size), data)
            got = await c.get_tensor(buf.tensor(off, size))
            assert _sha(got) == _sha(data), size
        # Fresh device memory is zero.
        assert bytes(await c.get_tensor(buf.tensor(7 * MiB, 4096))) == bytes(4096)


@async_test(timeout=60)
async def test_batches_mix_host_and_device_tensors_in_order(standin: DaemonProcess) -> None:
    async with await Client.connect(standin.url) as c:
        dev = await c.alloc_buffer(2 * MiB, device="standin:0")
        host = await c.alloc_buffer(2 * MiB)
        parts = [(dev, 0, 100), (host, 10, 300 * KiB), (dev, MiB, 700 * KiB), (host, 0, 5)]
        datas = [os.urandom(n) for *_, n in parts]
        for (b, o, n), d in zip(parts, datas, strict=True):
            c.set_tensor_async(b.tensor(o, n), d)
        futs = [c.get_tensor_async(b.tensor(o, n)) for b, o, n in parts]
        await c.flush()
        for f, d in zip(futs, datas, strict=True):
            assert _sha(f.result()) == _sha(d)
        # One write then one read per step: the read sees the write.
        c.set_tensor_async(dev.tensor(0, 8), b"newbytes")
        f = c.get_tensor_async(dev.tensor(0, 8))
        await c.synchronize()
        assert f.result() == b"newbytes"


@async_test(timeout=60)
async def test_copy_and_clear_on_the_device(standin: DaemonProcess) -> None:
    # The stand-in is strict: a copy from or into host memory that is not pinned staging
    # fails (a GPU would have run it synchronously on the daemon's loop, issue 24.7).
    async with await Client.connect(standin.url) as c:
        a = await c.alloc_buffer(MiB, device="standin:0")
        b = await c.alloc_buffer(MiB, device="standin:0")
        h = await c.alloc_buffer(MiB)
        data = os.urandom(512 * KiB)
        await c.set_tensor(h.tensor(0, len(data)), data)
        await c.copy_tensor(h.tensor(0, len(data)), a.tensor(4096, len(data)))   # host -> dev
        await c.copy_tensor(a.tensor(4096, len(data)), b.tensor(0, len(data)))   # dev -> dev
        await c.copy_tensor(b.tensor(0, 1000), h.tensor(MiB - 1000, 1000))       # dev -> host
        assert _sha(await c.get_tensor(b.tensor(0, len(data)))) == _sha(data)
        assert bytes(await c.get_tensor(h.tensor(MiB - 1000, 1000))) == data[:1000]
        await c.buffer_clear(b, 0xAB)
        assert bytes(await c.get_tensor(b.tensor(MiB - 16, 16))) == b"\xab" * 16


@async_test(timeout=60)
async def test_device_bounds_are_checked_and_the_connection_serves_on(
        standin: DaemonProcess) -> None:
    async with await Client.connect(standin.url) as c:
        buf = await c.alloc_buffer(64 * KiB, device="standin:0")
        with pytest.raises(OutOfBounds):
            await c.get_tensor((buf.id, 60 * KiB, 8 * KiB))
        with pytest.raises(OutOfBounds):
            await c.set_tensor((buf.id, 64 * KiB - 4, 8), b"12345678")
        with pytest.raises(OutOfBounds):
            await c.copy_tensor((buf.id, 0, 8), (buf.id, 64 * KiB, 8))
        await c.set_tensor(buf.tensor(0, 4), b"okay")
        assert await c.get_tensor(buf.tensor(0, 4)) == b"okay"


@async_test(timeout=60)
async def test_client_vanishing_mid_get_leaves_the_daemon_serving(
        standin: DaemonProcess) -> None:
    async with await Client.connect(standin.url) as c:
        buf = await c.alloc_buffer(8 * MiB, device="standin:0")
        data = os.urandom(8 * MiB)
        await c.set_tensor(buf.tensor(), data)
        for _ in range(3):
            x = await Client.connect(standin.url)
            fut = x.conn.request(Command.GET_TENSOR, {"tensor": [buf.id, 0, 8 * MiB]})
            await asyncio.sleep(0.01)  # the reply is streaming: vanish
            assert x.conn.transport is not None
            x.conn.transport.abort()
            with contextlib.suppress(BaseException):
                await fut
        # Staging came back: large GETs still work, and the bytes are intact.
        for _ in range(2):
            assert _sha(await c.get_tensor(buf.tensor())) == _sha(data)


@async_test(timeout=60)
async def test_reg_mr_of_device_memory(standin: DaemonProcess) -> None:
    # The engine writes from and into it (tests/integration/test_device_engine.py).
    async with await Client.connect(standin.url) as c:
        buf = await c.alloc_buffer(64 * KiB, device="standin:0")
        mr, desc = await c.reg_mr(buf)
        assert desc.size == 64 * KiB
        await c.dereg_mr(mr)
        assert await c.get_tensor(buf.tensor(0, 4)) == bytes(4)


@async_test(timeout=60)
async def test_copy_against_host_memory_goes_through_staging_in_pieces(
        standin: DaemonProcess) -> None:
    # Larger than the whole staging pool (4 x 256 KiB), at odd offsets, both ways.
    async with await Client.connect(standin.url) as c:
        size = 3 * MiB + 12345
        dev = await c.alloc_buffer(size + 8192, device="standin:0")
        host = await c.alloc_buffer(size + 8192)
        data = os.urandom(size)
        await c.set_tensor(host.tensor(7, size), data)
        await c.copy_tensor(host.tensor(7, size), dev.tensor(4096, size))
        assert _sha(await c.get_tensor(dev.tensor(4096, size))) == _sha(data)
        await c.copy_tensor(dev.tensor(4096, size), host.tensor(8192, size))
        assert _sha(await c.get_tensor(host.tensor(8192, size))) == _sha(data)
        with pytest.raises(BadRequest, match="overlapping"):
            await c.copy_tensor(dev.tensor(0, 8192), dev.tensor(4096, 8192))


@async_test(timeout=60)
async def test_a_device_fault_fails_the_command_never_answers_ok(
        standin: DaemonProcess, fault_file: str) -> None:
    """Issue 24.2: while the device fails its copies, a SET, COPY or CLEAR is answered
    with the typed error, and a GET is cut (its header is out): never stale staging."""
    async with await Client.connect(standin.url) as c:
        buf = await c.alloc_buffer(64 * KiB, device="standin:0")
        await c.set_tensor(buf.tensor(0, 8), b"original")
        with open(fault_file, "w"):
            pass
        try:
            with pytest.raises(Internal, match="fault"):
                await c.set_tensor(buf.tensor(0, 8), b"newbytes")
            with pytest.raises(Internal, match="fault"):
                await c.buffer_clear(buf, 1)
            host = await c.alloc_buffer(8)
            with pytest.raises(Internal, match="fault"):
                await c.copy_tensor(host.tensor(), buf.tensor(0, 8))
            with pytest.raises(ConnectionLost):
                await c.get_tensor(buf.tensor(0, 8))
        finally:
            os.unlink(fault_file)
    async with await Client.connect(standin.url) as c:
        assert bytes(await c.get_tensor(buf.tensor(0, 8))) == b"original"
        await c.set_tensor(buf.tensor(0, 8), b"newbytes")
        assert bytes(await c.get_tensor(buf.tensor(0, 8))) == b"newbytes"


@async_test(timeout=60)
async def test_events_never_land_inside_a_streamed_device_reply(standin: DaemonProcess) -> None:
    """A GET from device memory streams its payload piece by piece (staging, drains in
    between); a watcher EVENT of the same connection that comes meanwhile waits for the
    reply's last byte instead of landing inside it (it would be read as payload)."""
    import mmap
    import struct
    import threading

    seen: list[int] = []
    async with await Client.connect(standin.url) as c:
        w = await c.alloc_uvm_watcher(lambda old, new: seen.append(new))
        fd = os.open(w.path, os.O_RDWR)
        m = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
        os.close(fd)
        buf = await c.alloc_buffer(8 * MiB, device="standin:0")
        data = os.urandom(8 * MiB)
        await c.set_tensor(buf.tensor(0, len(data)), data)
        stop = threading.Event()

        def bump() -> None:
            i = 0
            while not stop.is_set() and i < 100_000:
                i += 1
                struct.pack_into("<Q", m, w.offset, i)  # one aligned 8-byte store
                stop.wait(0.0005)

        t = threading.Thread(target=bump, daemon=True)
        t.start()
        try:
            for _ in range(4):
                got = await c.get_tensor(buf.tensor(0, len(data)))
                assert _sha(got) == _sha(data)
        finally:
            stop.set()
            t.join(5)
        m.close()
    assert seen, "the watcher saw no change: the test proved nothing"
