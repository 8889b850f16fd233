"""Named leases: owners of buffers that outlive a connection, for as long as they are renewed.

Every buffer has an owner (docs/engine.md, "Owners and leases"): the daemon
(``None``: until FREE_BUFFER or the daemon stops), the connection that
allocated it (the session object: freed when it closes), or a :class:`Lease`.
A lease is a name with a deadline; any connection that knows the name renews
it (LEASE) or ends it (END_LEASE).  When the deadline passes unrenewed the
table calls ``on_expire(lease)``, and the owner of the table frees the lease's
buffers the way a closing connection's are freed.

The table is bounded: at most ``max_leases`` in the daemon and
``max_per_connection`` live leases created by one connection (a connection
that closes no longer counts against anybody: its leases run out by
themselves).  Timers run on the loop given; nothing here touches memory.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from transferd.protocol.errors import BadRequest, NotFound, OverLimit

# Longest lease name, in UTF-8 bytes.
MAX_NAME = 128


@dataclass(eq=False)
class Lease:
    """A named owner.  Hashable by identity: a renamed or re-created lease is another owner."""

    name: str
    ttl: float
    expires: float
    # The connection that created it, while that connection is open (limits only).
    creator: Hashable | None = field(default=None, repr=False)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    ended: bool = False

    @property
    def peer(self) -> str:
        """How listings (``transferd buffers``) name this owner."""
        return f"lease:{self.name}"


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise BadRequest("field 'lease' must be a non-empty string")
    if len(name.encode()) > MAX_NAME:
        raise BadRequest(f"lease name of {len(name.encode())} bytes is over {MAX_NAME}")
    return name


class LeaseTable:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_expire: Callable[[Lease], None], *,
                 max_leases: int = 1024, max_per_connection: int = 64,
                 max_ttl_s: float = 3600.0) -> None:
        self.loop = loop
        self.on_expire = on_expire
        self.max_leases = max_leases
        self.max_per_connection = max_per_connection
        self.max_ttl_s = max_ttl_s
        self._leases: dict[str, Lease] = {}
        self._created: Counter[Hashable] = Counter()

    def __len__(self) -> int:
        return len(self._leases)

    def check_ttl(self, ttl: float) -> float:
        if not 0 < ttl <= self.max_ttl_s:
            raise BadRequest(f"lease ttl of {ttl:g} s is outside (0, {self.max_ttl_s:g}] "
                             "(memory.max_lease_ttl_s)")
        return ttl

    def renew(self, name: str, ttl: float, conn: Hashable) -> tuple[Lease, bool]:
        """Create ``name`` (True) or push its deadline to ``ttl`` seconds from now (False)."""
        name = check_name(name)
        ttl = self.check_ttl(ttl)
        now = self.loop.time()
        lease = self._leases.get(name)
        if lease is not None:
            lease.ttl = ttl
            lease.expires = now + ttl
            if lease.timer is not None and lease.timer.when() > lease.expires:
                # Shortened: the timer must fire sooner.  (Lengthened: it fires,
                # finds the new deadline, and waits again: no reschedule per renewal.)
                lease.timer.cancel()
                lease.timer = self.loop.call_at(lease.expires, self._check, lease)
            return lease, False
        if len(self._leases) >= self.max_leases:
            raise OverLimit(f"{len(self._leases)} leases held: the most this daemon holds "
                            "(memory.max_leases); end or let some expire")
        if self._created[conn] >= self.max_per_connection:
            raise OverLimit(f"{self._created[conn]} leases created by this connection are "
                            "alive: the most one connection may hold "
                            "(memory.max_leases_per_connection)")
        lease = Lease(name, ttl, now + ttl, conn)
        self._created[conn] += 1
        lease.timer = self.loop.call_at(lease.expires, self._check, lease)
        self._leases[name] = lease
        return lease, True

    def get(self, name: str) -> Lease:
        lease = self._leases.get(check_name(name))
        if lease is None:
            raise NotFound(f"no lease {name!r} (never made, ended, or expired)")
        return lease

    def end(self, name: str) -> Lease:
        """Remove ``name`` now; the caller frees what it owned."""
        lease = self.get(name)
        self._drop(lease)
        return lease

    def remaining(self, lease: Lease) -> float:
        return max(0.0, lease.expires - self.loop.time())

    def connection_closed(self, conn: Hashable) -> None:
        """``conn`` creates no more: its leases stay, counted against nobody."""
        if self._created.pop(conn, 0):
            for lease in self._leases.values():
                if lease.creator is conn:
                    lease.creator = None

    def close(self) -> None:
        for lease in list(self._leases.values()):
            self._drop(lease)

    def _drop(self, lease: Lease) -> None:
        lease.ended = True
        if self._leases.get(lease.name) is lease:
            del self._leases[lease.name]
        if lease.timer is not None:
            lease.timer.cancel()
            lease.timer = None
        if lease.creator is not None:
            self._created[lease.creator] -= 1
            if self._created[lease.creator] <= 0:
                del self._created[lease.creator]
            lease.creator = None

    def _check(self, lease: Lease) -> None:
        if lease.ended:
            return
        if self.loop.time() < lease.expires:
            lease.timer = self.loop.call_at(lease.expires, self._check, lease)
            return
        self._drop(lease)
        self.on_expire(lease)
