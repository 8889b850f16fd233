"""LEASE (0x2D) and END_LEASE (0x2E): named owners of buffers that outlive a connection.

LEASE ``{"lease": name, "ttl_ms": n}`` makes the lease, or renews it: its
deadline becomes ``n`` ms from now.  Reply ``{"lease", "ttl_ms", "created",
"buffers"}``.  ALLOC_BUFFER ``{"lease": name}`` makes a buffer it owns.  When
the deadline passes unrenewed, or END_LEASE ``{"lease": name}`` ends it, its
buffers are freed and their regions' rkeys revoked; END_LEASE replies
``{"buffers": n}`` once the writes admitted into those regions have landed.
The connection that made a lease holds it; another is refused (BAD_REQUEST)
unless its LEASE (or END_LEASE) carries ``"join": true``, which makes it a
holder too.  Served on every minor-2 daemon, with or without the engine.
docs/protocol.md has the reference.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING

from transferd.protocol.constants import Command
from transferd.protocol.errors import BadRequest
from transferd.protocol.frames import Frame
from transferd.protocol.messages import str_field, uint_field

from .handlers import Reply, handler

if TYPE_CHECKING:
    from .session import Session

# A ttl in ms fits in a u32 (49 days): more than any max_lease_ttl_s makes sense for.
MAX_TTL_MS = 0xFFFFFFFF


def _join(body: dict[str, object]) -> bool:
    join = body.get("join", False)
    if type(join) is not bool:
        raise BadRequest(f"field 'join' must be a boolean, not {type(join).__name__}")
    return join


@handler(Command.LEASE)
def lease(session: Session, frame: Frame) -> Reply:
    name = str_field(frame.body, "lease")
    ttl_ms = uint_field(frame.body, "ttl_ms", MAX_TTL_MS)
    got, created, buffers = session.ctx.service.renew_lease(
        session.caller, name, ttl_ms / 1000.0, join=_join(frame.body))
    return Reply({"lease": got.name, "ttl_ms": ttl_ms, "created": created, "buffers": buffers})


@handler(Command.END_LEASE)
def end_lease(session: Session, frame: Frame) -> Reply | Awaitable[Reply]:
    n, drained = session.ctx.service.end_lease(session.caller, str_field(frame.body, "lease"),
                                               join=_join(frame.body))
    reply = Reply({"buffers": n})
    if drained is None:
        return reply

    async def after() -> Reply:
        # As FREE_BUFFER: after the reply no byte of a peer write lands in them.
        await drained
        return reply

    return after()
