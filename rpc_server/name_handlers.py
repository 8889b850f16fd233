"""PUBLISH, LOOKUP, UNPUBLISH, WATCH, PEERS, NAMES (0x30-0x35): the cluster's names.

Served on every minor-2 daemon, with or without the engine (HELLO lists
``names``).  A name is published through this daemon by one owner, as a buffer
is owned (``owner``: ``"connection"``, ``"daemon"``, or ``lease``; the default
is discovery.default_owner), and goes when that owner goes; a name whose value
is an MrDesc also goes when its region is deregistered.  WATCH streams EVENTs
(``{"op", "name", "kind", "value", "node"}``) with the request's cmd and seq
until CANCEL of that seq or the connection's end; what cannot be sent while
the connection's write buffer is full waits, one change per name (the
latest), so a watcher that stops reading costs at most the names it watches.
docs/protocol.md has the reference; transferd/discovery/ the directory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Hashable
from typing import TYPE_CHECKING, Any

from transferd.config_discovery import DiscoveryConfig
from transferd.discovery.backend import Embedded
from transferd.discovery.backlog import Backlog
from transferd.discovery.directory import Directory, Entry
from transferd.discovery.names import check_name, check_prefix
from transferd.discovery.records import Change, check_kind, decode_value, encode_value
from transferd.discovery.records import Op as ChangeOp
from transferd.discovery.service import Discovery, record_to_wire
from transferd.memory.leases import Lease
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import BadRequest, NotFound, OverLimit, TransferdError
from transferd.protocol.frames import Frame
from transferd.protocol.messages import bytes_field, uint_field
from transferd.protocol.values import MrDesc

from .handlers import Reply, handler
from .ops import Op, ops_of
from .ownership import OWNER_GONE, owner_for, owner_name

if TYPE_CHECKING:
    from .context import ServerContext
    from .session import Session

# A name's ttl in ms fits in a u32 (49 days).
MAX_TTL_MS = 0xFFFFFFFF


def discovery_of(ctx: ServerContext) -> Discovery:
    """The daemon's Discovery; a front end built without one gets an embedded one."""
    disc = ctx.discovery
    if disc is None:
        disc = ctx.discovery = Discovery(DiscoveryConfig())
        disc.directory.node_name = "local"
        disc.directory.record = {"v": 1, "name": "local", "server": ctx.name,
                                 "version": [1, ctx.minor, 0]}
    return disc


def _owner_gone(ctx: ServerContext, owner: Hashable) -> None:
    if ctx.discovery is not None:
        ctx.discovery.directory.owner_gone(owner)


OWNER_GONE.append(_owner_gone)


def _local_region(session: Session, desc: MrDesc) -> Any:
    """The region of this daemon an MrDesc names (its name goes when the region does)."""
    engine = session.ctx.engine
    if engine is None:
        raise BadRequest("this daemon runs without the transfer engine: it holds no region "
                         "an MrDesc could name")
    node = desc.node[0]
    if node != engine.node:
        raise BadRequest(f"an MrDesc is published through the daemon that holds its region "
                         f"(node {node:016x}), not this one ({engine.node:016x})")
    try:
        region = engine.regions.by_rkey(desc.rkeys[0][1], 0)
    except NotFound:
        raise NotFound("the MrDesc names no registered region of this daemon (deregistered, "
                       "or its buffer freed)") from None
    if region.ptr != desc.ptr or tuple(k for _, k in desc.rkeys) != region.rkeys:
        raise BadRequest("the MrDesc does not match the region its first rkey names")
    return region


def _watch_region(session: Session, directory: Directory, region: Any) -> None:
    loop = asyncio.get_running_loop()

    def gone(_: Any) -> None:  # from whichever thread let the region's last write go
        with contextlib.suppress(RuntimeError):  # the loop is gone: so is the directory
            loop.call_soon_threadsafe(directory.region_gone, region)

    region.drained().add_done_callback(gone)


def _entry_body(e: Entry) -> dict[str, Any]:
    return {"name": e.name, "kind": e.kind.value, "value": e.data, "node": e.node}


def _confirmed(disc: Discovery, name: str, body: dict[str, Any]
               ) -> Reply | Awaitable[Reply]:
    """The reply once the store holds the change (bounded by discovery.timeout_s)."""
    wait = disc.backend.confirmed(name)
    if wait is None:
        # Embedded: this daemon is the store.  Else the store is away: written once back.
        body["synced"] = isinstance(disc.backend, Embedded)
        return Reply(body)

    async def later() -> Reply:
        body["synced"] = bool(await wait)
        return Reply(body)

    return later()


