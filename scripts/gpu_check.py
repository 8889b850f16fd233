#!/usr/bin/env python3
"""``make gpu-check``: GPU tests and GPU benchmarks, one report (markdown and JSON).

    python3 scripts/gpu_check.py [--out DIR] [--dry-run] [--only SECTION ...]

Every section runs in its own subprocess under its own time limit, so a
failure (or a crash in a CUDA library) in one is recorded in the report and
the others still run.  Without a CUDA device (or with ``--dry-run``) every
section runs its plumbing only and the report says why nothing ran on a GPU;
the exit status is 0 then.  With a device, the exit status is 1 if any
section failed.  Needs only this checkout and the machine's own Python with
numpy, uvloop, msgpack, click, prometheus-client, pytest (and CuPy for the GPU):
nothing is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KiB, MiB = 1024, 1 << 20
# Seconds each section may take at most; the whole run also has a budget, so
# that it ends (report written) well under 8 minutes whatever hangs.
BUDGET = 440
LIMITS = {"env": 60, "tests": 240, "roundtrip": 60, "engine": 60, "ipc": 40,
          "copies": 60, "watcher": 40, "bandwidth": 40,
          # Issue 24: what the first contact with a GPU would have got wrong.
          "cancel": 60, "fault": 60, "sync_copies": 40, "ipc_offset": 30, "copy_host": 60}
SECTIONS = list(LIMITS)


def _sha(b: Any) -> str:
    return hashlib.sha256(memoryview(b).cast("B")).hexdigest()


def _gpu() -> tuple[int, str]:
    from transferd.memory.cuda import availability

    return availability()


# -- sections: each returns a dict of results (raises on failure) --------------------------


def sec_env(dry: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                           "host": platform.node()}
    with contextlib.suppress(Exception):
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()
    try:
        import cupy

        out["cupy"] = cupy.__version__
        out["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        out["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as exc:
        out["cupy"] = f"not usable: {exc}"
    if dry:
        return out
    from transferd.memory import cuda

    info = cuda.device_info(0)
    out["device"] = {"name": info.name, "total": info.total, "free": info.free,
                     "pci_bus_id": info.pci_bus_id, "numa_node": info.numa_node}
    g = cuda.start_group(0, chunk=4 * MiB, chunks=4)
    out["group"] = g.describe() | {"pinned": bool(g.worker.pinned)}
    if g.worker is not None and g.worker.cpu is not None:
        assert g.worker.pinned, "the group's worker could not be pinned"
    g.stop()
    return out


def sec_tests(dry: bool) -> dict[str, Any]:
    junit = Path(os.environ["GPU_CHECK_OUT"]) / "gpu-junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu",
           "--junitxml", str(junit), "tests/gpu"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=LIMITS["tests"])
    tail = (r.stdout + r.stderr).strip().splitlines()[-15:]
    out = {"exit": r.returncode, "summary": tail[-1] if tail else "", "tail": tail}
    if r.returncode not in (0, 5):
        raise AssertionError(f"pytest tests/gpu exited {r.returncode}: {out['summary']}")
    return out


# A dry run drives the same code against host memory ("cpu"): the section's own
# plumbing (daemons, client, checksums, figures) is exercised without a GPU.


async def _roundtrip(device: str) -> dict[str, Any]:
    from client import Client
    from tests.gpu.gpu_common import gpu_daemon

    res: dict[str, Any] = {"device": device}
    sizes = (4 * KiB, 1 * MiB, 64 * MiB, 256 * MiB) if device != "cpu" else (4 * KiB, MiB)
    with gpu_daemon(device=device) as d:
        async with await Client.connect(d.url) as c:
            buf = await c.alloc_buffer(max(sizes), device=device)
            for size in sizes:
                data = os.urandom(size)
                t0 = time.perf_counter()
                await c.set_tensor(buf.tensor(0, size), data)
                t1 = time.perf_counter()
                got = await c.get_tensor(buf.tensor(0, size))
                t2 = time.perf_counter()
                ok = _sha(got) == _sha(data)
                res[f"{size}"] = {"ok": ok, "set_GBps": size / (t1 - t0) / 1e9,
                                  "get_GBps": size / (t2 - t1) / 1e9}
                assert ok, f"checksum mismatch at {size} bytes"
    return res


def sec_roundtrip(dry: bool) -> dict[str, Any]:
    return asyncio.run(_roundtrip("cpu" if dry else "cuda:0"))


async def _engine(device: str) -> dict[str, Any]:
    """Device to device engine writes across two daemons (through both sides' staging).

    A write from device memory is staged whole before it is sent, so each
    single write is one staging chunk (``gpu.staging_chunk_kib``, 4 MiB by
    default) and each paged write at most that many bytes of pages.
    """
    from client import Client, Pages
    from tests.gpu.gpu_common import gpu_daemon

    step = 4 * MiB
    size = 64 * MiB if device != "cpu" else 8 * MiB
    page = 32 * KiB
    with gpu_daemon(device=device) as da, gpu_daemon(device=device) as db:
        async with await Client.connect(da.url) as a, await Client.connect(db.url) as b:
            src = await a.alloc_buffer(size, device=device)
            dst = await b.alloc_buffer(size, device=device)
            data = os.urandom(size)
            await a.set_tensor(src.tensor(), data)
            mr, _ = await a.reg_mr(src)
            _, desc = await b.reg_mr(dst)
            # Single writes: the first half, one staging chunk each, all in flight.
            half = size // 2
            t0 = time.perf_counter()
            counted = await b.expect_imm_count(81, half // step, wait=False)
            writes = [await a.submit_single_write(step, 81, (mr, off), (desc, off))
                      for off in range(0, half, step)]
            for w in writes:
                await w.wait(60)
            await counted.wait(60)
            single = time.perf_counter() - t0
            # Paged writes: the second half in 32 KiB pages, a chunk's worth per write.
            per = step // page
            pages = list(range(half // page, size // page))
            t0 = time.perf_counter()
            counted = await b.expect_imm_count(82, len(pages), wait=False)
            writes = []
            for i in range(0, len(pages), per):
                idx = pages[i:i + per]
                writes.append(await a.submit_paged_writes(
                    page, 82, (mr, Pages(idx, page)), (desc, Pages(idx, page))))
            for w in writes:
                await w.wait(60)
            await counted.wait(60)
            paged = time.perf_counter() - t0
            ok = _sha(await b.get_tensor(dst.tensor())) == _sha(data)
            assert ok, "the destination's bytes differ"
    return {"device": device, "bytes": size, "single_writes": half // step,
            "single_write_GBps": half / single / 1e9, "paged_pages": len(pages),
            "paged_GBps": (size - half) / paged / 1e9, "ok": ok}


def sec_engine(dry: bool) -> dict[str, Any]:
    return asyncio.run(_engine("cpu" if dry else "cuda:0"))


async def _ipc() -> dict[str, Any]:
    import cupy
    import numpy as np

    from client import Client
    from tests.gpu.gpu_common import gpu_daemon

    with gpu_daemon() as d:
        arr = cupy.zeros(16 * MiB, dtype=cupy.uint8)
        c = await Client.connect(d.url)
        buf = await c.register_cuda_memory(arr)
        data = os.urandom(16 * MiB)
        await c.set_tensor(buf.tensor(), data)
        cupy.cuda.Device().synchronize()
        ok_in = _sha(cupy.asnumpy(arr)) == _sha(data)
        arr[:4].set(np.frombuffer(b"ipc!", dtype=np.uint8))
        cupy.cuda.Device().synchronize()
        ok_out = bytes(await c.get_tensor(buf.tensor(0, 4))) == b"ipc!"
        await c.close()
    assert ok_in and ok_out, (ok_in, ok_out)
    return {"daemon_wrote_client_memory": ok_in, "client_write_seen_by_daemon": ok_out}


def sec_ipc(dry: bool) -> dict[str, Any]:
    return {} if dry else asyncio.run(_ipc())


async def _copies_arm(url: str, async_copy: bool, steps: int, size: int) -> dict[str, Any]:
    import cupy
    import numpy as np

    from client import Client
    from tests.gpu.gpu_common import busy, pct

    if async_copy:
        os.environ.pop("TRANSFERD_NO_ASYNC_COPY", None)
    else:
        os.environ["TRANSFERD_NO_ASYNC_COPY"] = "1"
    async with await Client.connect(url) as c:
        remote = await c.alloc_buffer(size)
        dev = await c.alloc_buffer(size)
        src = cupy.asarray(np.frombuffer(os.urandom(size), dtype=np.uint8))
        back = cupy.zeros(size, dtype=cupy.uint8)
        producer = cupy.cuda.Stream(non_blocking=True)
        other = cupy.cuda.Stream(non_blocking=True)
        step_ms, call_ms, overlapped = [], [], 0
        how = ""
        for _ in range(steps):
            how = busy(other, 20)  # another stream's kernel, running through the step
            running = cupy.cuda.Event()
            running.record(other)
            t0 = time.perf_counter()
            await c.copy_from_device(remote.tensor(), src, stream=producer)
            call_ms.append((time.perf_counter() - t0) * 1e3)
            await c.synchronize()  # the step's flush point: the SET has left
            overlapped += not running.done
            await c.copy_to_device(back, remote.tensor(), stream=producer)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            other.synchronize()
        producer.synchronize()
        ok = _sha(cupy.asnumpy(back)) == _sha(cupy.asnumpy(src))
        del dev
    return {"async_copy": async_copy, "ok": ok, "steps": steps, "bytes": size,
            "step_ms_p50": pct(step_ms, 50), "step_ms_p99": pct(step_ms, 99),
            "call_ms_p50": pct(call_ms, 50),
            "set_left_while_other_stream_busy": f"{overlapped}/{steps}", "busy_by": how}


async def _copies() -> dict[str, Any]:
    from tests.gpu.gpu_common import gpu_daemon

    with gpu_daemon() as d:
        on = await _copies_arm(d.url, True, 20, 4 * MiB)
        off = await _copies_arm(d.url, False, 20, 4 * MiB)
    os.environ.pop("TRANSFERD_NO_ASYNC_COPY", None)
    assert on["ok"] and off["ok"], "a copy came back different"
    return {"async": on, "TRANSFERD_NO_ASYNC_COPY=1": off}


def sec_copies(dry: bool) -> dict[str, Any]:
    return {} if dry else asyncio.run(_copies())


async def _watcher(dry: bool) -> dict[str, Any]:
    import threading

    from client import Client
    from tests.gpu.gpu_common import bump, gpu_daemon, pct

    n = 200
    with gpu_daemon(device="cpu" if dry else "cuda:0") as d:
        async with await Client.connect(d.url) as c:
            arrived: dict[int, float] = {}
            ev = threading.Event()

            def cb(old: int, new: int) -> None:
                arrived[new] = time.perf_counter()
                ev.set()

            w = await c.alloc_uvm_watcher(cb)
            if not dry:
                import cupy

                ptr = w.device_pointer()
                s = cupy.cuda.Stream(non_blocking=True)
            lat: list[float] = []
            how = "host store (dry run)"
            deadline = time.perf_counter() + 25
            for i in range(1, n + 1):
                if time.perf_counter() > deadline or (i > 5 and not lat):
                    break  # the word is not reaching the callback: report what was seen
                ev.clear()
                t0 = time.perf_counter()
                if dry:
                    w.set(i)
                else:
                    how = bump(s, ptr, i)
                for _ in range(2000):
                    if i in arrived:
                        break
                    await asyncio.sleep(0.0005)
                if i in arrived:
                    lat.append((arrived[i] - t0) * 1e6)
            w.close()
    assert len(lat) >= n * 0.9, f"only {len(lat)} of {n} bumps reached the callback"
    return {"bumps": n, "seen": len(lat), "how": how, "launch_to_callback_us_p50": pct(lat, 50),
            "launch_to_callback_us_p99": pct(lat, 99)}


def sec_watcher(dry: bool) -> dict[str, Any]:
    return asyncio.run(_watcher(dry))


def sec_bandwidth(dry: bool) -> dict[str, Any]:
    if dry:
        return {}
    import cupy
    import numpy as np

    from transferd.memory.cuda import CudaStream, PinnedHost

    size = 256 * MiB
    dev = cupy.empty(size, dtype=cupy.uint8)
    stream = CudaStream(0)
    pinned = PinnedHost(size)
    pageable = np.empty(size, dtype=np.uint8)
    cupy_pinned = cupyx_pinned(size)

    def timed(fn: Callable[[], None], reps: int = 5) -> float:
        fn()
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        cupy.cuda.Device().synchronize()
        return size * reps / (time.perf_counter() - t0) / 1e9

    def ours_h2d() -> None:
        stream.copy_h2d(dev.data.ptr, pinned.ptr, size)
        stream.synchronize()

    def ours_d2h() -> None:
        stream.copy_d2h(pinned.ptr, dev.data.ptr, size)
        stream.synchronize()

    return {
        "bytes": size,
        "staging_h2d_GBps": timed(ours_h2d), "staging_d2h_GBps": timed(ours_d2h),
        "cupy_pageable_h2d_GBps": timed(lambda: dev.set(pageable)),
        "cupy_pageable_d2h_GBps": timed(lambda: dev.get(out=pageable)),
        "cupy_pinned_h2d_GBps": timed(lambda: dev.set(cupy_pinned)),
        "cupy_pinned_d2h_GBps": timed(lambda: dev.get(out=cupy_pinned)),
    }


def cupyx_pinned(size: int) -> Any:
    import cupyx
    import numpy as np

    return cupyx.empty_pinned((size,), dtype=np.uint8)


# -- issue 24: the defects a GPU shows -------------------------------------------------------
#
# A dry run drives each of these against the tests' stand-in device (tests/standin_daemon.py:
# memory without a host view, reached through a stand-in stream and staging, strict about
# pageable host memory), whose stream can be held and broken from outside: the same
# scenarios, the same checks, no GPU.


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


RUN = {"env": sec_env, "tests": sec_tests, "roundtrip": sec_roundtrip, "engine": sec_engine,
       "ipc": sec_ipc, "copies": sec_copies, "watcher": sec_watcher, "bandwidth": sec_bandwidth,
       "cancel": sec_cancel, "fault": sec_fault, "sync_copies": sec_sync_copies,
       "ipc_offset": sec_ipc_offset, "copy_host": sec_copy_host}


# -- the driver ----------------------------------------------------------------------------------


def run_section(name: str, dry: bool, result: Path) -> None:
    """In the child: run one section, write its JSON (status, seconds, results or error)."""
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"section": name}
    try:
        rec["results"] = RUN[name](dry)
        rec["status"] = "dry-run" if dry and name != "env" else "ok"
    except Exception as exc:
        # A feature this build says it does not have is reported as such, not as a failure.
        rec["status"] = "not-built" if "only in this build" in str(exc) else "failed"
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["traceback"] = traceback.format_exc()[-4000:]
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    result.write_text(json.dumps(rec, indent=1, default=str))


def drive(out: Path, dry: bool, only: list[str]) -> int:
    count, reason = (0, "--dry-run given") if dry else _gpu()
    dry = dry or not count
    why = "" if count and not dry else (reason if reason else "--dry-run given")
    print(f"gpu-check: {'DRY RUN: ' + why if dry else f'{count} CUDA device(s)'}", flush=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["GPU_CHECK_OUT"] = str(out)
    for k in [k for k in env if k.startswith("TRANSFERD_")]:
        del env[k]
    records = []
    started = time.perf_counter()
    for name in only or SECTIONS:
        res = out / f"section-{name}.json"
        res.unlink(missing_ok=True)
        left = BUDGET - (time.perf_counter() - started)
        if left < 10:
            rec = {"section": name, "status": "failed", "seconds": 0,
                   "error": f"not run: the run's budget of {BUDGET} s was spent"}
            records.append(rec)
            print(f"  {name:<10} failed   (out of time)", flush=True)
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name,
               "--result", str(res)] + (["--dry-run"] if dry else [])
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=min(LIMITS[name], left))
            log = (r.stdout + r.stderr)[-6000:]
            rc: int | str = r.returncode
        except subprocess.TimeoutExpired as exc:
            log = ((exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes)
                   else str(exc.stdout or ""))[-6000:]
            rc = "timeout"
        (out / f"section-{name}.log").write_text(log)
        if res.exists():
            rec = json.loads(res.read_text())
        else:
            rec = {"section": name, "status": "failed",
                   "error": f"the section's process ended ({rc}) without a result",
                   "seconds": round(time.perf_counter() - t0, 2)}
        rec["exit"] = rc
        records.append(rec)
        print(f"  {name:<10} {rec['status']:<8} {rec.get('seconds', 0):>7.1f} s"
              + (f"  {rec['error']}" if rec.get("error") else ""), flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "dry_run": dry, "reason": why, "seconds": round(time.perf_counter() - started, 1),
              "sections": records}
    (out / "gpu-report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu-report.md").write_text(markdown(report))
    print(f"gpu-check: report in {out}/gpu-report.md and gpu-report.json", flush=True)
    failed = [r["section"] for r in records if r["status"] == "failed"]
    if dry:
        broke = f"; these sections broke: {', '.join(failed)}" if failed else ""
        print(f"gpu-check: no CUDA device: {why}: nothing ran on a GPU "
              f"(the script's own plumbing did{broke})")
    return 1 if failed else 0


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# gpu-check report, {report['date']}", ""]
    if report["dry_run"]:
        lines += [f"**Dry run: no CUDA device ({report['reason']}).** Nothing below ran on a "
                  "GPU; each section only checked its own plumbing.", ""]
    lines += [f"Total {report['seconds']} s.", "", "| section | status | seconds | note |",
              "|---|---|---|---|"]
    for r in report["sections"]:
        note = r.get("error", "") or ""
        lines.append(f"| {r['section']} | {r['status']} | {r.get('seconds', '')} | "
                     f"{note.replace('|', '/')[:200]} |")
    for r in report["sections"]:
        res = r.get("results")
        if res:
            lines += ["", f"## {r['section']}", "", "```json",
                      json.dumps(res, indent=1, default=str)[:4000], "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description="GPU tests and benchmarks, with a report")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "gpu-check-out"))
    ap.add_argument("--dry-run", action="store_true", help="exercise the plumbing only")
    ap.add_argument("--only", nargs="*", default=[], choices=SECTIONS)
    ap.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.section:
        run_section(a.section, a.dry_run, Path(a.result))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.exit(drive(out, a.dry_run, a.only))


if __name__ == "__main__":
    main()
