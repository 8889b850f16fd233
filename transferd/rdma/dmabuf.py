"""CUDA memory as a dma-buf for ``ibv_reg_dmabuf_mr``: the export, with the pointer's
own CUDA context current, and the descriptor closed on every path.

``cuMemGetHandleForAddressRange`` needs a current context in the calling thread (a rail's
worker has none of its own), and a range aligned to the host page size: the device's
primary context is retained and pushed around the call, and the page-aligned span
around the range is exported, the range's offset in it given to the registration.
Once ``ibv_reg_dmabuf_mr`` returned, the MR holds the dma-buf itself: the descriptor is
ours to close, and it is closed whether the registration worked or not.

The driver is libcuda through ctypes (as ``transferd.memory.cuda_extent`` asks it), so
nothing beyond the driver is needed; tests give a stand-in library with the same calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from transferd.protocol.errors import BadRequest

from .loader import VerbsUnavailable

T = TypeVar("T")

CUDA_SUCCESS = 0
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1


def page_span(addr: int, length: int, page: int = mmap.PAGESIZE) -> tuple[int, int, int]:
    """(aligned base, aligned size, offset of ``addr`` in it) of [addr, addr + length)."""
    if length <= 0:
        raise BadRequest(f"a dma-buf of {length} bytes")
    base = addr - addr % page
    end = -(-(addr + length) // page) * page
    return base, end - base, addr - base


class CudaDriver:
    """The driver calls of a dma-buf export, on a libcuda-like library."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self._check(lib.cuInit(0), "cuInit")

    @classmethod
    def load(cls) -> CudaDriver:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise VerbsUnavailable(f"dma-buf registration needs the CUDA driver: {exc}") \
                from None
        return cls(lib)

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if int(rc) != CUDA_SUCCESS:
            raise VerbsUnavailable(f"{what} failed (CUresult {int(rc)})")

    @contextlib.contextmanager
    def current(self, ordinal: int) -> Iterator[None]:
        """Device ``ordinal``'s primary context, current in this thread meanwhile."""
        lib = self.lib
        dev = ctypes.c_int(0)
        self._check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
        ctx = ctypes.c_void_p(0)
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                    f"cuDevicePrimaryCtxRetain(cuda:{ordinal})")
        try:
            self._check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
            try:
                yield
            finally:
                popped = ctypes.c_void_p(0)
                lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
        finally:
            lib.cuDevicePrimaryCtxRelease_v2(dev)

    def dmabuf_fd(self, base: int, size: int) -> int:
        fd = ctypes.c_int(-1)
        rc = self.lib.cuMemGetHandleForAddressRange(
            ctypes.byref(fd), ctypes.c_uint64(base), ctypes.c_size_t(size),
            CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, ctypes.c_ulonglong(0))
        if int(rc) != CUDA_SUCCESS:
            raise VerbsUnavailable(f"cuMemGetHandleForAddressRange(0x{base:x}, {size}) "
                                   f"failed (CUresult {int(rc)}): the GPU or driver does "
                                   "not export dma-buf")
        return int(fd.value)


def export(driver: CudaDriver, addr: int, length: int, ordinal: int) -> tuple[int, int]:
    """(a dma-buf fd covering the range's pages, the range's offset in it)."""
    base, size, offset = page_span(addr, length)
    with driver.current(ordinal):
        return driver.dmabuf_fd(base, size), offset


def register_closing(fd: int, register: Callable[[int], T],
                     close: Callable[[int], None] = os.close) -> T:
    """``register(fd)``, then ``fd`` closed, whatever happened (the MR keeps the
    dma-buf itself)."""
    try:
        return register(fd)
    finally:
        close(fd)
