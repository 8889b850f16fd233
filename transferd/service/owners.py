"""Owners of buffers and regions, and what happens when an owner goes.

A buffer's owner (docs/engine.md, "Owners and leases") is the node (None), the
caller that allocated it (its :class:`~.caller.Caller`: an RPC connection or an
inproc client) or a named Lease.  Its regions follow it: a region never outlives
its buffer.  When a caller closes or a lease ends or expires, every buffer it owns
is taken out of the table (its id is NOT_FOUND from then on) and its regions
deregistered (their rkeys revoked: a peer write presenting one is refused
NOT_FOUND); writes admitted before finish landing, and the memory and its charge
come back once nothing holds it (a write in flight from it, a reply still being
sent).  Other owners' buffers are not touched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Hashable, Sequence
from typing import TYPE_CHECKING

from transferd.memory.leases import Lease
from transferd.protocol.errors import BadRequest, Timeout

if TYPE_CHECKING:
    from transferd.engine.regions import Region
    from transferd.memory.leases import LeaseTable

    from .caller import Caller

OWNERS = ("daemon", "connection", "lease")


def resolve_owner(caller: Caller, owner: str | None, lease: str | None, default: str,
                  leases: LeaseTable | None) -> Hashable | None:
    """The owner an allocation asks for (``owner`` and/or ``lease``), else ``default``."""
    if owner is not None and owner not in OWNERS:
        raise BadRequest(f"field 'owner' must be one of {', '.join(OWNERS)}, not {owner!r}")
    if lease is not None:
        if owner not in (None, "lease"):
            raise BadRequest(f"owner {owner!r} and a lease: a buffer has one owner")
        if leases is None:  # pragma: no cover - every started Service has its table
            raise BadRequest("this daemon serves no leases")
        return leases.held(lease, caller)  # another caller's lease: refused
    if owner == "lease":
        raise BadRequest("owner 'lease' needs the field 'lease' (the lease's name)")
    chosen = owner or default
    return caller if chosen == "connection" else None


def owner_name(owner: Hashable | None) -> str:
    if owner is None:
        return "daemon"
    return "lease" if isinstance(owner, Lease) else "connection"


def wait_drained(regions: Sequence[Region], patience: float = 30.0) -> Awaitable[None] | None:
    """None when no write is in flight into ``regions``, else an awaitable until then.

    Writes admitted before the regions were deregistered finish landing (and
    are acknowledged to their initiators); later ones were refused.  One that
    has not finished after ``patience`` seconds (a peer stalled mid-payload)
    is cut short: its link is closed, its initiator sees the link fail, and
    nothing more of it lands.  One that cannot be cut short (its Domain gave
    no way) and is still landing ``patience`` seconds later fails the wait
    with TIMEOUT: the rkeys stay revoked and the memory held until it ends,
    but nothing waits forever.
    """
    pending = [r for r in regions if not r.drained().done()]
    if not pending:
        return None

    async def wait() -> None:
        done = asyncio.gather(*(asyncio.wrap_future(r.drained()) for r in pending))
        try:
            await asyncio.wait_for(asyncio.shield(done), patience)
            return
        except TimeoutError:
            for r in pending:
                r.abort_admitted()
        try:
            await asyncio.wait_for(asyncio.shield(done), patience)
        except TimeoutError:
            left = sum(r.admitted for r in pending)
            ids = ", ".join(str(r.id) for r in pending if r.admitted)
            raise Timeout(f"{left} write(s) admitted into region(s) {ids} before they were "
                          f"revoked still land {2 * patience:g} s later and cannot be cut "
                          "short: no new write is admitted; the memory stays held until "
                          "they end") from None

    return wait()
