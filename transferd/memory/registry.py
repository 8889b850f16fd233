"""Device kinds: which Memory class serves a device name.

A device name is ``kind`` or ``kind:index`` ("cpu", "shm", "cuda:0").  A new
kind of memory is a new module with a Memory subclass and one line here (or a
call to :func:`register_kind` from that module); nothing else names kinds.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from transferd.protocol.errors import NotFound

from .base import Memory

MemoryFactory = Callable[[str, int], Memory]

# kind -> "module:Class" (imported on first use, so a kind whose library is
# missing here, CuPy for "cuda", costs nothing until a device of it is served).
KINDS: dict[str, str] = {
    "cpu": "transferd.memory.host:HostMemory",
    "shm": "transferd.memory.shared:SharedMemory",
    "cuda": "transferd.memory.cuda:CudaMemory",
}
_loaded: dict[str, type[Memory]] = {}


def register_kind(kind: str, cls: type[Memory] | str) -> None:
    """Serve devices of ``kind`` from ``cls`` (a Memory subclass or "module:Class")."""
    if isinstance(cls, str):
        KINDS[kind] = cls
        _loaded.pop(kind, None)
    else:
        KINDS[kind] = f"{cls.__module__}:{cls.__qualname__}"
        _loaded[kind] = cls


def unregister_kind(kind: str) -> None:
    KINDS.pop(kind, None)
    _loaded.pop(kind, None)


def kind_of(device: str) -> str:
    return device.split(":", 1)[0]


def memory_class(device: str) -> type[Memory]:
    kind = kind_of(device)
    cls = _loaded.get(kind)
    if cls is None:
        target = KINDS.get(kind)
        if target is None:
            raise NotFound(f"no device kind {kind!r} (known: {', '.join(sorted(KINDS))})")
        module, _, name = target.partition(":")
        cls = getattr(importlib.import_module(module), name)
        assert isinstance(cls, type) and issubclass(cls, Memory)
        _loaded[kind] = cls
    return cls


def create(device: str, size: int) -> Memory:
    """A new zero-filled allocation of ``size`` bytes on ``device``."""
    return memory_class(device).create(device, size)
