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
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpu_defects import DEFECT_LIMITS, DEFECTS  # noqa: E402 - the checkout on the path first

KiB, MiB = 1024, 1 << 20
# Seconds each section may take at most; the whole run also has a budget, so
# that it ends (report written) well under 8 minutes whatever hangs.
BUDGET = 440
LIMITS = {"env": 60, "tests": 240, "roundtrip": 60, "engine": 60, "ipc": 40,
          "copies": 60, "watcher": 40, "bandwidth": 40, **DEFECT_LIMITS}
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


RUN = {"env": sec_env, "tests": sec_tests, "roundtrip": sec_roundtrip, "engine": sec_engine,
       "ipc": sec_ipc, "copies": sec_copies, "watcher": sec_watcher, "bandwidth": sec_bandwidth,
       **DEFECTS}


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