@handler(Command.PUBLISH)
def publish(session: Session, frame: Frame) -> Reply | Awaitable[Reply]:
    disc = discovery_of(session.ctx)
    b = frame.body
    name = check_name(b.get("name"))
    kind = check_kind(b.get("kind"))
    data = bytes_field(b, "value")
    if len(data) > disc.directory.limits.max_value_bytes:
        disc.directory.publish(name, kind, data, None)  # raises TOO_LARGE, naming the key
    value = decode_value(kind, data)
    ttl = None
    if b.get("ttl_ms") is not None:
        ttl_ms = uint_field(b, "ttl_ms", MAX_TTL_MS)
        if ttl_ms == 0:
            raise BadRequest("field 'ttl_ms' must be positive (omit it: no ttl)")
        ttl = ttl_ms / 1000.0
    region = _local_region(session, value) if isinstance(value, MrDesc) else None
    owner = owner_for(session, b, disc.default_owner)
    disc.directory.publish(name, kind, data, owner, ttl, region)
    if region is not None and not disc.directory.awaits_region(region):
        _watch_region(session, disc.directory, region)
    return _confirmed(disc, name, {"name": name, "owner": owner_name(owner),
                                   "node": disc.directory.node_name})


@handler(Command.LOOKUP)
def lookup(session: Session, frame: Frame) -> Reply | Awaitable[Reply]:
    disc = discovery_of(session.ctx)
    try:
        return Reply(_entry_body(disc.directory.lookup(frame.body.get("name"))))
    except NotFound as exc:
        fetch = disc.backend.fetch(frame.body["name"])
        if fetch is None:
            raise
        missing = exc

    async def from_store() -> Reply:
        got = await fetch
        if got is None:
            raise missing
        kind, data, node = got
        try:
            decode_value(kind, data)
        except TransferdError:
            raise missing from None  # a malformed record is no value
        return Reply({"name": frame.body["name"], "kind": kind, "value": data, "node": node})

    return from_store()


@handler(Command.UNPUBLISH)
def unpublish(session: Session, frame: Frame) -> Reply | Awaitable[Reply]:
    disc = discovery_of(session.ctx)
    name = check_name(frame.body.get("name"))

    def may(e: Entry) -> None:
        # A connection's name is that connection's alone; a lease's, its holders' (as
        # the lease is: docs/protocol.md LEASE); the daemon's, anybody's who knows it.
        if e.owner is not None and e.owner is not session and hasattr(e.owner, "transport"):
            raise BadRequest(f"name {name!r} is owned by another connection "
                             f"({getattr(e.owner, 'peer', '?')}): only it can unpublish it")
        if isinstance(e.owner, Lease) and session not in e.owner.holders:
            raise BadRequest(f"name {name!r} is owned by lease {e.owner.name!r}, which this "
                             "connection has not joined (LEASE with join: true)")

    disc.directory.unpublish(name, may)
    return _confirmed(disc, name, {"name": name})


@handler(Command.PEERS)
def peers(session: Session, frame: Frame) -> Reply:
    disc = discovery_of(session.ctx)
    out = []
    for rec in disc.directory.peers():
        wire = record_to_wire(rec)
        if wire is None:
            disc.directory.ignore("node", f"a malformed node record {str(rec)[:80]}")
            continue
        out.append(wire)
    return Reply({"peers": out, "discovery": disc.status()})


@handler(Command.NAMES)
def names(session: Session, frame: Frame) -> Reply:
    d = discovery_of(session.ctx).directory
    b = frame.body
    prefix = check_prefix(b.get("prefix", ""))
    after = b.get("after", "")
    if not isinstance(after, str):
        raise BadRequest("field 'after' must be a string")
    limit = uint_field(b, "limit", d.limits.max_listing) if b.get("limit") is not None else None
    entries, more = d.listing(prefix, limit or None, after)
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
        d = discovery_of(self.session.ctx).directory
        if self.sub is not None:
            d.unsubscribe(self.sub)
        self.session.send_frame(Command.WATCH, Flag.EVENT | Flag.ERROR, self.seq,
                                error.to_body())
        if self.op is not None:
            ops_of(self.session).finished(self.op, error)
        return True


@handler(Command.WATCH)
def watch(session: Session, frame: Frame) -> Reply:
    d = discovery_of(session.ctx).directory
    b = frame.body
    prefix = check_prefix(b.get("prefix", ""))
    initial = b.get("initial", True)
    if not isinstance(initial, bool):
        raise BadRequest("field 'initial' must be a boolean")
    if frame.no_reply:
        raise BadRequest("WATCH answers with its reply before any EVENT: it cannot be one-way")
    if ops_of(session).get(frame.seq) is not None:
        # Its EVENTs would carry a seq another operation's carry, and CANCEL would
        # end only the first.
        raise BadRequest(f"seq {frame.seq} belongs to an operation still running on this "
                         "connection: a WATCH needs a seq of its own")
    stream = WatchStream(session, frame.seq, d)
    stream.sub = d.subscribe(prefix, session, stream.push)
    n = 0
    if initial:
        after = ""
        while True:  # every visible name under the prefix, as puts, before any change
            entries, more = d.listing(prefix, None, after)
            for e in entries:
                stream.pending.add(e.change(ChangeOp.PUT), True)
                n += 1
            if not more or not entries:
                break
            after = entries[-1].name
    # CANCEL of its seq ends it (EVENT|ERROR CANCELLED, then CANCEL's reply).
    op = Op(frame.seq, "WATCH", stream.stop, with_connection=True)
    stream.op = op
    ops_of(session).add(op, None)
    # The reply goes out when this returns; the stream's EVENTs after it.
    asyncio.get_running_loop().call_soon(stream.release)
    return Reply({"watch": frame.seq, "names": n, "node": d.node_name})

