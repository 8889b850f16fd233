"""Buffers the daemon hands out to clients, and the table that owns them.

A :class:`Buffer` is an id, a device and a :class:`Memory`.  Every access goes
through :meth:`Buffer.view`, which checks ``offset + size`` against the
buffer before any memory is touched.

Accounting follows what is really held.  A buffer is charged
:func:`~.base.charge_of` its size (whole pages plus one page of bookkeeping)
against its device's limit from ALLOC_BUFFER until its memory is really
returned: FREE_BUFFER takes it out of the table at once (no new access finds
it), but the memory, and the charge, stay while a :class:`Ref` is held (a
reply in flight, a queued outbound part, an accepted inbound write) and while
any untracked view of it is alive.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from transferd.copies import COUNTING, count
from transferd.protocol.errors import BadRequest, NotFound, OutOfBounds, OutOfMemory
from transferd.protocol.messages import Tensor

from . import registry
from .base import PAGE, Memory, MemorySource, Ref, charge_of, largest_for

if TYPE_CHECKING:
    from .staging import DeviceIO

# Buffers held at once unless told otherwise (memory.max_buffers): each is a
# mapping, and vm.max_map_count (65530 by default) caps a process's mappings.
MAX_BUFFERS = 32768


@dataclass(eq=False)
class Buffer:
    id: int
    device: str
    size: int
    memory: Memory | None = field(repr=False, default=None)
    # Who owns it: None, the daemon (until FREE_BUFFER); a session (freed when
    # that connection closes); a Lease (freed when it ends or expires).
    owner: Hashable | None = field(repr=False, default=None)
    # The client connection that allocated it, as host:port (listings only).
    allocated_by: str = field(repr=False, default="")
    _view: memoryview | None = field(repr=False, default=None)
    # The memory's staging path (device memory, no host view), else None:
    # whoever moves bytes asks this, once per buffer, which way they go.
    staging: DeviceIO | None = field(repr=False, default=None)
    _refs: int = field(repr=False, default=0)
    # What it costs its device's limit until its memory is returned (BufferTable.alloc).
    charge: int = field(repr=False, default=0)
    _freed: bool = field(repr=False, default=False)
    _lock: threading.Lock = field(repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.memory is not None and self._view is None:
            self._view = self.memory.host_view
            self.staging = self.memory.staging

    @classmethod
    def host(cls, buffer_id: int, size: int) -> Buffer:
        """A host buffer outside any table (tests, tools): ``release()`` frees it."""
        return cls(buffer_id, "cpu", size, registry.create("cpu", size))

    @property
    def address(self) -> int:
        """The buffer's address (what an MrDesc's ``ptr`` names)."""
        if self.memory is None:
            raise NotFound(f"buffer {self.id} was freed")
        return self.memory.address

    @property
    def freed(self) -> bool:
        return self._freed

    # -- holding the memory -----------------------------------------------------------

    def ref(self) -> Ref:
        """Keep this buffer's memory (and its charge) until the Ref is released."""
        with self._lock:
            if self._freed:
                raise NotFound(f"buffer {self.id} was freed")
            self._refs += 1
        return Ref(self._unref)

    def refs(self) -> int:
        return self._refs

    def _unref(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._freed and self._refs == 0
        if last:
            self._return()

    def free(self) -> None:
        """No new access from now on; the memory goes once the last Ref does."""
        with self._lock:
            if self._freed:
                return
            self._freed = True
            self._view = None
            last = self._refs == 0
        if last:
            self._return()

    release = free  # the older name, kept for callers outside the table

    def _return(self) -> None:
        mem, self.memory = self.memory, None
        if mem is not None:
            mem.close()

    # -- access -------------------------------------------------------------------------

    def check(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise OutOfBounds(
                f"[{offset}, {offset + size}) is outside buffer {self.id} of {self.size} bytes"
            )

    def _host(self) -> memoryview:
        view = self._view
        if view is None:
            if self._freed or self.memory is None:
                raise NotFound(f"buffer {self.id} was freed")
            raise BadRequest(f"buffer {self.id} on {self.device} has no host view")
        return view

    def view(self, offset: int, size: int) -> memoryview:
        if offset < 0 or size < 0 or offset + size > self.size:
            self.check(offset, size)  # raises OutOfBounds (inlined test: once per tensor)
        view = self._view
        if view is None:
            view = self._host()
        return view[offset : offset + size]

    def device_address(self, offset: int, size: int) -> int:
        """The device address of ``[offset, offset + size)`` of a buffer reached through
        staging (bounds checked; NotFound once freed)."""
        if offset < 0 or size < 0 or offset + size > self.size:
            self.check(offset, size)
        mem = self.memory
        if self._freed or mem is None:
            raise NotFound(f"buffer {self.id} was freed")
        return mem.device_address(offset, size)

    def views(self, offsets: Sequence[int], size: int) -> list[memoryview]:
        """``size`` bytes at each of ``offsets``: one bounds check for the whole list."""
        if not offsets:
            return []
        self.check(min(offsets), size)
        self.check(max(offsets), size)
        view = self._host()
        return [view[o : o + size] for o in offsets]

    def array(self, offset: int, size: int) -> np.ndarray:
        return np.frombuffer(self.view(offset, size), dtype=np.uint8)

    def clear(self, value: int) -> None:
        if not 0 <= value <= 255:
            raise BadRequest(f"clear value {value} is not a byte (0-255)")
        if self.size:
            self.array(0, self.size).fill(value)


@dataclass(frozen=True)
class DeviceSpec:
    """A device the table serves and its limits (bytes of charge)."""

    name: str
    limit: int
    max_size: int | None = None
    # What GET_DEVICES reports as alignment (cudaMalloc's 256 for a GPU).
    alignment: int = PAGE
    # The daemon's object that makes this device's memory (a GPU's group);
    # None: the device kind's Memory class makes it (host, shared memory).
    source: MemorySource | None = None


@dataclass(eq=False)
class DevicePool:
    spec: DeviceSpec
    used: int = 0
    buffers: int = 0
    # Charge of buffers already freed whose memory is still held.
    lingering: int = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def limit(self) -> int:
        return self.spec.limit

    @property
    def free(self) -> int:
        return self.spec.limit - self.used

    @property
    def max_size(self) -> int:
        fit = largest_for(self.spec.limit)
        cap = self.spec.max_size
        return fit if cap is None else min(cap, fit)

    def info(self) -> dict[str, Any]:
        """This device in GET_DEVICES."""
        return {
            "name": self.name,
            "total": self.limit,
            "free": self.free,
            "alignment": self.spec.alignment,
            "max_size": self.max_size,
            "page": PAGE,
            "per_buffer": charge_of(0) - PAGE,
        }


class BufferTable:
    """All buffers of one daemon, shared by its connections, under per-device limits."""

    def __init__(self, devices: Sequence[DeviceSpec] | int, max_size: int | None = None,
                 *, max_buffers: int = MAX_BUFFERS) -> None:
        if isinstance(devices, int):  # one host device of this limit
            devices = [DeviceSpec("cpu", devices, max_size)]
        self.devices: dict[str, DevicePool] = {d.name: DevicePool(d) for d in devices}
        # Every buffer is a mapping; the kernel caps a process's mappings.
        self.max_buffers = max_buffers
        self._held = 0
        self._buffers: dict[int, Buffer] = {}
        # Buffers by owner (a connection, a lease): what goes when the owner does.
        self._owned: dict[Hashable, dict[int, Buffer]] = {}
        self._ids = itertools.count(1)
        # Engine workers run in their own threads and look buffers up too;
        # memory is returned from whichever thread let go of it last.
        self._lock = threading.Lock()
        # Memory really returned, not yet taken off its device's count.  The
        # news may come from a finalizer, at any moment of any thread (even
        # inside one of our critical sections): it only appends here, and
        # every reader settles the count first.
        self._returned: deque[tuple[DevicePool, int]] = deque()

    def _settle(self) -> None:
        while self._returned:
            try:
                pool, charge = self._returned.popleft()
            except IndexError:
                return
            with self._lock:
                pool.used -= charge
                pool.buffers -= 1
                pool.lingering -= charge
                self._held -= 1

    # -- what is held ---------------------------------------------------------------

    def pool(self, device: str) -> DevicePool:
        self._settle()
        pool = self.devices.get(device)
        if pool is None:
            have = ", ".join(self.devices)
            raise NotFound(f"no device {device!r} on this daemon (have: {have})")
        return pool

    def set_limit(self, device: str, limit: int, max_size: int | None = None) -> None:
        """A new limit (a reload): buffers already held keep their memory."""
        pool = self.pool(device)
        pool.spec = DeviceSpec(device, limit, max_size, pool.spec.alignment, pool.spec.source)

    def used_on(self, device: str) -> int:
        return self.pool(device).used

    def lingering_on(self, device: str) -> int:
        return self.pool(device).lingering

    @property
    def held(self) -> int:
        """Buffers whose memory is held now (freed ones still referenced included)."""
        self._settle()
        return self._held

    @property
    def used(self) -> int:
        """Charge held on every device."""
        self._settle()
        return sum(p.used for p in self.devices.values())

    def device_info(self) -> list[dict[str, Any]]:
        self._settle()
        return [p.info() for p in self.devices.values()]

    # -- alloc and free ---------------------------------------------------------------

    def alloc(self, device: str, size: int, owner: Hashable | None = None,
              create: Callable[[], Memory] | None = None, *,
              charge: int | None = None) -> Buffer:
        """A new buffer; ``create`` makes its Memory instead of the device's kind
        (memory a client registers, such as a CUDA IPC handle it exported).
        ``charge``: what it costs the device's limit, when not what the memory of a
        buffer of ``size`` costs (memory the caller owns: only its bookkeeping)."""
        pool = self.pool(device)
        if charge is None:
            if size > pool.max_size:
                raise OutOfMemory(
                    f"{size} bytes is over the largest buffer of {pool.max_size} on {device}"
                )
            charge = charge_of(size)
        self._settle()
        with self._lock:
            if self._held >= self.max_buffers:
                raise OutOfMemory(f"{self._held} buffers held: the most this daemon holds at "
                                  "once (memory.max_buffers)")
            if charge > pool.free:
                raise OutOfMemory(
                    f"{size} bytes (charged {charge}) requested, {pool.free} of "
                    f"{pool.limit} free on {device}"
                )
            pool.used += charge
            pool.buffers += 1
            self._held += 1
            buffer_id = next(self._ids)
        try:
            if create is not None:
                memory = create()
            elif pool.spec.source is not None:
                memory = pool.spec.source.create(size)
            else:
                memory = registry.create(device, size)
        except BaseException:
            with self._lock:
                pool.used -= charge
                pool.buffers -= 1
                self._held -= 1
            raise
        buf = Buffer(buffer_id, device, size, memory, owner)
        buf.charge = charge
        memory.on_gone(lambda: self._returned.append((pool, charge)))
        with self._lock:
            self._buffers[buffer_id] = buf
            if owner is not None:
                self._owned.setdefault(owner, {})[buffer_id] = buf
        return buf

    def charge(self, device: str, nbytes: int, what: str) -> Callable[[], None]:
        """Charge ``nbytes`` held outside any buffer (``what``: for the message) to
        ``device``'s limit, as a buffer's memory is: OutOfMemory when it does not fit.
        The returned release gives it back (idempotent; on the daemon's loop)."""
        pool = self.pool(device)
        with self._lock:
            if nbytes > pool.free:
                raise OutOfMemory(f"{what}: {nbytes} bytes, {pool.free} of {pool.limit} "
                                  f"free on {device}")
            pool.used += nbytes
        left = [nbytes]

        def release() -> None:
            n, left[0] = left[0], 0
            if n:
                with self._lock:
                    pool.used -= n

        return release

    def get(self, buffer_id: int) -> Buffer:
        try:
            return self._buffers[buffer_id]
        except KeyError:
            raise NotFound(f"no buffer {buffer_id}") from None

    def free_buffer(self, buffer_id: int) -> Buffer:
        """Out of the table now; its memory and charge go when nothing holds it."""
        with self._lock:
            buf = self._buffers.pop(buffer_id, None)
            if buf is None:
                raise NotFound(f"no buffer {buffer_id}")
            if buf.owner is not None:
                mine = self._owned.get(buf.owner)
                if mine is not None:
                    mine.pop(buffer_id, None)
                    if not mine:
                        del self._owned[buf.owner]
            self.devices[buf.device].lingering += buf.charge
        buf.free()
        return buf

    def snapshot(self, limit: int) -> list[Buffer]:
        """Up to ``limit`` buffers held now, by id (for listings: transferd buffers)."""
        with self._lock:
            return sorted(self._buffers.values(), key=lambda b: b.id)[:limit]

    def owned_by(self, owner: Hashable) -> list[Buffer]:
        """The buffers ``owner`` holds now (no scan of the table)."""
        with self._lock:
            return list(self._owned.get(owner, {}).values())

    def tensor_view(self, t: Tensor) -> memoryview:
        return self.get(t.buffer).view(t.offset, t.size)

    def copy(self, src: Tensor, dst: Tensor) -> None:
        if src.size != dst.size:
            raise BadRequest(f"copy of {src.size} bytes into a tensor of {dst.size}")
        s = self.get(src.buffer).array(src.offset, src.size)
        d = self.get(dst.buffer).array(dst.offset, dst.size)
        if COUNTING:
            count("copy_tensor", src.size)
        np.copyto(d, s)  # handles overlapping ranges in one buffer

    def close(self) -> None:
        with self._lock:
            buffers = list(self._buffers.values())
            self._buffers.clear()
            self._owned.clear()
        for buf in buffers:
            with self._lock:
                self.devices[buf.device].lingering += buf.charge
            buf.free()

    def __len__(self) -> int:
        return len(self._buffers)
