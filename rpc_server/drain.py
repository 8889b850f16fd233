"""The RPC server's part of the drain at SIGTERM (``server.drain_s``; the daemon runs it).

1. :func:`begin`: new requests on open connections are refused with CANCELLED
   ("nothing done"); the caller has closed the listeners already.  A request
   whose payload had begun to land before runs to its end (its bytes are in
   place: refusing it then would report undone what was done).
2. :func:`in_flight`: what is still running: engine transfers this daemon's
   clients submitted and not yet acknowledged, asynchronous handlers
   (SYNCHRONIZE, a submit waiting for a slot), payloads still arriving, and
   connections that lingered less than :data:`LINGER_S` since the drain began or
   their last activity (bytes in, write buffer emptied).  A client that has just
   read a reply may have its next request on the wire already: closing under it
   would cut it off ("Broken pipe") where it should be answered CANCELLED.
3. :func:`fail_in_flight`: once the drain time ran out (and the engine is
   closed: nothing more can be acknowledged), every transfer still pending
   fails with TIMEOUT (outcome unknown, as the peer may have placed it) through
   the normal completion EVENT; waiting handlers are cancelled.
4. :func:`close_all`: every connection is closed after its write buffer has
   drained (the EVENTs above reach the client), bounded by a timeout after
   which a connection that does not read is aborted.
"""

from __future__ import annotations

import asyncio
from typing import Any

from transferd.protocol.errors import Timeout

from .context import ServerContext

# How long a connection stays open after the drain began or after its last activity,
# whichever is later, for a request already on the wire to arrive and be answered.
LINGER_S = 0.25


def begin(ctx: ServerContext) -> None:
    ctx.draining = True
    now = asyncio.get_running_loop().time()
    for s in list(ctx.sessions):
        s.last_active = max(s.last_active, now)


def in_flight(ctx: ServerContext) -> int:
    recent = asyncio.get_running_loop().time() - LINGER_S
    return sum(len(s.pending) + len(s._tasks) + s.receiving + (s.last_active > recent)
               for s in list(ctx.sessions))


def fail_in_flight(ctx: ServerContext, drain_s: float) -> int:
    """Fail what still runs (see the module docstring); how many transfers failed."""
    failed = 0
    for s in list(ctx.sessions):
        for fut in list(s.pending):
            if not fut.done():
                fut.set_exception(Timeout(
                    f"the daemon stopped (SIGTERM) and its drain time (server.drain_s = "
                    f"{drain_s:g} s) ran out before the peer acknowledged this transfer: "
                    "outcome unknown"))
                failed += 1
        for task in list(s._tasks):
            task.cancel()
    return failed


async def close_all(ctx: ServerContext, timeout: float) -> int:
    """Close every connection once its replies are out; abort those still open after
    ``timeout`` s (a client that does not read).  How many were aborted."""
    sessions: list[Any] = list(ctx.sessions)
    for s in sessions:
        s.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while ctx.sessions and loop.time() < deadline:
        await asyncio.sleep(0.01)
    left = list(ctx.sessions)
    for s in left:
        if s.transport is not None:
            s.transport.abort()
    if left:
        await asyncio.sleep(0)  # connection_lost runs
    return len(left)
