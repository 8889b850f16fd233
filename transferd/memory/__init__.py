"""Memory the daemon owns: the Memory seam, its device kinds, and the buffer table.

``Memory`` (base.py) is one allocation on one device, read and written
through its host view or its staging path; ``registry`` finds the Memory
class of a device kind ("cpu": host.py, "shm": shared.py, "cuda": cuda.py,
whose memory its GPU's group, a ``MemorySource``, makes); ``Buffer`` /
``BufferTable`` (buffers.py) hand memory to clients and count it by what is
really held; ``Ref`` is a hold on a buffer's memory.
docs/memory.md describes the seam and the rules.
"""

from .base import (
    BOOKKEEPING,
    PAGE,
    Memory,
    MemorySource,
    Ref,
    charge_of,
    largest_for,
    pages,
    release_all,
)
from .buffers import Buffer, BufferTable, DevicePool, DeviceSpec
from .registry import KINDS, kind_of, memory_class, register_kind

__all__ = [
    "BOOKKEEPING",
    "KINDS",
    "PAGE",
    "Buffer",
    "BufferTable",
    "DevicePool",
    "DeviceSpec",
    "Memory",
    "MemorySource",
    "Ref",
    "charge_of",
    "kind_of",
    "largest_for",
    "memory_class",
    "pages",
    "register_kind",
    "release_all",
]
