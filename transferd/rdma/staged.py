"""The staging pools registered with one NIC, while device memory that uses them is.

A write from device (GPU) memory goes through its group's staging (pinned host chunks:
the engine copies the source into them, then the parts are planned on those copies), so
on a verbs rail the NIC reads the chunks, and the sender needs their lkey.  Each NIC of
the group registers every chunk of a pool when the first region of device memory that
stages through it is registered there, and deregisters them when the last such region
goes.  Local access only: nobody is handed an rkey of staging.  Pure (the registering is
injected), so it is tested without a device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .mrtable import Registration


class Chunk(Protocol):
    @property
    def ptr(self) -> int: ...

    @property
    def size(self) -> int: ...


class Pool(Protocol):
    """What is read of a staging pool (transferd.memory.staging.StagingPool)."""

    @property
    def chunks(self) -> Iterable[Chunk]: ...


@dataclass
class _Held:
    pool: Any  # kept: its id() names it while held
    users: int = 0
    regs: list[Registration] = field(default_factory=list)


class StagingRegistrations:
    def __init__(self, register: Callable[[int, int], Registration],
                 deregister: Callable[[Registration], None]) -> None:
        self._register = register
        self._deregister = deregister
        self._held: dict[int, _Held] = {}

    def hold(self, pool: Pool) -> None:
        """One more region stages through ``pool``: its chunks registered (the first
        time; all or none)."""
        held = self._held.get(id(pool))
        if held is None:
            held = _Held(pool)
            try:
                for chunk in pool.chunks:
                    held.regs.append(self._register(chunk.ptr, chunk.size))
            except BaseException:
                for reg in held.regs:
                    self._deregister(reg)
                raise
            self._held[id(pool)] = held
        held.users += 1

    def let_go(self, pool: Pool) -> None:
        held = self._held.get(id(pool))
        if held is None:
            return
        held.users -= 1
        if held.users <= 0:
            del self._held[id(pool)]
            failed: Exception | None = None
            for reg in held.regs:  # every one, even after one failed
                try:
                    self._deregister(reg)
                except Exception as exc:
                    failed = failed or exc
            if failed is not None:
                raise failed

    def registered(self, pool: Pool) -> bool:
        return id(pool) in self._held

    def covers(self, addr: int) -> bool:
        """Whether ``addr`` lies in a staging chunk registered here."""
        return any(r.addr <= addr < r.addr + r.length
                   for held in self._held.values() for r in held.regs)

    def __len__(self) -> int:
        return len(self._held)
