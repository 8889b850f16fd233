"""dma-buf export of CUDA memory without a GPU: transferd.rdma.dmabuf's driver calls on
a stand-in libcuda that keeps each thread's context stack and refuses the export where
no context is current (as the driver does: CUDA_ERROR_INVALID_CONTEXT), and hands out
real descriptors, so whether each one was closed is the kernel's answer.

The real driver and ibv_reg_dmabuf_mr need a GPU and a NIC (tests/rdma,
``make rdma-check`` on a machine with both)."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import pytest

from transferd.protocol.errors import BadRequest
from transferd.rdma import dmabuf
from transferd.rdma.dmabuf import CudaDriver, page_span
from transferd.rdma.loader import VerbsUnavailable

INVALID_CONTEXT = 201
PAGE = mmap.PAGESIZE


class StandinLibcuda:
    """The calls dmabuf makes, with ctypes arguments as the real library gets them."""

    def __init__(self, devices: int = 2) -> None:
        self.devices = devices
        self.local = threading.local()
        self.retained: dict[int, int] = {}
        self.exports: list[tuple[int, int, int | None]] = []  # base, size, current ctx
        self.fds: list[int] = []

    def _stack(self) -> list[int]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def cuInit(self, flags: int) -> int:
        return 0

    def cuDeviceGet(self, dev: ctypes._CArgObject, ordinal: int) -> int:
        if not 0 <= ordinal < self.devices:
            return 101  # CUDA_ERROR_INVALID_DEVICE
        dev._obj.value = ordinal  # type: ignore[attr-defined]
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx: ctypes._CArgObject,
                                 dev: ctypes.c_int) -> int:
        self.retained[dev.value] = self.retained.get(dev.value, 0) + 1
        ctx._obj.value = 0x1000 + dev.value  # type: ignore[attr-defined]
        return 0

    def cuDevicePrimaryCtxRelease_v2(self, dev: ctypes.c_int) -> int:
        self.retained[dev.value] -= 1
        return 0

    def cuCtxPushCurrent_v2(self, ctx: ctypes.c_void_p) -> int:
        self._stack().append(int(ctx.value or 0))
        return 0

    def cuCtxPopCurrent_v2(self, ctx: ctypes._CArgObject) -> int:
        ctx._obj.value = self._stack().pop()  # type: ignore[attr-defined]
        return 0

    def cuMemGetHandleForAddressRange(self, handle: ctypes._CArgObject,
                                      base: ctypes.c_uint64, size: ctypes.c_size_t,
                                      kind: int, flags: ctypes.c_ulonglong) -> int:
        stack = self._stack()
        self.exports.append((base.value, size.value, stack[-1] if stack else None))
        if not stack:
            return INVALID_CONTEXT
        assert kind == dmabuf.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
        fd = os.eventfd(0)
        self.fds.append(fd)
        handle._obj.value = fd  # type: ignore[attr-defined]
        return 0


def closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


pytestmark = pytest.mark.skipif(not hasattr(os, "eventfd"), reason="needs os.eventfd (Linux)")


def test_the_export_runs_with_the_pointers_device_current_then_lets_go() -> None:
    lib = StandinLibcuda()
    drv = CudaDriver(lib)
    fd, offset = dmabuf.export(drv, 0x7f00_0000_0000 + 100, 3 * PAGE, 1)
    try:
        # An aligned span of whole pages, from a context made current here (a worker
        # thread has none: the old call failed with CUDA_ERROR_INVALID_CONTEXT there).
        assert lib.exports == [(0x7f00_0000_0000, 4 * PAGE, 0x1001)]
        assert offset == 100
        assert lib._stack() == [] and lib.retained == {1: 0}
    finally:
        os.close(fd)


def test_without_a_current_context_the_driver_refuses() -> None:
    lib = StandinLibcuda()
    with pytest.raises(VerbsUnavailable, match="CUresult 201"):
        CudaDriver(lib).dmabuf_fd(0x10000, PAGE)  # no context made current


def test_the_fd_is_closed_when_the_registration_works_and_when_it_fails() -> None:
    lib = StandinLibcuda()
    drv = CudaDriver(lib)
    fd, _ = dmabuf.export(drv, 0x20000, PAGE, 0)
    assert dmabuf.register_closing(fd, lambda f: ("mr", f)) == ("mr", fd)
    assert closed(fd)

    fd, _ = dmabuf.export(drv, 0x20000, PAGE, 0)

    def refuse(f: int) -> object:
        raise BadRequest("ibv_reg_dmabuf_mr failed")

    with pytest.raises(BadRequest):
        dmabuf.register_closing(fd, refuse)
    assert closed(fd) and all(closed(f) for f in lib.fds)


def test_a_device_that_is_not_there_is_a_typed_refusal_and_leaves_nothing() -> None:
    lib = StandinLibcuda(devices=1)
    with pytest.raises(VerbsUnavailable, match="cuDeviceGet"):
        dmabuf.export(CudaDriver(lib), 0x20000, PAGE, 3)
    assert lib.exports == [] and lib.fds == [] and lib._stack() == []


def test_page_span() -> None:
    assert page_span(PAGE, PAGE) == (PAGE, PAGE, 0)
    assert page_span(PAGE + 1, PAGE) == (PAGE, 2 * PAGE, 1)
    with pytest.raises(BadRequest):
        page_span(0, 0)
