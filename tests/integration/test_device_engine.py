"""The engine on device memory, between two real daemons with the stand-in device.

Both daemons run ``tests/standin_daemon.py`` (a device without a host view,
reached only through a stand-in stream and staging, as a GPU's is).  Writes go
device to device, host to device and device to host over the tcp Domain; the
bytes are compared by checksum.  Daemon b's stream can be held from here (its
``STANDIN_HOLD_FILE``): while it is, a write into b's device memory is in b's
staging but not on its device, and nothing is counted nor acknowledged.  Its
device can be broken too (``STANDIN_FAULT_FILE``): every copy fails while it
is, and what waited on one fails with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Iterator

import pytest

from client import Client, MrHandle, Pages
from tests.helpers import DaemonProcess, async_test, digest
from tests.integration.engine_cluster import engine_env, fresh_imm, secret_file, standin_pair
from transferd.protocol.errors import BadRequest, Cancelled, Internal, OutOfBounds, Timeout

KiB = 1024
WAIT = 20.0
CHUNK, CHUNKS = 256 * KiB, 4


@pytest.fixture(scope="module")
def hold_file() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="td-hold-") as d:
        yield os.path.join(d, "hold")


@pytest.fixture(scope="module")
def fault_file(hold_file: str) -> str:
    return hold_file + ".fault"


@pytest.fixture(scope="module")
def pair(hold_file: str, fault_file: str) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    envs = []
    for rail, hold, fault in (("127.0.0.10", "", ""), ("127.0.0.11", hold_file, fault_file)):
        env = engine_env([rail], secret_file=secret_file())
        env.update({"STANDIN_CHUNK": str(CHUNK), "STANDIN_CHUNKS": str(CHUNKS),
                    "STANDIN_HOLD_FILE": hold, "STANDIN_FAULT_FILE": fault})
        envs.append(env)
    with standin_pair(*envs) as pair:
        yield pair


@contextlib.asynccontextmanager
async def _clients(pair: tuple[DaemonProcess, DaemonProcess]
                   ) -> AsyncIterator[tuple[Client, Client]]:
    a = await Client.connect(pair[0].url)
    b = await Client.connect(pair[1].url)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def _device_region(c: Client, size: int, data: bytes | None = None,
                         device: str = "standin:0") -> tuple:
    buf = await c.alloc_buffer(size, device=device)
    if data is not None:
        await c.set_tensor(buf.tensor(0, len(data)), data)
    mr, desc = await c.reg_mr(buf)
    return buf, mr, desc


async def _host_source(c: Client, data: bytes) -> MrHandle:
    """A host region on ``c``'s daemon holding ``data``."""
    buf = await c.alloc_buffer(len(data))
    await c.set_tensor(buf.tensor(), data)
    mr, _ = await c.reg_mr(buf)
    return mr


