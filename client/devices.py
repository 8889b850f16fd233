"""The caller's CUDA side of the async copies and of CUDA IPC: ranges, streams, devices.

CuPy's current device and current stream belong to the calling thread.  What
this module resolves it resolves in the thread that calls it: the async
client's calls run on its loop's thread, which is the caller's; SyncClient
calls these in the caller's thread before it hands the call to its own loop
thread (client/sync.py), so a copy without ``stream=`` goes on the caller's
current stream of the caller's current device, not on the null stream of
device 0 of the client's thread.

CuPy is imported only when a CuPy object (or no stream at all) is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transferd.protocol.errors import BadRequest

if TYPE_CHECKING:
    from transferd.memory.streams import DeviceStream


def device_range(obj: Any) -> tuple[int, int]:
    """``(device pointer, nbytes)`` of a contiguous CuPy array or such a pair."""
    if isinstance(obj, tuple) and len(obj) == 2:
        return int(obj[0]), int(obj[1])
    data = getattr(obj, "data", None)
    if data is not None and hasattr(data, "ptr") and hasattr(obj, "nbytes"):
        flags = getattr(obj, "flags", None)
        if flags is not None and not flags.c_contiguous:
            raise BadRequest("a device array for an async copy must be C-contiguous")
        return int(data.ptr), int(obj.nbytes)
    raise BadRequest("expected a CuPy array or (device pointer, nbytes)")


def capture_stream(stream: Any = None) -> DeviceStream:
    """The stream a copy goes on, resolved in the calling thread.

    A :class:`DeviceStream` as it is; a CuPy stream on the device it was made
    on; None: this thread's current stream (``with stream:`` of a
    DeviceStream, else CuPy's current stream of this thread's current device).
    """
    # Imported here: ``import client`` loads nothing of the daemon's memory.
    from transferd.memory.streams import DeviceStream, current_stream

    if isinstance(stream, DeviceStream):
        return stream
    if stream is None:
        current = current_stream()
        if current is not None:
            return current
        import cupy

        stream = cupy.cuda.get_current_stream()
    from transferd.memory.cuda import CudaStream

    return CudaStream.of(stream)


@dataclass(frozen=True)
class CudaExport:
    """A range of this process's device memory, exported for the daemon to open."""

    handle: bytes  # cudaIpcGetMemHandle of the allocation's base
    offset: int  # the range's offset in that allocation
    nbytes: int
    device: int  # the CUDA device the memory is on (in this process's numbering)


# cudaMemoryTypeDevice (cudaPointerAttributes.type)
_MEMORY_TYPE_DEVICE = 2


def export_cuda(mem: Any) -> CudaExport:
    """Export ``mem`` (a CuPy array, or (device pointer, nbytes)) by CUDA IPC.

    The pointer's own device is made current in this thread (its context is
    what ``cuMemGetAddressRange`` asks); the allocation's extent must be
    found and hold the range, or this refuses (BadRequest / OutOfBounds):
    a handle opened at a guessed offset would serve the wrong bytes.
    """
    from cupy.cuda import Device, runtime

    from transferd.memory.cuda_extent import address_range, ipc_span

    ptr, nbytes = device_range(mem)
    data = getattr(mem, "data", None)
    index = getattr(data, "device_id", None)
    if index is None:
        # A bare pointer: ask the runtime whose it is (it needs a context in this
        # thread first; with unified addressing any device's will do).
        runtime.memGetInfo()
        try:
            attrs = runtime.pointerGetAttributes(ptr)
        except runtime.CUDARuntimeError as exc:
            raise BadRequest(f"0x{ptr:x} is not CUDA memory: {exc}") from None
        if int(attrs.type) != _MEMORY_TYPE_DEVICE:
            raise BadRequest(f"0x{ptr:x} is not device memory (cudaPointerAttributes.type "
                             f"{int(attrs.type)}): only cudaMalloc'd memory has an IPC handle")
        index = int(attrs.device)
    with Device(int(index)):
        runtime.memGetInfo()  # the device's primary context, current in this thread
        base, offset = ipc_span(ptr, nbytes, address_range(ptr))
        handle = bytes(runtime.ipcGetMemHandle(base))
    return CudaExport(handle, offset, nbytes, int(index))
