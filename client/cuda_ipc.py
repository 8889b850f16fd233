"""Client-owned GPU memory: ``await c.register_cuda_memory(array)``.

The client exports a CUDA IPC handle (``cudaIpcGetMemHandle``) for its own
CuPy allocation and registers it with its daemon (ALLOC_BUFFER with
``ipc_handle``), which opens it and then serves tensors on it (SET, GET,
COPY, and the engine where it takes device memory), with the same bounds
checks as any buffer, against the registered size.  The buffer belongs to
the connection: closing the client closes the daemon's handle.

The handle names the whole allocation; an array inside a larger one (CuPy's
memory pool) is registered by its offset in it, which the driver's
``cuMemGetAddressRange`` gives with the pointer's own device current in the
calling thread; where it cannot say, the registration is refused rather
than made at a guessed offset (client/devices.py).

The daemon must run on the same machine and serve the same GPU: ``device``
defaults to ``cuda:N`` for the device N the memory is on, which is the
daemon's cuda:N only when both see the GPUs in the same order (the same
``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transferd.protocol.constants import Command

from .buffers import RemoteBuffer
from .devices import CudaExport, export_cuda
from .replies import reply_uint

if TYPE_CHECKING:
    from .calls import Calls


class CudaIpc:
    """``register_cuda_memory`` of a Client."""

    def __init__(self, client: Calls) -> None:
        self._client = client

    async def register_cuda_memory(self, mem: Any, *, device: str | None = None
                                   ) -> RemoteBuffer:
        """Register this process's device memory (a CuPy array, (pointer, nbytes), or a
        :class:`CudaExport` made in another thread)."""
        export = mem if isinstance(mem, CudaExport) else export_cuda(mem)
        dev = device or f"cuda:{export.device}"
        r = await self._client._call(Command.ALLOC_BUFFER, {
            "device": dev, "size": export.nbytes, "ipc_handle": export.handle,
            "ipc_offset": export.offset})
        return RemoteBuffer(reply_uint(r, "buffer"), reply_uint(r, "size"), dev)
