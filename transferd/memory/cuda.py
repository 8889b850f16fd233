"""CUDA device memory through CuPy (device kind ``"cuda"``, devices ``cuda:N``).

Works with cupy-cuda12x (the ``gpu`` extra) and cupy-cuda13x alike: only the
runtime calls both expose are used (``cupy.cuda.runtime``: malloc, free,
memcpy(Async), memsetAsync, hostAlloc, hostRegister, pointerGetAttributes,
ipcGetMemHandle / ipcOpenMemHandle, deviceGetPCIBusId, memGetInfo), and CuPy
is imported only when a CUDA device is asked for.

- :class:`CudaMemory`: ``cudaMalloc``'d memory, zero filled, no host view;
  its way in and out is its group's staging path (``staging``, a DeviceIO).
- :class:`IpcCudaMemory`: memory a client allocated in its own process and
  exported with ``cudaIpcGetMemHandle``; opened here, closed when its buffer
  goes (the connection that registered it closed, or FREE_BUFFER).
- :class:`CudaGroup` (a :class:`~.base.MemorySource`): what one GPU gets in
  the daemon: a worker thread pinned to a core of the GPU's NUMA node (sysfs,
  through the PCI bus id CuPy reports) with the GPU's context current, a
  non-blocking stream, the event waiter, and one bounded pool of pinned
  staging allocated on that worker.  It makes the GPU's memory.
- :class:`CudaDevices`: the groups of one daemon, started with it and
  stopped with it (the daemon holds it; nothing here is a module global).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transferd.protocol.errors import BadRequest, NotFound, OutOfBounds, OutOfMemory
from transferd.workers.affinity import (
    allowed_cpus,
    choose_cpu,
    cpus_of_node,
    numa_node_of_pci,
)

from .base import Memory, MemorySource
from .buffers import DeviceSpec
from .cuda_extent import address_range, ipc_span
from .staging import DEFAULT_CHUNK, DEFAULT_CHUNKS, DeviceIO, StagingPool
from .streams import DeviceEvent, DeviceFault, DeviceStream, EventWaiter

log = logging.getLogger("transferd.memory.cuda")

# cudaMemcpyDefault: with unified addressing the runtime works out the
# direction (host, device, peer device) from the pointers.
MEMCPY_DEFAULT = 4
# cudaMalloc aligns to at least 256 bytes on every CUDA GPU.
ALIGNMENT = 256
CUDA_SUCCESS = 0
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_NOT_READY = 600
IPC_HANDLE_BYTES = 64


def _cupy() -> Any:
    import cupy

    return cupy


def availability() -> tuple[int, str]:
    """``(device count, reason)``: the reason says why there is none, if none."""
    try:
        cupy = _cupy()
    except Exception as exc:  # ImportError, or a CuPy that cannot load its libraries
        return 0, f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError: no driver, no device
        return 0, f"CuPy finds no CUDA device ({exc})"
    if n == 0:
        return 0, "CuPy finds no CUDA device (device count 0)"
    return n, ""


def device_index(device: str) -> int:
    kind, _, idx = device.partition(":")
    if kind != "cuda" or not idx.isdigit():
        raise BadRequest(f"{device!r} is not a CUDA device name (cuda:N)")
    return int(idx)


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    total: int
    free: int
    pci_bus_id: str
    numa_node: int | None


def device_info(index: int) -> DeviceInfo:
    cupy = _cupy()
    rt = cupy.cuda.runtime
    count, reason = availability()
    if index >= count:
        raise NotFound(f"no device cuda:{index} ({reason or f'{count} CUDA device(s)'})")
    props = rt.getDeviceProperties(index)
    name = props.get("name", b"")
    name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    with cupy.cuda.Device(index):
        free, total = rt.memGetInfo()
    bus = str(rt.deviceGetPCIBusId(index)).lower()
    return DeviceInfo(index, name, int(total), int(free), bus, numa_node_of_pci(bus))


def host_address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


# -- streams and events ------------------------------------------------------------------


class CudaEvent(DeviceEvent):
    """A CuPy event, queried and waited on through the runtime directly.

    ``cudaEventSynchronize`` is called without the GIL (CuPy's runtime
    wrapper releases it), so the waiter thread never stalls the event loops.
    ``cudaEventQuery`` returns ``cudaErrorNotReady`` while pending and another
    non-zero status when the device failed work before the event; a failure
    of either call is a :class:`DeviceFault`, never taken for completion.
    """

    def __init__(self, event: Any, index: int) -> None:
        self.event = event
        self.index = index
        self._cupy = _cupy()

    def done(self) -> bool:
        status = int(self._cupy.cuda.runtime.eventQuery(self.event.ptr))
        if status == CUDA_SUCCESS:
            return True
        if status == CUDA_ERROR_NOT_READY:
            return False
        raise DeviceFault(f"cuda:{self.index}: {_status_text(self._cupy, status)}")

    def synchronize(self) -> None:
        rt = self._cupy.cuda.runtime
        try:
            # The event's own device current (a shared waiter serves several).
            with self._cupy.cuda.Device(self.index):
                rt.eventSynchronize(self.event.ptr)
        except rt.CUDARuntimeError as exc:
            raise DeviceFault(f"cuda:{self.index}: {exc}") from None


def _status_text(cupy: Any, status: int) -> str:
    """A runtime status as CuPy's CUDARuntimeError words it."""
    try:
        return str(cupy.cuda.runtime.CUDARuntimeError(status))
    except Exception:  # pragma: no cover - a status the runtime cannot name
        return f"CUDA error {status}"


