"""Where a CUDA pointer's allocation starts and ends, for CUDA IPC (no CuPy needed).

A CUDA IPC handle names a whole allocation (``cudaIpcGetMemHandle`` of its
base); a range inside one (an array in CuPy's memory pool) is exported as
the handle plus its offset.  Both the client (exporting) and the daemon
(checking what it opened) ask the driver for the allocation's extent, and
refuse rather than guess when it cannot say.  A leaf: the client imports it
without loading anything of the daemon.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from transferd.protocol.errors import BadRequest, OutOfBounds


def address_range(ptr: int) -> tuple[int, int] | None:
    """``(base, size)`` of the allocation ``ptr`` lies in (``cuMemGetAddressRange``).

    Through the driver library itself (CuPy does not wrap this call).  It
    needs a current context in the calling thread (the caller makes the
    pointer's own device current first); None where it cannot be asked or
    the driver does not know the pointer.
    """
    fn = _get_address_range()
    if fn is None:
        return None
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    if fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        return None
    return int(base.value), int(size.value)


@functools.cache
def _get_address_range() -> Any:
    """The driver's ``cuMemGetAddressRange_v2``, typed; None without a driver."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return None
    # CUresult cuMemGetAddressRange(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                   ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return fn


def ipc_span(ptr: int, nbytes: int, extent: tuple[int, int] | None) -> tuple[int, int]:
    """``(allocation base, offset of ptr in it)`` for exporting ``[ptr, ptr + nbytes)``.

    A CUDA IPC handle names a whole allocation: the range's offset in it has
    to be known, never guessed.  BadRequest where the allocation could not be
    found, OutOfBounds where the range does not lie inside it.
    """
    if extent is None:
        raise BadRequest(f"cannot find the CUDA allocation of 0x{ptr:x} "
                         "(cuMemGetAddressRange failed): not registering it at a guessed offset")
    base, size = extent
    if nbytes < 0 or ptr < base or ptr + nbytes > base + size:
        raise OutOfBounds(f"[0x{ptr:x}, +{nbytes}) is outside its allocation "
                          f"[0x{base:x}, +{size})")
    return base, ptr - base
