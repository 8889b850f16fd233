"""GPU tests: real CUDA devices through CuPy.  Skipped, with the reason, where CuPy finds none.

Run by ``make gpu-check`` (scripts/gpu-check.sh), which also runs the GPU
benchmarks and writes the report; ``pytest -m gpu tests/gpu`` runs these alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from client import Client
from tests.gpu.gpu_common import COUNT, NO_GPU_REASON, bump, busy, gpu_daemon
from tests.helpers import DaemonProcess, async_test
from transferd.protocol.errors import BadRequest, NotFound, OutOfBounds
from transferd.protocol.values import Pages

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not COUNT, reason=NO_GPU_REASON)]

KiB, MiB = 1024, 1 << 20


def _sha(b: object) -> str:
    return hashlib.sha256(memoryview(b).cast("B")).hexdigest()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gpu() -> Iterator[DaemonProcess]:
    with gpu_daemon() as d:
        yield d


@async_test(timeout=120)
async def test_cuda_device_listed(gpu: DaemonProcess) -> None:
    async with await Client.connect(gpu.url) as c:
        devs = {d["name"]: d for d in await c.get_devices()}
        d = devs["cuda:0"]
        assert d["total"] > 0 and 0 < d["free"] <= d["total"] and d["alignment"] == 256
        assert d["max_size"] > 0


@async_test(timeout=120)
async def test_device_buffer_round_trips_with_checksums(gpu: DaemonProcess) -> None:
    async with await Client.connect(gpu.url) as c:
        buf = await c.alloc_buffer(96 * MiB, device="cuda:0")
        assert bytes(await c.get_tensor(buf.tensor(0, 4096))) == bytes(4096)  # zero filled
        for size, off in ((1, 0), (4 * KiB, 8), (5 * MiB + 3, MiB), (64 * MiB, 32 * MiB)):
            data = os.urandom(size)
            await c.set_tensor(buf.tensor(off, size), data)
            assert _sha(await c.get_tensor(buf.tensor(off, size))) == _sha(data), size
        other = await c.alloc_buffer(8 * MiB, device="cuda:0")
        data = os.urandom(8 * MiB)
        await c.set_tensor(buf.tensor(0, 8 * MiB), data)
        await c.copy_tensor(buf.tensor(0, 8 * MiB), other.tensor())
        assert _sha(await c.get_tensor(other.tensor())) == _sha(data)
        await c.buffer_clear(other, 7)
        assert bytes(await c.get_tensor(other.tensor(0, 16))) == b"\x07" * 16
        with pytest.raises(OutOfBounds):
            await c.get_tensor((other.id, 8 * MiB - 4, 8))
        await c.free_buffer(other)


@async_test(timeout=180)
async def test_engine_writes_device_to_device_across_two_daemons() -> None:
    # A write from device memory is staged whole: at most one staging chunk
    # (gpu.staging_chunk_kib, 4 MiB by default) per single write (docs/gpu.md).
    with gpu_daemon() as da, gpu_daemon() as db:
        async with await Client.connect(da.url) as a, await Client.connect(db.url) as b:
            src = await a.alloc_buffer(16 * MiB, device="cuda:0")
            dst = await b.alloc_buffer(16 * MiB, device="cuda:0")
            data = os.urandom(16 * MiB)
            await a.set_tensor(src.tensor(), data)
            mr, _ = await a.reg_mr(src)
            _, desc = await b.reg_mr(dst)
            for off in (0, 4 * MiB):
                w = await a.submit_single_write(4 * MiB, 71, (mr, off), (desc, off))
                await w.wait(60)
            await b.expect_imm_count(71, 2)
            idx = list(range(128, 256))
            p = await a.submit_paged_writes(64 * KiB, 72, (mr, Pages(idx, 64 * KiB)),
                                            (desc, Pages(idx, 64 * KiB)))
            await p.wait(60)
            await b.expect_imm_count(72, len(idx))
            got = await b.get_tensor(dst.tensor(0, 16 * MiB))
            assert _sha(got[:8 * MiB]) == _sha(data[:8 * MiB])
            assert _sha(got[8 * MiB:]) == _sha(data[8 * MiB:])
            # A device source over one staging chunk is refused, with the reason.
            with pytest.raises(BadRequest, match="larger than a staging chunk"):
                w = await a.submit_single_write(4 * MiB + 1, None, (mr, 0), (desc, 0))
                await w.wait(60)


@async_test(timeout=120)
async def test_cuda_ipc_registration(gpu: DaemonProcess) -> None:
    import cupy

    arr = cupy.zeros(4 * MiB, dtype=cupy.uint8)
    c = await Client.connect(gpu.url)
    buf = await c.register_cuda_memory(arr)
    data = os.urandom(4 * MiB)
    await c.set_tensor(buf.tensor(), data)
    cupy.cuda.Device().synchronize()
    assert _sha(cupy.asnumpy(arr)) == _sha(data)  # the daemon wrote into our memory
    arr[:8].set(np.frombuffer(b"fromgpu!", dtype=np.uint8))
    cupy.cuda.Device().synchronize()
    assert bytes(await c.get_tensor(buf.tensor(0, 8))) == b"fromgpu!"
    with pytest.raises(OutOfBounds):
        await c.get_tensor((buf.id, 4 * MiB - 4, 8))
    await c.close()
    async with await Client.connect(gpu.url) as c2:  # closed with its client
        with pytest.raises(NotFound):
            await c2.get_tensor((buf.id, 0, 8))


@async_test(timeout=120)
async def test_async_copy_does_not_synchronize_the_producer(gpu: DaemonProcess) -> None:
    import cupy

    async with await Client.connect(gpu.url) as c:
        remote = await c.alloc_buffer(4 * MiB)
        src = cupy.asarray(np.frombuffer(os.urandom(4 * MiB), dtype=np.uint8))
        expect = _sha(cupy.asnumpy(src))
        producer = cupy.cuda.Stream(non_blocking=True)
        other = cupy.cuda.Stream(non_blocking=True)
        busy(other, 1500)  # a kernel still running on another stream
        running = cupy.cuda.Event()
        running.record(other)
        await c.copy_from_device(remote.tensor(), src, stream=producer)
        await c.synchronize()
        left_while_running = not running.done
        assert _sha(await c.get_tensor(remote.tensor())) == expect
        assert left_while_running, "the SET waited for the other stream's kernel"
        other.synchronize()


@async_test(timeout=120)
async def test_watcher_bumped_by_a_kernel(gpu: DaemonProcess) -> None:
    import cupy

    got: list[tuple[int, int]] = []
    seen = threading.Event()
    async with await Client.connect(gpu.url) as c:
        w = await c.alloc_uvm_watcher(lambda o, n: (got.append((o, n)), seen.set()))
        ptr = w.device_pointer()
        s = cupy.cuda.Stream(non_blocking=True)
        how = bump(s, ptr, 5)
        s.synchronize()
        for _ in range(500):
            if seen.is_set():
                break
            await asyncio.sleep(0.01)
        assert got and got[-1] == (0, 5), how
        # Inside a CUDA graph too.
        seen.clear()
        nine = cupy.asarray(np.array([9], dtype=np.uint64))
        s.synchronize()
        s.begin_capture()
        bump(s, ptr, 9, word_src=nine)
        graph = s.end_capture()
        t0 = time.monotonic()
        graph.launch(s)
        for _ in range(500):
            if seen.is_set():
                break
            await asyncio.sleep(0.01)
        assert got[-1] == (5, 9), (how, time.monotonic() - t0)
        w.close()


@async_test(timeout=180)
async def test_inproc_registers_a_cupy_array_both_ways_with_a_daemon() -> None:
    """issue 21: an inproc engine registers the caller's CuPy array (no copy into a node
    buffer, no CUDA IPC) and writes it to a daemon's device buffer; the daemon writes
    back into another CuPy array of the caller; both compared by checksum."""
    import cupy

    size = 4 * MiB
    data = os.urandom(size)
    with gpu_daemon() as d:
        async with await Client.connect(d.url) as them:
            me = await Client.connect("inproc://", overrides={"gpu.devices": "cuda:0"},
                                      timeout=60)
            try:
                src = cupy.asarray(np.frombuffer(data, dtype=np.uint8))
                sbuf = await me.register_memory(src)
                assert sbuf.device == "cuda:0", sbuf
                smr, _ = await me.reg_mr(sbuf)
                dst = await them.alloc_buffer(size, device="cuda:0")
                dmr, ddesc = await them.reg_mr(dst)
                w = await me.submit_single_write(size, 81, (smr, 0), (ddesc, 0))
                await w.wait(60)
                assert _sha(await them.get_tensor(dst.tensor())) == _sha(data)
                back = cupy.zeros(size, dtype=cupy.uint8)
                _, bdesc = await me.reg_mr(await me.register_memory(back))
                expect = await me.expect_imm_count(82, 1, wait=False)
                w = await them.submit_single_write(size, 82, (dmr, 0), (bdesc, 0))
                await w.wait(60)
                await expect.wait(60)
                assert _sha(cupy.asnumpy(back).tobytes()) == _sha(data)
            finally:
                await me.close()
