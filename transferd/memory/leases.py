"""Named leases: owners of buffers that outlive a connection, for as long as they are renewed.

Every buffer has an owner (docs/engine.md, "Owners and leases"): the daemon
(``None``: until FREE_BUFFER or the daemon stops), the connection that
allocated it (the session object: freed when it closes), or a :class:`Lease`.
A lease is a name with a deadline.  The connection that made it holds it, and
so does any connection that joins it (LEASE with ``join``); a holder renews it
(LEASE), gives it buffers (ALLOC_BUFFER ``lease``) and ends it (END_LEASE).  A
connection that does not hold a lease is refused all three unless it asks to
join, so two clients that happen to pick one name never share (and free) each
other's memory by accident.  When the deadline passes unrenewed the table
calls ``on_expire(lease)``, and the owner of the table frees the lease's
buffers the way a closing connection's are freed.  A lease outlives its
holders: once the last one closes it runs out unless another joins it.

The table is bounded: at most ``max_leases`` in the daemon,
``max_per_connection`` held by one connection (made or joined, while it is
open), and ``max_per_source`` alive that were made from one source address
(counted until the lease ends or expires, so a client that reconnects cannot
take every slot).  Timers run on the loop given; nothing here touches memory.
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
    # The source address it was made from: counted against it while the lease lives.
    source: str = ""
    # The open connections that made or joined it.
    holders: set[Hashable] = field(default_factory=set, repr=False)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    ended: bool = False

    @property
    def peer(self) -> str:
        """How listings (``transferd buffers``) name this owner to a holder."""
        return f"lease:{self.name}"

    def shown_to(self, viewer: Hashable) -> str:
        """The owner as a listing shows it to ``viewer``: the name is the capability to
        join and end the lease, so only its holders see it."""
        return self.peer if viewer in self.holders else "lease"


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise BadRequest("field 'lease' must be a non-empty string")
    if len(name.encode()) > MAX_NAME:
        raise BadRequest(f"lease name of {len(name.encode())} bytes is over {MAX_NAME}")
    return name


class LeaseTable:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_expire: Callable[[Lease], None], *,
                 max_leases: int = 1024, max_per_connection: int = 64,
                 max_per_source: int = 256, max_ttl_s: float = 3600.0) -> None:
        self.loop = loop
        self.on_expire = on_expire
        self.max_leases = max_leases
        self.max_per_connection = max_per_connection
        self.max_per_source = max_per_source
        self.max_ttl_s = max_ttl_s
        self._leases: dict[str, Lease] = {}
        # What each open connection holds, and how many live leases each source made.
        self._held: dict[Hashable, set[Lease]] = {}
        self._made: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._leases)

    def check_ttl(self, ttl: float) -> float:
        if not 0 < ttl <= self.max_ttl_s:
            # The value as asked (repr): ``:g`` keeps six digits, so 3600.001 s read
            # "3600 s is outside (0, 3600]".
            raise BadRequest(f"lease ttl of {ttl!r} s is outside (0, {self.max_ttl_s:g}] s "
                             "(memory.max_lease_ttl_s)")
        return ttl

    def renew(self, name: str, ttl: float, conn: Hashable, *, join: bool = False,
              source: str = "") -> tuple[Lease, bool]:
        """Create ``name`` (True) or push its deadline to ``ttl`` seconds from now (False).

        An existing lease ``conn`` does not hold is refused unless ``join``: then
        ``conn`` holds it too.  ``source`` is where ``conn`` comes from."""
        name = check_name(name)
        ttl = self.check_ttl(ttl)
        now = self.loop.time()
        lease = self._leases.get(name)
        if lease is not None:
            if conn not in lease.holders:
                self._not_held(lease, join)
                self._hold(lease, conn)
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
        self._check_holds(conn)
        if self._made[source] >= self.max_per_source:
            raise OverLimit(f"{self._made[source]} live leases were made from {source}: the "
                            "most one source may have (memory.max_leases_per_source), "
                            "closed connections' included until they end or expire")
        lease = Lease(name, ttl, now + ttl, source)
        self._made[source] += 1
        self._hold(lease, conn)
        lease.timer = self.loop.call_at(lease.expires, self._check, lease)
        self._leases[name] = lease
        return lease, True

    def get(self, name: str) -> Lease:
        lease = self._leases.get(check_name(name))
        if lease is None:
            raise NotFound(f"no lease {name!r} (never made, ended, or expired)")
        return lease

    def held(self, name: str, conn: Hashable, *, join: bool = False) -> Lease:
        """``name``, which ``conn`` must hold (or, with ``join``, may take on)."""
        lease = self.get(name)
        if conn not in lease.holders:
            self._not_held(lease, join)
        return lease

    def end(self, name: str, conn: Hashable, *, join: bool = False) -> Lease:
        """Remove ``name`` now (``conn`` holds it, or ``join``); the caller frees what
        it owned."""
        lease = self.held(name, conn, join=join)
        self._drop(lease)
        return lease

    def remaining(self, lease: Lease) -> float:
        return max(0.0, lease.expires - self.loop.time())

    def connection_closed(self, conn: Hashable) -> None:
        """``conn`` holds nothing more: its leases stay, to run out unless renewed."""
        for lease in self._held.pop(conn, ()):
            lease.holders.discard(conn)

    def close(self) -> None:
        for lease in list(self._leases.values()):
            self._drop(lease)

    def _not_held(self, lease: Lease, join: bool) -> None:
        if not join:
            raise BadRequest(
                f"lease {lease.name!r} was made by another connection and this one has not "
                "joined it: pick another name, or pass join (LEASE {\"join\": true}, "
                "client.lease(name, ttl, join=True)) to share it")

    def _check_holds(self, conn: Hashable) -> None:
        n = len(self._held.get(conn, ()))
        if n >= self.max_per_connection:
            raise OverLimit(f"this connection holds {n} leases (made or joined): the most "
                            "one connection may hold (memory.max_leases_per_connection)")

    def _hold(self, lease: Lease, conn: Hashable) -> None:
        self._check_holds(conn)
        lease.holders.add(conn)
        self._held.setdefault(conn, set()).add(lease)

    def _drop(self, lease: Lease) -> None:
        lease.ended = True
        if self._leases.get(lease.name) is lease:
            del self._leases[lease.name]
            self._made[lease.source] -= 1
            if self._made[lease.source] <= 0:
                del self._made[lease.source]
        if lease.timer is not None:
            lease.timer.cancel()
            lease.timer = None
        for conn in lease.holders:
            mine = self._held.get(conn)
            if mine is not None:
                mine.discard(lease)
                if not mine:
                    del self._held[conn]
        lease.holders.clear()

    def _check(self, lease: Lease) -> None:
        if lease.ended:
            return
        if self.loop.time() < lease.expires:
            lease.timer = self.loop.call_at(lease.expires, self._check, lease)
            return
        self._drop(lease)
        self.on_expire(lease)
