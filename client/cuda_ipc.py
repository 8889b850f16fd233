"""Client-owned GPU memory: ``await c.register_cuda_memory(array)``.

The client exports a CUDA IPC handle (``cudaIpcGetMemHandle``) for its own
CuPy allocation and registers it with its daemon (ALLOC_BUFFER with
``ipc_handle``), which opens it and then serves tensors on it (SET, GET,
COPY, and the engine where it takes device memory), with the same bounds
checks as any buffer, against the registered size.  The buffer belongs to
the connection: closing the client closes the daemon's handle.

The daemon must run on the same machine and serve the same GPU: ``device``
defaults to ``cuda:N`` for the current CuPy device N, which is the daemon's
cuda:N only when both see the GPUs in the same order (the same
``CUDA_VISIBLE_DEVICES``).  The handle names the whole allocation; an array
inside a larger one (CuPy's memory pool) is registered by its offset in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transferd.protocol.constants import Command

from .buffers import RemoteBuffer

if TYPE_CHECKING:
    from .client import Client


class IpcMixin:
    async def register_cuda_memory(  # type: ignore[misc]
        self: Client, mem: Any, *, device: str | None = None,
    ) -> RemoteBuffer:
        """Register this process's device memory (a CuPy array, or (pointer, nbytes))."""
        from cupy.cuda import Device, runtime

        from transferd.memory.cuda import address_range

        from .copies import _device_range

        ptr, nbytes = _device_range(mem)
        extent = address_range(ptr)
        base = extent[0] if extent is not None else ptr
        handle = bytes(runtime.ipcGetMemHandle(base))
        dev = device or f"cuda:{int(Device().id)}"
        r = await self._call(Command.ALLOC_BUFFER, {
            "device": dev, "size": nbytes, "ipc_handle": handle, "ipc_offset": ptr - base})
        return RemoteBuffer(int(r.body["buffer"]), int(r.body["size"]), dev)