@async_test(timeout=90)
async def test_device_to_device_single_and_paged_writes(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    async with _clients(pair) as (a, b):
        data = os.urandom(512 * KiB)
        _, smr, _ = await _device_region(a, 512 * KiB, data)
        dbuf, _, ddesc = await _device_region(b, 1024 * KiB)
        imm = fresh_imm()
        # A single write of one staging chunk, at an offset on both sides.
        n = 200 * KiB
        done = await b.expect_imm_count(imm, 1, wait=False)
        w = await a.submit_single_write(n, imm, (smr, 4096), (ddesc, 8192))
        await w.wait(WAIT)
        await done.wait(WAIT)
        got = bytes(await b.get_tensor(dbuf.tensor(8192, n)))
        assert digest(got) == digest(data[4096:4096 + n])
        # Paged: 12 pages of 16 KiB (spread over the source's staging chunks).
        page = 16 * KiB
        src_idx, dst_idx = list(range(0, 24, 2)), list(range(40, 52))
        done = await b.expect_imm_count(imm, len(src_idx), wait=False)
        w = await a.submit_paged_writes(page, imm, (smr, Pages(src_idx, page, 0)),
                                        (ddesc, Pages(dst_idx, page, 0)))
        await w.wait(WAIT)
        await done.wait(WAIT)
        for si, di in zip(src_idx, dst_idx, strict=True):
            got = bytes(await b.get_tensor(dbuf.tensor(di * page, page)))
            assert digest(got) == digest(data[si * page:(si + 1) * page]), (si, di)
        # The other way, device on b to device on a, over many writes: staging is reused.
        back, bmr, _ = await _device_region(b, 64 * KiB, os.urandom(64 * KiB))
        abuf, _, adesc = await _device_region(a, 64 * KiB)
        for i in range(20):
            w = await b.submit_single_write(4 * KiB, None, (bmr, i * 1024), (adesc, i * 1024))
            await w.wait(WAIT)
        want = bytes(await b.get_tensor(back.tensor(0, 23 * KiB)))
        assert digest(bytes(await a.get_tensor(abuf.tensor(0, 23 * KiB)))) == digest(want)


@async_test(timeout=90)
async def test_host_to_device_and_device_to_host(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    async with _clients(pair) as (a, b):
        data = os.urandom(CHUNK * CHUNKS)
        hbuf = await a.alloc_buffer(len(data))
        await a.set_tensor(hbuf.tensor(), data)
        hmr, _ = await a.reg_mr(hbuf)
        dbuf, dmr, ddesc = await _device_region(b, len(data))
        imm = fresh_imm()
        # A whole staging pool's worth into b's device (parts of up to the pool).
        done = await b.expect_imm_count(imm, 1, wait=False)
        w = await a.submit_single_write(len(data), imm, (hmr, 0), (ddesc, 0))
        await w.wait(WAIT)
        await done.wait(WAIT)
        assert digest(bytes(await b.get_tensor(dbuf.tensor()))) == digest(data)
        # Device on b to host on a.
        out = await a.alloc_buffer(CHUNK)
        _, odesc = await a.reg_mr(out)
        w = await b.submit_single_write(CHUNK, None, (dmr, CHUNK), (odesc, 0))
        await w.wait(WAIT)
        assert digest(bytes(await a.get_tensor(out.tensor()))) == digest(data[CHUNK:2 * CHUNK])
        # A device source larger than one staging chunk is refused clearly.
        w = await b.submit_single_write(CHUNK + 1, None, (dmr, 0), (odesc, 0))
        with pytest.raises(BadRequest, match="larger than a staging chunk"):
            await w.wait(WAIT)
        # Bounds as for host memory.
        with pytest.raises(OutOfBounds, match="outside"):
            w = await b.submit_single_write(4096, None, (dmr, len(data) - 10), (odesc, 0))
            await w.wait(WAIT)


@async_test(timeout=90)
async def test_counted_only_after_the_device_copy_completed(
        pair: tuple[DaemonProcess, DaemonProcess], hold_file: str) -> None:
    async with _clients(pair) as (a, b):
        data = os.urandom(64 * KiB)
        hmr = await _host_source(a, data)
        dbuf, _, ddesc = await _device_region(b, len(data))
        imm = fresh_imm()
        with open(hold_file, "w"):
            pass
        try:
            w = await a.submit_single_write(len(data), imm, (hmr, 0), (ddesc, 0))
            # The bytes reach b's staging at once; its device copy is held.
            await asyncio.sleep(0.5)
            assert await b.imm_count(imm) == 0
            assert not w.done()  # no ACK went out
        finally:
            os.unlink(hold_file)
        await w.wait(WAIT)
        assert await b.imm_count(imm) == 1
        assert digest(bytes(await b.get_tensor(dbuf.tensor()))) == digest(data)


@async_test(timeout=90)
async def test_a_write_from_device_memory_held_in_staging_is_cancelled_or_times_out(
        pair: tuple[DaemonProcess, DaemonProcess], hold_file: str) -> None:
    """b's stream is held, so its D2H copy never completes: the write waits in staging,
    nothing sent.  CANCEL ends it at once, and so does its own deadline; the destination
    stays untouched, and once the stream goes on the next write from there lands whole."""
    async with _clients(pair) as (a, b):
        data = os.urandom(64 * KiB)
        dbuf, dmr, _ = await _device_region(b, len(data), data)
        hbuf = await a.alloc_buffer(len(data))
        _, hdesc = await a.reg_mr(hbuf)
        with open(hold_file, "w"):
            pass
        try:
            w = await b.submit_single_write(len(data), None, (dmr, 0), (hdesc, 0))
            late = await b.submit_single_write(len(data), None, (dmr, 0), (hdesc, 0),
                                               timeout=0.3)
            await asyncio.sleep(0.2)
            assert not w.done()
            assert await asyncio.wait_for(w.cancel(), 5) is True
            with pytest.raises(Cancelled):
                await w
            with pytest.raises(Timeout):
                await late.wait(5)
        finally:
            os.unlink(hold_file)
        assert bytes(await a.get_tensor(hbuf.tensor())) == bytes(len(data))  # nothing sent
        w = await b.submit_single_write(len(data), None, (dmr, 0), (hdesc, 0))
        await w.wait(WAIT)
        assert digest(bytes(await a.get_tensor(hbuf.tensor()))) == digest(data)
        await a.free_buffer(hbuf)
        await b.free_buffer(dbuf)


@contextlib.contextmanager
def _present(path: str) -> Iterator[None]:
    with open(path, "w"):
        pass
    try:
        yield
    finally:
        os.unlink(path)


@async_test(timeout=90)
async def test_a_timed_out_device_write_keeps_its_staging_from_the_next_user(
        pair: tuple[DaemonProcess, DaemonProcess], hold_file: str) -> None:
    """Issue 24.1: a write from device memory that times out while its D2H copies are
    queued (b's stream held) must not give its staging back then: the next user (a SET
    whose payload lands straight in free staging) would have its bytes overwritten by
    those copies when the stream goes on, and land the write's source bytes instead."""
    async with _clients(pair) as (a, b):
        src = b"A" * (CHUNK * CHUNKS)
        dbuf, dmr, _ = await _device_region(b, len(src), src)
        target = await b.alloc_buffer(CHUNK, device="standin:0")
        hbuf = await a.alloc_buffer(len(src))
        _, hdesc = await a.reg_mr(hbuf)
        pages = Pages(list(range(CHUNKS)), CHUNK, 0)  # one page per chunk: all of b's staging
        with _present(hold_file):
            w = await b.submit_paged_writes(CHUNK, None, (dmr, pages), (hdesc, pages),
                                            timeout=0.3)
            with pytest.raises(Timeout):
                await w.wait(5)
            # The next user of b's staging: a SET of other bytes into device memory.
            setter = asyncio.ensure_future(b.set_tensor(target.tensor(), b"B" * CHUNK))
            await asyncio.sleep(0.3)
        await asyncio.wait_for(setter, WAIT)
        got = bytes(await b.get_tensor(target.tensor()))
        assert got == b"B" * CHUNK, f"the SET landed {got[:8]!r}...: its staging was reused"
        assert bytes(await a.get_tensor(hbuf.tensor(0, 64))) == bytes(64)  # nothing sent
        for buf in (dbuf, target):
            await b.free_buffer(buf)
        await a.free_buffer(hbuf)


@async_test(timeout=90)
async def test_a_device_fault_fails_writes_and_counts_nothing(
        pair: tuple[DaemonProcess, DaemonProcess], fault_file: str) -> None:
    """Issue 24.2: while b's device fails its copies, a write into b's device memory is
    neither counted nor acknowledged ok (its initiator gets the failure), and a write
    from it sends nothing; once the device works again both land and count."""
    async with _clients(pair) as (a, b):
        data = os.urandom(64 * KiB)
        hmr = await _host_source(a, data)
        dbuf, dmr, ddesc = await _device_region(b, len(data))
        sink = await a.alloc_buffer(len(data))
        _, sdesc = await a.reg_mr(sink)
        imm = fresh_imm()
        with _present(fault_file):
            w = await a.submit_single_write(len(data), imm, (hmr, 0), (ddesc, 0))
            with pytest.raises(Internal, match="fault"):
                await w.wait(WAIT)
            assert await b.imm_count(imm) == 0
            out = await b.submit_single_write(len(data), None, (dmr, 0), (sdesc, 0))
            with pytest.raises(Internal, match="fault"):
                await out.wait(WAIT)
        assert bytes(await a.get_tensor(sink.tensor(0, 64))) == bytes(64)
        w = await a.submit_single_write(len(data), imm, (hmr, 0), (ddesc, 0))
        await w.wait(WAIT)
        assert await b.imm_count(imm) == 1
        out = await b.submit_single_write(len(data), None, (dmr, 0), (sdesc, 0))
        await out.wait(WAIT)
        assert digest(bytes(await a.get_tensor(sink.tensor()))) == digest(data)
        await b.free_buffer(dbuf)
