"""The Memory seam: where a buffer's bytes live, and what may still reference them.

A :class:`Memory` is one allocation on one device: host pages (``"cpu"``), a
memfd shared with a local client (``"shm"``), device memory (``"cuda:N"``).
It knows its size, its address, the pages it really holds, how to give them
back, and how its bytes are read and written: exactly one of

- :attr:`Memory.host_view`: a host view over its bytes (sockets read into it
  and send from it), or
- :attr:`Memory.staging`: its staging path (a :class:`~.staging.DeviceIO`: the
  device's stream, event waiter and pinned staging pool) with
  :meth:`Memory.device_address` for the device address of a range.

Whoever moves bytes (the handlers, the engine, a Domain) asks which one a
Memory has; nothing finds out by trying the host view and catching an error.
Memory a daemon-owned device makes (a GPU's group) comes from that device's
:class:`MemorySource`, which the daemon starts and stops; no device state
lives in module globals.

A :class:`Ref` keeps a Memory alive: whoever may still touch the bytes after
the call that produced the view has returned (a reply waiting in a
transport, a queued outbound part, an accepted inbound write) holds one and
releases it when done.  ``release()`` is idempotent and thread safe.
docs/memory.md has the rules.
"""

from __future__ import annotations

import mmap
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from transferd.protocol.errors import BadRequest

if TYPE_CHECKING:
    from .staging import DeviceIO

PAGE = mmap.PAGESIZE
# What one buffer costs beyond its pages: the mapping's kernel structures and
# page-table entries, and the Python objects that describe it (Buffer, Memory,
# views, its table entry: about 1.5 KiB measured).  Charged on top of the
# pages so that many tiny buffers cost what they really hold.
BOOKKEEPING = PAGE


def pages(size: int) -> int:
    """``size`` rounded up to whole pages, at least one (mmap never maps 0)."""
    return max(PAGE, -(-size // PAGE) * PAGE)


def charge_of(size: int) -> int:
    """What a buffer of ``size`` bytes is charged against its device's limit."""
    return pages(size) + BOOKKEEPING


def largest_for(charge: int) -> int:
    """The largest buffer whose charge fits in ``charge`` bytes (0 if none does)."""
    return max(0, (charge - BOOKKEEPING) // PAGE * PAGE)


class Ref:
    """One hold on a buffer's memory; :meth:`release` lets go (once, from any thread).

    The release action sits in a one-element list: ``list.pop`` is atomic,
    so two threads releasing the same Ref run the action exactly once,
    without a lock per Ref.
    """

    __slots__ = ("_action",)

    def __init__(self, action: Callable[[], None]) -> None:
        self._action = [action]

    def release(self) -> None:
        try:
            action = self._action.pop()
        except IndexError:
            return
        action()

    @property
    def released(self) -> bool:
        return not self._action

    def __enter__(self) -> Ref:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def release_all(refs: Iterable[Ref]) -> None:
    for r in refs:
        r.release()


class Memory(ABC):
    """One allocation on one device.  Subclasses register under a device kind.

    The contract (docs/memory.md): ``size`` bytes, zero filled; exactly one
    of ``host_view`` (covering exactly ``size`` bytes) and ``staging`` is not
    None while the memory is open; ``close()`` returns the memory
    at once if nothing outside still maps it, and in any case calls the
    ``gone`` callback exactly once, when the memory really is returned (which
    may be later, when the last untracked view of it is dropped).
    """

    # Device kind this class serves ("cpu", "shm", "cuda"); set by subclasses.
    kind: ClassVar[str] = ""
    # Whether a buffer of this kind can only be handed to a client over a
    # socket that passes file descriptors (shared memory).
    needs_fd_passing: ClassVar[bool] = False

    def __init__(self, device: str, size: int) -> None:
        self.device = device
        self.size = size
        self._gone: Callable[[], None] | None = None

    # -- what every Memory provides ------------------------------------------------

    @classmethod
    @abstractmethod
    def create(cls, device: str, size: int) -> Memory:
        """A new zero-filled allocation; OutOfMemory (typed) when it cannot be had."""

    @property
    @abstractmethod
    def host_view(self) -> memoryview | None:
        """The whole allocation as host bytes; None where there is no host mapping."""

    @property
    @abstractmethod
    def address(self) -> int:
        """The allocation's address (what an MrDesc's ``ptr`` names); 0 when empty."""

    @abstractmethod
    def close(self) -> bool:
        """Give the memory back; False if an untracked view delays that."""

    def resident(self) -> int:
        """Bytes of pages this allocation really holds (what it is charged for)."""
        return pages(self.size)

    def fd(self) -> int | None:
        """A file descriptor another process can map (shared memory), or None."""
        return None

    def handed_over(self) -> None:
        """The descriptor from :meth:`fd` was sent to the client: drop ours if we can."""
        return None  # nothing to drop for memory without a descriptor

    def describe(self) -> dict[str, Any]:
        """What ALLOC_BUFFER tells the client about this memory, beyond id and size."""
        return {}

    # -- how the bytes are reached: a host view, or a staging path ------------------------

    @property
    def staging(self) -> DeviceIO | None:
        """The staging path of memory with no host view (device memory), else None.

        Its stream takes the async copies to and from pinned staging chunks of
        its pool, and its event waiter says when they completed; the pipeline
        functions of :mod:`transferd.memory.staging` move bytes through it.
        None: the bytes are read and written through :attr:`host_view`.
        """
        return None

    def device_address(self, offset: int, size: int) -> int:
        """The device address of ``[offset, offset + size)``, bounds checked.

        Only memory with a staging path has one; host memory is reached
        through its host view.
        """
        raise BadRequest(f"{self.device} memory is reached through its host view, "
                         "not by device address")

    # -- when the memory is really gone --------------------------------------------

    def on_gone(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once, when the memory is really returned."""
        self._gone = fn

    def _track(self, obj: object) -> weakref.finalize[Any, Any]:
        """Report gone when ``obj`` (the mapping every view refers to) dies."""
        return weakref.finalize(obj, self._report_gone)

    def _report_gone(self) -> None:
        fn, self._gone = self._gone, None
        if fn is not None:
            fn()


class MemorySource(ABC):
    """A device the daemon started and owns (a GPU's group): where its memory comes from.

    The daemon makes one per device it serves at start and stops it at exit;
    the buffer table creates that device's buffers through it (its
    :class:`~.buffers.DeviceSpec` carries it), so a device's stream, staging
    and worker belong to the daemon's objects, not to module globals.
    """

    @property
    @abstractmethod
    def name(self) -> str:
        """The device's name (``cuda:0``)."""

    @abstractmethod
    def create(self, size: int) -> Memory:
        """A new zero-filled allocation of ``size`` bytes on this device (OutOfMemory)."""

    def open_ipc(self, handle: bytes, offset: int, size: int) -> Memory:
        """A client's own allocation, from its CUDA IPC handle (a GPU only)."""
        raise BadRequest(f"{self.name} does not take client memory by CUDA IPC handle")
