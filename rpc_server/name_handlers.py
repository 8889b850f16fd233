"""PUBLISH, LOOKUP, UNPUBLISH, WATCH, PEERS, NAMES (0x30-0x35): the cluster's names.

Served on every minor-2 daemon, with or without the engine (HELLO lists
``names``).  What each does, and who may, is the node's (``service.names``,
transferd/service/names.py, which the inproc client calls too); these handlers
read the frames and write the replies.  WATCH streams EVENTs (``{"op", "name",
"kind", "value", "node"}``) with the request's cmd and seq until CANCEL of that
seq or the connection's end; what cannot be sent while the connection's write
buffer is full waits, one change per name (the latest), so a watcher that stops
reading costs at most the names it watches.  docs/protocol.md has the reference;
transferd/discovery/ the directory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from transferd.discovery.backlog import Backlog
from transferd.discovery.directory import Directory
from transferd.discovery.names import check_name
from transferd.discovery.records import Change, check_kind, encode_value
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import BadRequest, OverLimit, TransferdError
from transferd.protocol.frames import Frame
from transferd.protocol.messages import bytes_field, uint_field
from transferd.service.names import Confirmed, Names

from .handlers import Reply, handler
from .ops import Op

if TYPE_CHECKING:
    from .session import Session

# A name's ttl in ms fits in a u32 (49 days).
MAX_TTL_MS = 0xFFFFFFFF


def _names(session: Session) -> Names:
    return session.ctx.service.names


def _reply(confirmed: Confirmed) -> Reply | Awaitable[Reply]:
    if isinstance(confirmed, dict):
        return Reply(confirmed)

    async def later() -> Reply:
        return Reply(await confirmed)

    return later()


@handler(Command.PUBLISH)
def publish(session: Session, frame: Frame) -> Reply | Awaitable[Reply]:
    b = frame.body
    name, kind = check_name(b.get("name")), check_kind(b.get("kind"))
    data = bytes_field(b, "value")
    ttl = None
    if b.get("ttl_ms") is not None:
        ttl_ms = uint_field(b, "ttl_ms", MAX_TTL_MS)
        if ttl_ms == 0:
            raise BadRequest("field 'ttl_ms' must be positive (omit it: no ttl)")
        ttl = ttl_ms / 1000.0
    return _reply(_names(session).publish(session.caller, name, kind, data, ttl,
                                          owner=b.get("owner"), lease=b.get("lease")))


@handler(Command.LOOKUP)
def lookup(session: Session, frame: Frame) -> Reply | Awaitable[Reply]:
    found = _names(session).lookup(frame.body.get("name"))
    if isinstance(found, tuple):
        return Reply(_found(found))

    async def from_store() -> Reply:
        return Reply(_found(await found))

    return from_store()


def _found(found: tuple[str, str, bytes, str]) -> dict[str, Any]:
    name, kind, data, node = found
    return {"name": name, "kind": kind, "value": data, "node": node}


@handler(Command.UNPUBLISH)
def unpublish(session: Session, frame: Frame) -> Reply | Awaitable[Reply]:
    return _reply(_names(session).unpublish(session.caller, frame.body.get("name")))


@handler(Command.PEERS)
def peers(session: Session, frame: Frame) -> Reply:
    names = _names(session)
    return Reply({"peers": names.peers(), "discovery": names.status()})


@handler(Command.NAMES)
def names(session: Session, frame: Frame) -> Reply:
    part = _names(session)
    b = frame.body
    limit = (uint_field(b, "limit", part.directory.limits.max_listing)
             if b.get("limit") is not None else None)
    entries, more = part.listing(b.get("prefix", ""), b.get("after", ""), limit)
    return Reply({"names": [{"name": e.name, "kind": e.kind.value, "node": e.node,
                             "size": len(e.data)} for e in entries], "more": more})


class WatchStream:
    """One WATCH: changes under its prefix, sent as EVENTs as the connection takes them.

    While the connection cannot take more, changes wait in a
    :class:`~transferd.discovery.backlog.Backlog`: one per name, none for a name
    that came and went unseen, so bounded by the names under the prefix whatever
    the churn.
    """

    def __init__(self, session: Session, seq: int, directory: Directory) -> None:
        self.session = session
        self.seq = seq
        # The changes not sent yet.
        self.pending = Backlog()
        lim = directory.limits
        # Never reached while the reasoning above holds: a guard, not a policy.
        self.cap = 2 * (lim.max_names + lim.max_cluster_names)
        self.held = True  # until the WATCH reply is out
        self.ended = False
        self.sub: Any = None
        self.op: Op | None = None

    def push(self, change: Change, new: bool) -> None:
        self.pending.add(change, new)
        if len(self.pending) > self.cap:
            self.stop(OverLimit(f"WATCH {self.seq}: over {self.cap} changes wait for this "
                                "connection; watch again"))
            return
        self.flush()

    def release(self) -> None:
        self.held = False
        self.flush()

    def flush(self) -> None:
        s = self.session
        if self.held or self.ended:
            return
        while self.pending and not s.write_blocked:
            if s.transport is None or s.transport.is_closing():
                self.pending.clear()
                return
            ch, new = self.pending.take()
            body: dict[str, Any] = {"op": ch.op.value, "name": ch.name, "node": ch.node}
            if ch.value is not None:
                kind, raw = encode_value(ch.value)
                body.update(kind=kind.value, value=raw)
            if new:
                body["new"] = True
            s.send_frame(Command.WATCH, Flag.EVENT, self.seq, body)
        if self.pending:
            s.drained_hooks.add(self.flush)
        else:
            s.drained_hooks.discard(self.flush)

    def stop(self, error: TransferdError) -> bool:
        if self.ended:
            return False
        self.ended = True
        self.pending.clear()
        self.session.drained_hooks.discard(self.flush)
        if self.sub is not None:
            _names(self.session).unwatch(self.sub)
        self.session.send_frame(Command.WATCH, Flag.EVENT | Flag.ERROR, self.seq,
                                error.to_body())
        if self.op is not None:
            self.session.caller.ops.finished(self.op, error)
        return True


@handler(Command.WATCH)
def watch(session: Session, frame: Frame) -> Reply:
    part = _names(session)
    b = frame.body
    if frame.no_reply:
        raise BadRequest("WATCH answers with its reply before any EVENT: it cannot be one-way")
    ops = session.caller.ops
    ops.check_free(frame.seq)
    stream = WatchStream(session, frame.seq, part.directory)
    stream.sub, now = part.watch(session.caller, b.get("prefix", ""), stream.push,
                                 initial=b.get("initial", True))
    for change in now:  # every visible name under the prefix, as puts, before any change
        stream.pending.add(change, True)
    # CANCEL of its seq ends it (EVENT|ERROR CANCELLED, then CANCEL's reply).
    op = Op(frame.seq, "WATCH", stream.stop, with_caller=True)
    stream.op = op
    ops.add(op, None)
    # The reply goes out when this returns; the stream's EVENTs after it.
    asyncio.get_running_loop().call_soon(stream.release)
    return Reply({"watch": frame.seq, "names": len(now), "node": part.directory.node_name})
