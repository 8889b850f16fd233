"""Owners of buffers and regions, and what happens when an owner goes.

A buffer's owner (docs/engine.md, "Owners and leases") is the daemon (None),
the connection that allocated it (its Session) or a named Lease.  Its regions
follow it: REG_MR of a buffer makes regions that live no longer than the
buffer.  When a connection closes or a lease ends or expires, every buffer it
owns is taken out of the table (its id is NOT_FOUND from then on) and its
regions deregistered (their rkeys revoked: a peer write presenting one is
refused NOT_FOUND); writes admitted before finish landing, and the memory and
its charge come back once nothing holds it (a write in flight from it, a reply
still being sent).  Other owners' buffers are not touched.

This module imports no handler: handlers.py and lease_handlers.py use it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from transferd.memory.leases import Lease
from transferd.protocol.errors import BadRequest, Timeout, TransferdError

from . import ops

if TYPE_CHECKING:
    from transferd.engine.regions import Region

    from .context import ServerContext
    from .session import Session

log = logging.getLogger("transferd.session")

OWNERS = ("daemon", "connection", "lease")

# Other tables whose entries an owner holds (names: rpc_server/name_handlers.py), each
# told when that owner is gone (a connection closed, a lease ended or expired).
OWNER_GONE: list[Callable[[ServerContext, Hashable], None]] = []


def owner_for(session: Session, body: dict[str, Any], default: str) -> Hashable | None:
    """The owner an ALLOC_BUFFER asks for: ``owner`` and/or ``lease``, else ``default``."""
    lease = body.get("lease")
    owner = body.get("owner")
    if owner is not None and owner not in OWNERS:
        raise BadRequest(f"field 'owner' must be one of {', '.join(OWNERS)}, not {owner!r}")
    if lease is not None:
        if owner not in (None, "lease"):
            raise BadRequest(f"owner {owner!r} and a lease: a buffer has one owner")
        leases = session.ctx.leases
        if leases is None:  # pragma: no cover - every RPC front end makes its table
            raise BadRequest("this daemon serves no leases")
        return leases.held(lease, session)  # another connection's lease: refused
    if owner == "lease":
        raise BadRequest("owner 'lease' needs the field 'lease' (the lease's name)")
    chosen = owner or default
    return session if chosen == "connection" else None


def owner_name(owner: Hashable | None) -> str:
    if owner is None:
        return "daemon"
    return "lease" if isinstance(owner, Lease) else "connection"


def patience_of(ctx: ServerContext) -> float:
    """How long a release waits for a write in flight before cutting it short."""
    engine = ctx.engine
    return engine.config.peer_timeout_s if engine is not None else 30.0


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


def release_owned(ctx: ServerContext, owner: Hashable) -> tuple[int, Awaitable[None] | None]:
    """Free every buffer ``owner`` holds and revoke their regions' rkeys, now.

    Returns how many buffers went, and an awaitable until the writes admitted
    into their regions before the revocation have landed (None: none in flight).
    """
    for gone in OWNER_GONE:
        gone(ctx, owner)
    table = ctx.buffers
    engine = ctx.engine
    regions: list[Region] = []
    n = 0
    for buf in table.owned_by(owner):
        try:
            table.free_buffer(buf.id)
        except TransferdError:
            continue  # freed meanwhile
        n += 1
        if engine is not None:
            regions += engine.regions.regions_of(buf)
            # Writes in flight into it finish landing (they hold its memory).
            engine.buffer_freed(buf)
    return n, wait_drained(regions, patience_of(ctx))


def release_in_background(ctx: ServerContext, owner: Hashable, why: str) -> int:
    """:func:`release_owned` with nobody to answer: the drain runs on its own."""
    n, drained = release_owned(ctx, owner)
    if n:
        log.info("%s: %d buffer(s) freed", why, n)
    if drained is not None:
        task = asyncio.ensure_future(drained)
        ctx.background.add(task)
        task.add_done_callback(functools.partial(_drained, ctx, why))
    return n


def _drained(ctx: ServerContext, why: str, task: asyncio.Future[None]) -> None:
    ctx.background.discard(task)
    exc = task.exception() if not task.cancelled() else None
    if exc is not None:
        log.warning("%s: %s", why, exc)


def session_closed(session: Session) -> None:
    """The connection is gone: free what it owned; leases it made stay theirs."""
    ops.session_closed(session)
    session.landings.close()  # staged SETs that never reached their handler
    ctx = session.ctx
    release_in_background(ctx, session, f"connection {session.peer} closed")
    if ctx.leases is not None:
        ctx.leases.connection_closed(session)
    from .watcher_handlers import session_closed as watchers_closed  # imports handlers

    watchers_closed(session)  # at once: the sweep would free the slots 0.5 s later


def lease_expired(ctx: ServerContext, lease: Lease) -> None:
    ctx.metrics.leases_expired.inc()
    release_in_background(ctx, lease, f"lease {lease.name!r} expired unrenewed")
