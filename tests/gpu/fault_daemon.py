"""An rpc-server serving cuda:0 whose GPU can be broken from outside (TESTS ONLY).

``python -m tests.gpu.fault_daemon ARGS`` runs ``rpc-server ARGS``; once the file
named by ``GPU_FAULT_FILE`` exists, a kernel that executes ``__trap()`` is
launched on the first GPU group's own stream, in the daemon's process: the
device fails it, and the CUDA context of the daemon is broken from then on
(the error is sticky), as a real device fault leaves it.  What the daemon
must do then (issue 24.2): fail every operation on that device with a typed
error, never answer one ok or send staging the device never filled, and go
on serving host memory.  ``make gpu-check`` (its "fault" section) drives it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

TRAP_KERNEL = r"""
extern "C" __global__ void transferd_trap() { __trap(); }
"""


def main() -> None:
    from transferd.memory import cuda

    path = os.environ["GPU_FAULT_FILE"]
    started: list[Any] = []
    start = cuda.CudaDevices.start.__func__  # type: ignore[attr-defined]

    def keep(cls: type, *args: Any, **kw: Any) -> Any:
        devices = start(cls, *args, **kw)
        started.append(devices)
        return devices

    cuda.CudaDevices.start = classmethod(keep)  # type: ignore[method-assign, assignment]

    def break_the_device() -> None:
        while not os.path.exists(path) or not started:
            time.sleep(0.01)
        import cupy

        group = next(iter(started[0].groups.values()))
        with cupy.cuda.Device(group.info.index), group.stream.stream:
            cupy.RawKernel(TRAP_KERNEL, "transferd_trap")((1,), (1,), ())
        print("fault_daemon: trap kernel launched on the group's stream", flush=True)

    threading.Thread(target=break_the_device, name="fault-injector", daemon=True).start()
    from rpc_server.cli import main as rpc_main

    rpc_main()


if __name__ == "__main__":
    main()