class CudaStream(DeviceStream):
    """A CuPy stream of one device; every call with that device current.

    ``CudaStream(index)`` makes a non-blocking stream on device ``index``;
    :meth:`of` wraps a stream the caller made, on the device it was made on.
    """

    def __init__(self, index: int, stream: Any = None) -> None:
        cupy = _cupy()
        self.index = index
        self.name = f"cuda:{index}"
        self._cupy = cupy
        self._rt = cupy.cuda.runtime
        self._device = cupy.cuda.Device(index)
        with self._device:
            self.stream = stream if stream is not None else cupy.cuda.Stream(non_blocking=True)

    @classmethod
    def of(cls, stream: Any) -> CudaStream:
        """A CuPy stream as a DeviceStream, on its own device.

        CuPy records the device a stream was created on (``device_id``); the
        null and per-thread streams have none (-1) and belong to whichever
        device is current, so those take the calling thread's current device:
        call this in the thread that uses the stream.
        """
        index = int(getattr(stream, "device_id", -1))
        if index < 0:
            index = int(_cupy().cuda.runtime.getDevice())
        return cls(index, stream)

    def _fault(self, exc: Exception) -> DeviceFault:
        return DeviceFault(f"{self.name}: {exc}")

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            try:
                with self._device:
                    self._rt.memcpyAsync(dst, src, nbytes, MEMCPY_DEFAULT, self.stream.ptr)
            except self._rt.CUDARuntimeError as exc:  # a sticky error of the context
                raise self._fault(exc) from None

    def copy_d2h(self, host_ptr: int, dev_ptr: int, nbytes: int) -> None:
        self._copy(host_ptr, dev_ptr, nbytes)

    def copy_h2d(self, dev_ptr: int, host_ptr: int, nbytes: int) -> None:
        self._copy(dev_ptr, host_ptr, nbytes)

    def copy_d2d(self, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        self._copy(dst_ptr, src_ptr, nbytes)

    def fill(self, dev_ptr: int, value: int, nbytes: int) -> None:
        if nbytes:
            try:
                with self._device:
                    self._rt.memsetAsync(dev_ptr, value, nbytes, self.stream.ptr)
            except self._rt.CUDARuntimeError as exc:
                raise self._fault(exc) from None

    def record(self) -> CudaEvent:
        try:
            with self._device:
                # block=True: a waiting thread sleeps in the driver instead of spinning.
                ev = self._cupy.cuda.Event(block=True, disable_timing=True)
                ev.record(self.stream)
        except self._rt.CUDARuntimeError as exc:
            raise self._fault(exc) from None
        return CudaEvent(ev, self.index)

    def synchronize(self) -> None:
        with self._device:
            self.stream.synchronize()

    def synchronize_device(self) -> None:
        with self._device:
            self._rt.deviceSynchronize()

    def waiter_init(self) -> None:
        self._device.use()

    def __enter__(self) -> CudaStream:
        # CuPy's own current stream too, for whatever else this thread launches.
        self.stream.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.stream.__exit__(*exc)


# -- pinned staging ----------------------------------------------------------------------


class PinnedHost:
    """``cudaHostAlloc``'d (portable) host memory, freed when this goes."""

    def __init__(self, size: int) -> None:
        rt = _cupy().cuda.runtime
        try:
            self.ptr = int(rt.hostAlloc(size, rt.hostAllocPortable))
        except Exception as exc:
            raise OutOfMemory(f"cannot pin {size} bytes of host staging: {exc}") from None
        self.size = size
        self._rt = rt
        self.view = memoryview((ctypes.c_char * size).from_address(self.ptr)).cast("B")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.view.release()
            self._rt.freeHost(self.ptr)


def pinned_allocator(size: int) -> tuple[memoryview, int, Any]:
    p = PinnedHost(size)
    return p.view, p.ptr, p


# -- memory ------------------------------------------------------------------------------


class CudaMemory(Memory):
    """``cudaMalloc``'d memory of one GPU: no host view; its staging path is its group's."""

    kind = "cuda"

    def __init__(self, device: str, size: int, ptr: int, group: CudaGroup) -> None:
        super().__init__(device, size)
        self.index = device_index(device)
        self.ptr = ptr
        self.group = group
        self._closed = False

    @classmethod
    def create(cls, device: str, size: int) -> CudaMemory:
        # Device memory comes from the group the daemon started for that GPU
        # (its DeviceSpec's source), never from the kind alone.
        raise NotFound(f"{device} memory is made by its device's group: no daemon serves "
                       f"{device} here")

    @property
    def host_view(self) -> memoryview | None:
        return None

    @property
    def staging(self) -> DeviceIO | None:
        return None if self._closed else self.group.io

    @property
    def address(self) -> int:
        return self.ptr if self.size else 0

    def resident(self) -> int:
        return self.size

    def device_address(self, offset: int, size: int) -> int:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise OutOfBounds(f"[{offset}, {offset + size}) is outside {self.size} bytes "
                              f"on {self.device}")
        if self._closed:
            raise NotFound(f"{self.device} memory was freed")
        return self.ptr + offset

    def describe(self) -> dict[str, Any]:
        return {"device_ptr": self.ptr}

    def close(self) -> bool:
        if self._closed:
            return True
        self._closed = True
        # cudaFree waits for the whole device: on the group's worker, not the loop.
        self.group.off_loop(self._free_and_report)
        return True

    def _free_and_report(self) -> None:
        try:
            with self.group.current():
                self._free()
        except Exception:  # a broken device: the memory is gone with it
            log.exception("freeing %d bytes on %s failed", self.size, self.device)
        self._report_gone()

    def _free(self) -> None:
        _cupy().cuda.runtime.free(self.ptr)


class IpcCudaMemory(CudaMemory):
    """A client's own allocation, opened from its CUDA IPC handle.

    The handle names the client's whole allocation; ``offset`` and ``size``
    say which part of it is the buffer, and are checked against the
    allocation's real extent here before anything is touched.
    """

    def __init__(self, device: str, size: int, ptr: int, base: int, group: CudaGroup) -> None:
        super().__init__(device, size, ptr, group)
        self.base = base

    def describe(self) -> dict[str, Any]:
        return {"ipc": True}

    def _free(self) -> None:
        _cupy().cuda.runtime.ipcCloseMemHandle(self.base)


# -- one group per GPU ---------------------------------------------------------------------


@dataclass(eq=False)
class CudaGroup(MemorySource):
    """What one GPU gets in the daemon; the daemon's :class:`CudaDevices` owns it."""

    info: DeviceInfo
    cpu: int | None
    stream: CudaStream
    waiter: EventWaiter
    pool: StagingPool
    io: DeviceIO
    worker: Any = field(repr=False, default=None)

    @property
    def device(self) -> str:
        return f"cuda:{self.info.index}"

    @property
    def name(self) -> str:
        return self.device

    def current(self) -> Any:
        """A context manager: this GPU current in the calling thread."""
        return _cupy().cuda.Device(self.info.index)

    def off_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the group's worker (it has the GPU's context), else here."""
        worker = self.worker
        if worker is not None and worker.loop is not None and not worker.loop.is_closed():
            try:
                worker.call(fn)
                return
            except RuntimeError:  # the worker's loop stopped meanwhile (the daemon's exit)
                pass
        fn()

    def create(self, size: int) -> CudaMemory:
        rt = _cupy().cuda.runtime
        with self.current():
            try:
                ptr = int(rt.malloc(max(size, 1)))
            except Exception as exc:
                if getattr(exc, "status", None) == CUDA_ERROR_MEMORY_ALLOCATION:
                    raise OutOfMemory(f"cannot allocate {size} bytes on {self.device}") from None
                raise OutOfMemory(f"cannot allocate {size} bytes on {self.device}: {exc}") \
                    from None
        # Zero filled on the group's stream, not waited for here: every access
        # the daemon makes to this memory (SET, GET, COPY, CLEAR, engine
        # writes) is enqueued on that stream after the fill, so none sees the
        # bytes before it; the loop never waits for the device.
        try:
            self.stream.fill(ptr, 0, max(size, 1))
        except Exception:
            with contextlib.suppress(Exception), self.current():
                rt.free(ptr)
            raise
        return CudaMemory(self.device, size, ptr, self)

    def open_ipc(self, handle: bytes, offset: int, size: int) -> IpcCudaMemory:
        if len(handle) != IPC_HANDLE_BYTES:
            raise BadRequest(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
        rt = _cupy().cuda.runtime
        with self.current():
            try:
                base = int(rt.ipcOpenMemHandle(bytes(handle), rt.cudaIpcMemLazyEnablePeerAccess))
            except Exception as exc:
                raise BadRequest(f"cannot open the CUDA IPC handle on {self.device}: {exc}") \
                    from None
            try:
                # The opened mapping is the client's whole allocation: the
                # buffer must lie inside it, and its extent must be known.
                ipc_span(base + offset, size, address_range(base))
            except Exception:
                with contextlib.suppress(Exception):
                    rt.ipcCloseMemHandle(base)
                raise
        return IpcCudaMemory(self.device, size, base + offset, base, self)

    def describe(self) -> dict[str, Any]:
        return {"name": self.device, "gpu": self.info.name, "pci_bus_id": self.info.pci_bus_id,
                "numa_node": self.info.numa_node, "cpu": self.cpu,
                "staging": self.pool.capacity * self.pool.chunk_size}

    def stop(self) -> None:
        self.waiter.close()
        self.pool.close()
        if self.worker is not None:
            self.worker.stop()


def start_group(index: int, *, chunk: int = DEFAULT_CHUNK, chunks: int = DEFAULT_CHUNKS,
                pin: bool = True, taken: Counter[int] | None = None) -> CudaGroup:
    """Bring up cuda:``index``: pinned worker, context current, stream, staging.

    ``taken``: cores already given to other groups (the least used is chosen).
    """
    from transferd.workers import ThreadWorker

    info = device_info(index)
    cpu = None
    if pin:
        taken = taken if taken is not None else Counter()
        node_cpus = cpus_of_node(info.numa_node) if info.numa_node is not None else set()
        cpu = choose_cpu(node_cpus, allowed_cpus(), taken)
        if cpu is not None:
            taken[cpu] += 1
    worker = ThreadWorker(f"transferd-cuda{index}", cpu)
    worker.start()
    cupy = _cupy()

    def init() -> tuple[CudaStream, StagingPool]:
        # On the pinned worker: the context is made current here, and the
        # staging pages are first touched here, so they come from its node.
        cupy.cuda.Device(index).use()
        return CudaStream(index), StagingPool(chunk, chunks, pinned_allocator,
                                              name=f"staging of cuda:{index}")

    try:
        stream, pool = worker.run_sync(init, timeout=60)
    except BaseException:
        worker.stop()
        raise
    waiter = EventWaiter(stream, name=f"transferd-cuda{index}-events")
    group = CudaGroup(info, cpu, stream, waiter, pool, DeviceIO(stream, waiter, pool, worker),
                      worker)
    log.info("cuda:%d %s (%s, NUMA node %s): worker on cpu %s, %d MiB of pinned staging",
             index, info.name, info.pci_bus_id, info.numa_node, cpu, (chunk * chunks) >> 20)
    return group


class CudaDevices:
    """The GPUs one daemon serves: a group each, started together, stopped with the daemon."""

    def __init__(self) -> None:
        self.groups: dict[int, CudaGroup] = {}
        self.specs: list[DeviceSpec] = []
        self._taken: Counter[int] = Counter()

    @classmethod
    def start(cls, devices: list[str], *, memory_limit_mib: int = 0, staging_mib: int = 32,
              staging_chunk_kib: int = 4096, pin: bool = True) -> CudaDevices:
        """A group per device named, and the DeviceSpecs the buffer table serves them by.

        NotFound (naming the device and why) when CuPy finds no such device.
        """
        count, reason = availability()
        if not count:
            raise NotFound(f"{', '.join(devices)}: {reason}")
        chunk = staging_chunk_kib << 10
        chunks = max(1, (staging_mib << 20) // chunk)
        self = cls()
        try:
            for name in devices:
                index = device_index(name)
                if index >= count:
                    raise NotFound(f"no device {name}: CuPy finds {count} CUDA device(s)")
                group = self.groups.get(index)
                if group is None:
                    group = self.groups[index] = start_group(index, chunk=chunk, chunks=chunks,
                                                             pin=pin, taken=self._taken)
                limit = (memory_limit_mib << 20) or int(group.info.free * 0.9)
                self.specs.append(DeviceSpec(name, limit, None, ALIGNMENT, group))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        groups, self.groups = list(self.groups.values()), {}
        for g in groups:
            g.stop()
