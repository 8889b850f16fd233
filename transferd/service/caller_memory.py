"""Memory a caller in the node's own process brings: its array, used where it lies.

An inproc client (client/inproc.py) registers a numpy array, a ``bytearray``, an
``mmap`` or any writable, C-contiguous buffer, or a CuPy array, as a buffer of the
node without copying it into node memory and without CUDA IPC: the engine writes
into and sends from the caller's own bytes.  The node never frees such memory;
freeing the buffer (or the caller's end) only lets go of it.  While registered, the
caller's object stays exported (a ``bytearray`` cannot be resized under the
engine), and its charge to the device's limit is only its bookkeeping.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import numpy as np

from transferd.memory.base import Memory
from transferd.memory.cuda import CudaGroup, CudaMemory
from transferd.protocol.errors import BadRequest


def host_view_of(obj: Any) -> memoryview:
    """A writable, byte-wise view of ``obj``'s own memory; BadRequest when it has none
    the engine could write into (read-only, not contiguous)."""
    try:
        view = memoryview(obj)
    except TypeError:
        raise BadRequest(f"a {type(obj).__name__} is not a buffer: register a numpy array, "
                         "a bytearray, an mmap or another writable buffer") from None
    except (ValueError, BufferError) as exc:  # numpy: a dtype with no buffer format
        raise BadRequest(f"a {type(obj).__name__} gives no buffer ({exc}): register its "
                         "bytes (a.view(numpy.uint8))") from None
    if view.readonly:
        view.release()
        raise BadRequest(f"a read-only {type(obj).__name__} cannot be registered: peers "
                         "write into registered memory")
    if not view.c_contiguous:
        view.release()
        raise BadRequest(f"a non-contiguous {type(obj).__name__} cannot be registered: "
                         "pass a contiguous array (numpy.ascontiguousarray)")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


class CallerHostMemory(Memory):
    """The caller's host bytes: a view of its object, released (never freed) on close."""

    kind = "cpu"

    def __init__(self, device: str, view: memoryview) -> None:
        super().__init__(device, view.nbytes)
        self._view: memoryview | None = view
        self._pins = _pin_arrays(view.obj)
        self._addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0

    @classmethod
    def create(cls, device: str, size: int) -> Memory:
        raise BadRequest("caller memory is registered from the caller's own object, "
                         "not allocated")

    @property
    def host_view(self) -> memoryview | None:
        return self._view

    @property
    def address(self) -> int:
        return self._addr

    def resident(self) -> int:
        return 0  # the caller's pages, not the node's

    def describe(self) -> dict[str, Any]:
        return {"caller": True}

    def close(self) -> bool:
        view, self._view = self._view, None
        if view is not None:
            # An array still over it (one the caller took from a view) keeps the
            # caller's object exported until it goes; the memory is the caller's either
            # way, and charged nothing, so it is gone for the node now.
            with contextlib.suppress(BufferError):
                view.release()
        self._pins = []
        self._report_gone()
        return True


def _pin_arrays(obj: Any) -> list[weakref.ref[Any]]:
    """Weak references to every numpy array whose data ``obj``'s bytes are.

    A buffer export keeps a bytearray or an mmap from being resized or closed, but not
    a numpy array: ``a.resize(n, refcheck=False)`` reallocates its data under the
    engine, which would then write into freed memory.  numpy refuses that resize (even
    without refcheck) for an array something holds a weak reference to, so one is held
    on the array and on every array its data comes from (a view's bases), while the
    memory is registered."""
    pins: list[weakref.ref[Any]] = []
    while isinstance(obj, np.ndarray):
        pins.append(weakref.ref(obj))
        obj = obj.base
    return pins


class CallerCudaMemory(CudaMemory):
    """The caller's CuPy array (device memory of a GPU the node serves): reached by its
    device pointer through the GPU's group, as the node's own; never freed here."""

    def __init__(self, device: str, array: Any, group: CudaGroup) -> None:
        iface = array.__cuda_array_interface__
        ptr, _ = iface["data"]
        size = int(array.nbytes)
        strides = iface.get("strides")
        if strides is not None and not array.flags.c_contiguous:
            raise BadRequest("a non-contiguous CuPy array cannot be registered: pass "
                             "cupy.ascontiguousarray(a)")
        super().__init__(device, size, int(ptr), group)
        # Held so the caller's allocation outlives every write in flight into it.
        self._array: Any = array

    def describe(self) -> dict[str, Any]:
        return {"device_ptr": self.ptr, "caller": True}

    def resident(self) -> int:
        return 0

    def close(self) -> bool:
        if self._closed:
            return True
        self._closed = True
        self._array = None  # the caller's: let go of, not freed
        self._report_gone()
        return True


def cuda_device_of(array: Any) -> int | None:
    """The GPU index of a CuPy array (None: not device memory)."""
    if not hasattr(array, "__cuda_array_interface__"):
        return None
    dev = getattr(array, "device", None)
    return int(getattr(dev, "id", 0)) if dev is not None else 0
