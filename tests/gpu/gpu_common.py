"""What tests/gpu and scripts/gpu_check.py share: CUDA availability, kernels, daemons.

Kernels are compiled by CuPy (NVRTC).  Where NVRTC is missing, each helper
falls back to what needs no compiler (copy-engine work), and says which it
used, so a machine without the compiler still measures something.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from tests.helpers import DaemonProcess
from transferd.memory.cuda import availability

COUNT, REASON = availability()
NO_GPU_REASON = f"no CUDA device: {REASON}" if not COUNT else ""

SPIN_KERNEL = r"""
extern "C" __global__ void transferd_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""

_kernels: dict[str, Any] = {}


def kernel(name: str) -> Any:
    """A compiled kernel, or raises (NVRTC missing): callers fall back."""
    import cupy

    from client.watchers import BUMP_KERNEL

    if name not in _kernels:
        src = {"transferd_spin": SPIN_KERNEL, "transferd_bump": BUMP_KERNEL}[name]
        k = cupy.RawKernel(src, name)
        k.compile()
        _kernels[name] = k
    return _kernels[name]


def busy(stream: Any, ms: float) -> str:
    """Keep ``stream`` busy for about ``ms`` milliseconds; returns how."""
    import cupy
    import numpy as np

    try:
        k = kernel("transferd_spin")
        with stream:
            k((1,), (1,), (np.uint64(int(ms * 1e6)),))
        return "spin kernel (globaltimer)"
    except Exception:
        pass
    # No compiler: device-to-device copies of a large buffer, timed once.
    n = 1 << 30
    a, b = cupy.empty(n, dtype=cupy.uint8), cupy.empty(n, dtype=cupy.uint8)
    t0 = time.perf_counter()
    b.data.copy_from_device(a.data, n)
    cupy.cuda.Device().synchronize()
    per = max(1e-4, time.perf_counter() - t0)
    with stream:
        for _ in range(max(1, int(ms / 1000 / per))):
            b.data.copy_from_device_async(a.data, n, stream)
    _kernels.setdefault("_keep", []).append((a, b))
    return "device-to-device copies (no NVRTC)"


def bump(stream: Any, device_ptr: int, value: int, word_src: Any = None) -> str:
    """Store ``value`` at ``device_ptr`` from the device; returns how."""
    import numpy as np

    try:
        k = kernel("transferd_bump")
        with stream:
            k((1,), (1,), (np.uint64(device_ptr), np.uint64(value)))
        return "kernel store"
    except Exception:
        pass
    import cupy

    # (Inside a graph capture the caller passes ``word_src`` holding the value
    # already: a copy from pageable host memory cannot be captured.)
    src = word_src
    if src is None:
        src = cupy.empty(1, dtype=cupy.uint64)
        src.set(np.array([value], dtype=np.uint64), stream=stream)
        _kernels.setdefault("_keep", []).append(src)
    cupy.cuda.runtime.memcpyAsync(device_ptr, src.data.ptr, 8, 4, stream.ptr)
    return "copy-engine store (no NVRTC)"


def gpu_daemon(args: Sequence[str] = (), device: str = "cuda:0",
               env: dict[str, str | None] | None = None) -> DaemonProcess:
    """An rpc-server serving ``device`` ("cpu": host memory only), on loopback, metrics off."""
    return DaemonProcess(
        [*(["-d", device] if device != "cpu" else []), *args], env=env,
        command=[sys.executable, "-m", "rpc_server.cli", "-H", "127.0.0.1", "-p", "0",
                 "--metrics-port", "-1"],
        ready_timeout=120)


def pct(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))] if s else float("nan")
