"""Counting on verbs: one immediate per unit, posted only once its bytes are in place.

The receiver of a one-sided write learns of it from its completion queue alone: a
WRITE_WITH_IMM consumes a receive and produces one completion with the immediate, a
plain WRITE produces nothing.  So the receiver adds 1 to an immediate's counter per
WRITE_WITH_IMM completion, and the initiator decides which work request carries the
immediate and when it is posted:

* A *unit* is what adds exactly 1 at the receiver: one page of a paged write, a whole
  single write (however many rails and work requests carry it), one destination of a
  scatter, one peer of a barrier.
* Every work request of a unit but one is a plain RDMA WRITE.  The last, the
  *carrier*, is a WRITE_WITH_IMM, and it is posted only after every other work request
  of the unit completed successfully at the initiator.  On RC an initiator's write
  completion means the responder acknowledged the data, placed in its memory; so when
  the carrier lands, every byte it stands for already has.  Nothing here relies on the
  order between queue pairs or NICs (the article's "reliable but unordered").
* If any work request of the unit fails, the carrier is never posted: the receiver's
  counter does not move, and the initiator's transfer fails.
* A zero-length unit (a barrier) is its carrier alone, with a valid descriptor: a
  registered local address (length 0) and the destination region's address and rkey
  (the article's EFA note: valid descriptors even for zero-length writes).

:class:`CarrierGate` holds carriers until their unit is ready.  It is shared by the
Domains (rails) of one group, since a split single write has parts on every rail.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from transferd.protocol.errors import BadRequest, TransferdError

T = TypeVar("T")

# Units open at once (each holds work requests in flight, so this is far above what
# the send queues allow; it bounds the table if something is never completed).
MAX_OPEN_UNITS = 1 << 20


@dataclass(slots=True)
class _Unit(Generic[T]):
    parts_left: int
    plain_left: int = 0
    carrier: T | None = None
    error: TransferdError | None = None


class CarrierGate(Generic[T]):
    """Releases a unit's carrier once all parts of the unit were added and every plain
    work request of the unit completed; drops it if one of them failed."""

    def __init__(self, release: Callable[[T], None],
                 drop: Callable[[T, TransferdError], None],
                 limit: int = MAX_OPEN_UNITS) -> None:
        self._release = release
        self._drop = drop
        self._limit = limit
        self._units: dict[Hashable, _Unit[T]] = {}

    def add(self, key: Hashable, parts: int, plain: int, carrier: T | None) -> None:
        """One part of unit ``key`` (of ``parts`` parts) with ``plain`` work requests
        posted or queued, and the carrier if this part holds it."""
        unit = self._units.get(key)
        if unit is None:
            if len(self._units) >= self._limit:
                raise BadRequest(f"more than {self._limit} writes waiting to be counted")
            unit = self._units[key] = _Unit(parts)
        unit.parts_left -= 1
        unit.plain_left += plain
        if carrier is not None:
            if unit.carrier is not None:
                raise ValueError(f"unit {key!r} has two carriers")
            unit.carrier = carrier
        self._check(key, unit)

    def done(self, key: Hashable, error: TransferdError | None = None) -> None:
        """One plain work request of unit ``key`` completed (or failed)."""
        unit = self._units.get(key)
        if unit is None:
            return
        unit.plain_left -= 1
        if error is not None and unit.error is None:
            unit.error = error
        self._check(key, unit)

    def _check(self, key: Hashable, unit: _Unit[T]) -> None:
        if unit.parts_left > 0 or unit.plain_left > 0:
            return
        del self._units[key]
        if unit.carrier is None:
            return
        if unit.error is not None:
            self._drop(unit.carrier, unit.error)
        else:
            self._release(unit.carrier)

    def fail_all(self, error: TransferdError) -> None:
        """The group is closing: every held carrier is dropped."""
        units, self._units = self._units, {}
        for unit in units.values():
            if unit.carrier is not None:
                self._drop(unit.carrier, unit.error or error)

    def __len__(self) -> int:
        return len(self._units)
