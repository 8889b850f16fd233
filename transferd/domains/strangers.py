"""A rail port's strangers: who may be in its handshake, for how long, from where.

Every connection a rail accepts is a stranger until its peer handshake is done, and
holds a pre-auth slot of the rail's :class:`~transferd.preauth.Admission` (the same
piece the client ports use) until then: at most :data:`MAX_HANDSHAKING` at once,
:data:`MAX_PER_SOURCE` of them from one source address, each for at most the
handshake's timeout (``engine.handshake_timeout_s``).  A newcomer is never refused for
a full table: the oldest of its own source gives way at the cap per source, the
busiest source's oldest at the cap in all.  So silent sockets from one stranger hold
at most their source's share, and a real peer's link gets through while they wait.
"""

from __future__ import annotations

import logging
from typing import Protocol

from transferd.fds import LogEvery
from transferd.preauth import Admission, Ticket, Why

log = logging.getLogger("transferd.domain")

# Links in their handshake at once, per rail, and from one source address.
MAX_HANDSHAKING = 64
MAX_PER_SOURCE = 16


class Stranger(Protocol):
    """An inbound link in its handshake (told when its slot is taken back)."""

    def give_way(self, why: Why) -> None: ...


class RailStrangers:
    def __init__(self, label: str, timeout_s: float, max_handshaking: int = MAX_HANDSHAKING,
                 max_per_source: int = MAX_PER_SOURCE) -> None:
        self.label = label
        self.admission = Admission(max_handshaking, max_per_source, timeout=timeout_s)
        self._log = LogEvery(log)

    @property
    def handshaking(self) -> int:
        return self.admission.pending

    def admit(self, source: str, now: float, link: Stranger) -> Ticket | None:
        """A slot for ``link`` (None: none to be had); links whose slots it takes are
        told to go (their ``give_way``)."""
        out = self.admission.admit(source, now, link)
        if out.closed:
            self._log(logging.INFO, "%s: %d link(s) in their handshake gave way to a "
                      "newcomer from %s (at most %d from one source, %d in all)",
                      self.label, len(out.closed), source, self.admission.max_per_source,
                      self.admission.max_pending)
            Admission.close(out.closed)
        if out.ticket is None:
            self._log(logging.WARNING, "%s: inbound link from %s refused: %s", self.label,
                      source, out.reason)
        return out.ticket

    def done(self, ticket: Ticket | None) -> None:
        """The link authenticated or went away: its slot is free."""
        if ticket is not None:
            self.admission.release(ticket)
