"""``make gpu-check``'s sections for issue 24: what the first contact with a GPU would
have got wrong (scripts/gpu_check.py runs them, each in its own process).

A dry run drives each of them against the tests' stand-in device
(tests/standin_daemon.py: memory without a host view, reached through a stand-in
stream and staging, strict about pageable host memory), whose stream can be held
and broken from outside: the same scenarios, the same checks, no GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

KiB, MiB = 1024, 1 << 20

# Seconds each may take at most.
DEFECT_LIMITS = {"cancel": 60, "fault": 60, "sync_copies": 40, "ipc_offset": 30,
                 "copy_host": 60}


def _sha(b: Any) -> str:
    return hashlib.sha256(memoryview(b).cast("B")).hexdigest()


def _standin(env: dict[str, str | None] | None = None) -> Any:
    from tests.helpers import DaemonProcess

    return DaemonProcess(
        command=[sys.executable, "-m", "tests.standin_daemon", "-H", "127.0.0.1", "-p", "0",
                 "--metrics-port", "-1"], env=env or {}, ready_timeout=60)


def _hold_path(name: str) -> Path:
    return Path(os.environ["GPU_CHECK_OUT"]) / f"{name}.{os.getpid()}"


@contextlib.contextmanager
def _present(path: Path) -> Any:
    path.write_text("")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


async def _cancel(dry: bool) -> dict[str, Any]:
    """24.1: a write from device memory cancelled while its D2H copies run, then at once a
    SET through the same staging: the SET's bytes must land, checksummed, every round."""
    from client import Client, Pages
    from tests.gpu.gpu_common import gpu_daemon

    chunk = 256 * KiB if dry else 32 * MiB
    chunks = 4
    rounds = 4 if dry else 12
    hold = _hold_path("hold")
    if dry:
        src_d = _standin({"STANDIN_CHUNK": str(chunk), "STANDIN_CHUNKS": str(chunks),
                          "STANDIN_HOLD_FILE": str(hold)})
        device = "standin:0"
    else:
        src_d = gpu_daemon(env={"TRANSFERD_GPU_STAGING_MIB": str(chunk * chunks >> 20),
                                "TRANSFERD_GPU_STAGING_CHUNK_KIB": str(chunk >> 10)})
        device = "cuda:0"
    mismatches, cancelled = 0, 0
    with src_d as da, gpu_daemon(device="cpu") as db:
        async with await Client.connect(da.url) as a, await Client.connect(db.url) as b:
            src = await a.alloc_buffer(chunk * chunks, device=device)
            await a.set_tensor(src.tensor(), os.urandom(chunk * chunks))
            target = await a.alloc_buffer(chunk, device=device)
            mr, _ = await a.reg_mr(src)
            sink = await b.alloc_buffer(chunk * chunks)
            _, desc = await b.reg_mr(sink)
            pages = Pages(list(range(chunks)), chunk, 0)  # every staging chunk of a's pool
            load = _CopyLoad(dry)
            for _ in range(rounds):
                data = os.urandom(chunk)
                with _present(hold) if dry else contextlib.nullcontext():
                    load.start()  # the GPU's copy engines busy: a's D2H copies take longer
                    w = await a.submit_paged_writes(chunk, None, (mr, pages), (desc, pages))
                    cancelled += bool(await w.cancel())
                    setter = asyncio.ensure_future(a.set_tensor(target.tensor(), data))
                    await asyncio.sleep(0.05)
                await asyncio.wait_for(setter, 60)
                load.stop()
                got = await a.get_tensor(target.tensor())
                mismatches += _sha(got) != _sha(data)
    assert mismatches == 0, f"{mismatches} of {rounds} SETs after a cancel landed other bytes"
    return {"device": device, "rounds": rounds, "staging": f"{chunks} x {chunk} bytes",
            "cancelled_mid_copy": cancelled, "set_checksum_mismatches": mismatches}


