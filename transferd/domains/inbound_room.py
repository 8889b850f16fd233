"""Room for a newcomer at the link budget's cap: the proved inbound links, by source.

An inbound link that finished its handshake holds a descriptor of the group's link
budget (:class:`~transferd.fds.LinkBudget`) for as long as its peer keeps it open,
and without a cluster secret any local process is a peer under its own addresses'
id.  So one process that proves itself over and over, and keeps every link (silent,
or stalled in a payload), held the whole budget, and every real peer's link was then
closed at accept.  At the cap a newcomer now takes the place of the oldest link of
the source holding the most (a real peer holds one per rail it dials; the hoarder,
the rest): closing it fails what it had in flight, which its sender sends again
(``failover``), as for any link that breaks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from transferd.fds import LinkBudget


class Held(Protocol):
    """A proved inbound link (told to go when a newcomer takes its place)."""

    def give_room(self) -> None: ...


class InboundRoom:
    """Every rail's proved inbound links of one domain group, by source address."""

    def __init__(self, budget: LinkBudget) -> None:
        self.budget = budget
        self._by_source: dict[str, OrderedDict[Held, None]] = {}
        self._source: dict[Held, str] = {}
        self.given = 0  # links closed to make room (metrics, logs)

    def __len__(self) -> int:
        return len(self._source)

    def add(self, source: str, link: Held) -> None:
        if link in self._source:
            return
        self._source[link] = source
        self._by_source.setdefault(source, OrderedDict())[link] = None

    def discard(self, link: Held) -> None:
        source = self._source.pop(link, None)
        if source is None:
            return
        links = self._by_source[source]
        links.pop(link, None)
        if not links:
            del self._by_source[source]

    def take(self) -> bool:
        """A descriptor of the budget, at its cap by closing the busiest source's
        oldest proved inbound link (False: the budget is all in other uses)."""
        budget = self.budget
        return budget.take() or (self.make_room() and budget.take())

    def make_room(self) -> bool:
        """Close the oldest link of the busiest source (False: none is held)."""
        if not self._by_source:
            return False
        links = max(self._by_source.values(), key=len)
        oldest = next(iter(links))
        self.discard(oldest)
        self.given += 1
        oldest.give_room()
        return True


__all__ = ["Held", "InboundRoom"]