class _CopyLoad:
    """Device-to-host copies of this process on the GPU (nothing in a dry run)."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self._keep: Any = None

    def start(self) -> None:
        if self.dry:
            return
        import cupy
        import cupyx
        import numpy as np

        if self._keep is None:
            n = 256 * MiB
            self._keep = (cupy.empty(n, dtype=cupy.uint8), cupyx.empty_pinned((n,), np.uint8),
                          cupy.cuda.Stream(non_blocking=True))
        dev, host, s = self._keep
        for _ in range(4):
            cupy.cuda.runtime.memcpyAsync(host.ctypes.data, dev.data.ptr, dev.nbytes, 2, s.ptr)

    def stop(self) -> None:
        if self._keep is not None:
            self._keep[2].synchronize()


def sec_cancel(dry: bool) -> dict[str, Any]:
    return asyncio.run(_cancel(dry))


async def _fault(dry: bool) -> dict[str, Any]:
    """24.2: a device that fails (a trap kernel in the daemon's context on a GPU; the
    stand-in's fault file in a dry run): SET, COPY and CLEAR fail with a typed error, a GET
    is cut, never answered with staging the device did not fill; host memory is served on."""
    from client import Client
    from transferd.protocol.errors import ConnectionLost, TransferdError

    fault = _hold_path("fault")
    if dry:
        d = _standin({"STANDIN_FAULT_FILE": str(fault)})
        device = "standin:0"
    else:
        from tests.helpers import DaemonProcess

        d = DaemonProcess(
            command=[sys.executable, "-m", "tests.gpu.fault_daemon", "-H", "127.0.0.1",
                     "-p", "0", "--metrics-port", "-1", "-d", "cuda:0"],
            env={"GPU_FAULT_FILE": str(fault)}, ready_timeout=120)
        device = "cuda:0"
    seen: dict[str, str] = {}

    async def outcome(name: str, call: Any) -> None:
        try:
            await call
        except ConnectionLost as exc:
            seen[name] = f"cut: {exc.message}"
        except TransferdError as exc:
            seen[name] = f"{type(exc).__name__}: {exc.message[:120]}"
        else:
            seen[name] = "ok"

    with d:
        c = await Client.connect(d.url)
        try:
            buf = await c.alloc_buffer(MiB, device=device)
            host = await c.alloc_buffer(MiB)
            await c.set_tensor(buf.tensor(0, 8), b"beforeit")
            # A GPU: the trap kernel goes on the group's stream; the stand-in: its copies fail.
            fault.write_text("")
            await asyncio.sleep(0.2 if dry else 1.0)
            await outcome("set", c.set_tensor(buf.tensor(0, 8), b"afterwrd"))
            await outcome("clear", c.buffer_clear(buf, 1))
            await outcome("copy_host_to_device", c.copy_tensor(host.tensor(0, 8),
                                                               buf.tensor(0, 8)))
            await outcome("get", c.get_tensor(buf.tensor(0, 8)))
        finally:
            await c.close()
        async with await Client.connect(d.url) as c2:  # the daemon serves on
            h = await c2.alloc_buffer(4096)
            data = os.urandom(4096)
            await c2.set_tensor(h.tensor(), data)
            host_ok = _sha(await c2.get_tensor(h.tensor())) == _sha(data)
    fault.unlink(missing_ok=True)
    wrong = {k: v for k, v in seen.items() if v == "ok"}
    assert not wrong, f"answered ok on a failed device: {sorted(wrong)}"
    assert host_ok, "host memory was not served after the device failed"
    return {"device": device, "after_the_fault": seen, "host_served_after": host_ok}


def sec_fault(dry: bool) -> dict[str, Any]:
    return asyncio.run(_fault(dry))


def _sync_copies(dry: bool) -> dict[str, Any]:
    """24.5: SyncClient copies with no ``stream=`` inside ``with stream:`` of a non-blocking
    stream: each goes after the kernel the caller queued on that stream (it fills the array
    after a 30 ms spin), so the bytes that land are the kernel's, every round."""
    from client import SyncClient
    from tests.gpu.gpu_common import busy, gpu_daemon

    rounds, size = 8, 4 * MiB
    wrong_from, wrong_to = 0, 0
    with gpu_daemon(device="cpu") as d, SyncClient.connect(d.url) as c:
        remote = c.alloc_buffer(size)
        if dry:
            import numpy as np

            from tests.standin_stream import StandinDeviceMemory, StandinStream

            s = StandinStream("caller")
            src, back = StandinDeviceMemory(size), StandinDeviceMemory(size)
            for v in range(1, rounds + 1):
                with s:
                    s.hold()  # the producer's kernel still runs
                    s.fill(src.ptr, v, size)
                    threading.Timer(0.03, s.resume).start()
                    c.copy_from_device(remote.tensor(), (src.ptr, size))
                    c.synchronize()
                    wrong_from += bytes(c.get_tensor(remote.tensor(0, 16))) != bytes([v]) * 16
                    c.copy_to_device((back.ptr, size), remote.tensor())
                s.synchronize()
                wrong_to += not bool(np.all(back.host_array() == v))
            s.close()
            how = "stand-in stream (dry run)"
        else:
            import cupy

            s = cupy.cuda.Stream(non_blocking=True)
            src = cupy.zeros(size, dtype=cupy.uint8)
            back = cupy.zeros(size, dtype=cupy.uint8)
            how = ""
            for v in range(1, rounds + 1):
                with s:
                    how = busy(s, 30)
                    src.fill(v)  # on s, after the spin
                    c.copy_from_device(remote.tensor(), src)  # no stream=: the caller's
                    c.synchronize()
                    wrong_from += bytes(c.get_tensor(remote.tensor(0, 16))) != bytes([v]) * 16
                    back.fill(0)
                    c.copy_to_device(back, remote.tensor())
                s.synchronize()
                wrong_to += not bool((back == v).all())
    assert not wrong_from and not wrong_to, (wrong_from, wrong_to)
    return {"rounds": rounds, "bytes": size, "busy_by": how,
            "device_to_remote_wrong": wrong_from, "remote_to_device_wrong": wrong_to}


def sec_sync_copies(dry: bool) -> dict[str, Any]:
    return _sync_copies(dry)


async def _ipc_offset() -> dict[str, Any]:
    """24.6: an array 1 MiB into an 8 MiB allocation, registered by CUDA IPC: the daemon
    writes exactly that range of the allocation, and reads the client's writes there."""
    import cupy
    import numpy as np

    from client import Client
    from tests.gpu.gpu_common import gpu_daemon

    with gpu_daemon() as d:
        block = cupy.zeros(8 * MiB, dtype=cupy.uint8)
        view = block[MiB:2 * MiB]
        async with await Client.connect(d.url) as c:
            buf = await c.register_cuda_memory(view)
            data = os.urandom(MiB)
            await c.set_tensor(buf.tensor(), data)
            cupy.cuda.Device().synchronize()
            host = cupy.asnumpy(block)
            inside = _sha(host[MiB:2 * MiB]) == _sha(data)
            outside = not host[:MiB].any() and not host[2 * MiB:].any()
            view[:8].set(np.frombuffer(b"offset!!", dtype=np.uint8))
            cupy.cuda.Device().synchronize()
            seen = bytes(await c.get_tensor(buf.tensor(0, 8))) == b"offset!!"
    assert inside and outside and seen, (inside, outside, seen)
    return {"offset": MiB, "daemon_wrote_the_range": inside, "nothing_outside_it": outside,
            "client_write_seen_at_the_offset": seen}


def sec_ipc_offset(dry: bool) -> dict[str, Any]:
    if dry:
        from transferd.memory.cuda_extent import ipc_span

        base = 1 << 40
        assert ipc_span(base + MiB, MiB, (base, 8 * MiB)) == (base, MiB)
        return {"ipc_span": "checked (no CUDA IPC without a GPU)"}
    return asyncio.run(_ipc_offset())


async def _copy_host(dry: bool) -> dict[str, Any]:
    """24.7: COPY between a host buffer and device memory while another client times 4 KiB
    GETs: the COPY goes through pinned staging off the loop, so the other client's worst
    wait stays near its own baseline; both directions checksummed."""
    from client import Client
    from tests.gpu.gpu_common import gpu_daemon, pct

    size = 8 * MiB if dry else 256 * MiB
    device = "standin:0" if dry else "cuda:0"
    d = _standin({"STANDIN_CHUNK": str(MiB), "STANDIN_CHUNKS": "4"}) if dry else gpu_daemon()
    with d:
        async with await Client.connect(d.url) as a, await Client.connect(d.url) as b:
            host = await a.alloc_buffer(size)
            dev = await a.alloc_buffer(size, device=device)
            small = await b.alloc_buffer(4096)
            data = os.urandom(size)
            await a.set_tensor(host.tensor(), data)

            async def timed(n: int, stop: asyncio.Event | None = None) -> list[float]:
                lat: list[float] = []
                while len(lat) < n or (stop is not None and not stop.is_set()):
                    t0 = time.perf_counter()
                    await b.get_tensor(small.tensor())
                    lat.append((time.perf_counter() - t0) * 1e3)
                    if stop is None and len(lat) >= n:
                        break
                return lat

            alone = await timed(300)
            stop = asyncio.Event()
            during = asyncio.ensure_future(timed(50, stop))
            t0 = time.perf_counter()
            copies = 3
            for _ in range(copies):
                await a.copy_tensor(host.tensor(), dev.tensor())
                await a.copy_tensor(dev.tensor(), host.tensor())
            took = time.perf_counter() - t0
            stop.set()
            busy = await during
            ok = _sha(await a.get_tensor(dev.tensor())) == _sha(data)
            ok = ok and _sha(await a.get_tensor(host.tensor())) == _sha(data)
    assert ok, "a COPY through staging changed the bytes"
    return {"device": device, "bytes": size, "copies_each_way": copies,
            "copy_GBps": 2 * copies * size / took / 1e9, "checksums_ok": ok,
            "get_ms_alone_p50": pct(alone, 50), "get_ms_alone_p99": pct(alone, 99),
            "get_ms_during_p50": pct(busy, 50), "get_ms_during_p99": pct(busy, 99),
            "get_ms_during_max": max(busy), "gets_during": len(busy),
            "p99_ratio": pct(busy, 99) / max(1e-6, pct(alone, 99))}


def sec_copy_host(dry: bool) -> dict[str, Any]:
    return asyncio.run(_copy_host(dry))


DEFECTS = {"cancel": sec_cancel, "fault": sec_fault, "sync_copies": sec_sync_copies,
           "ipc_offset": sec_ipc_offset, "copy_host": sec_copy_host}
