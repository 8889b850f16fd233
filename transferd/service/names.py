"""The cluster's names through one node: publish, lookup, unpublish, watch, peers, listing.

The :class:`~transferd.service.Service`'s part for names (``service.names``),
called by the RPC handlers (PUBLISH ... NAMES, rpc_server/name_handlers.py) and by
the inproc client alike.  A name is published through this node by one owner, as
a buffer is owned (``owner``: ``"connection"``, ``"daemon"``, or ``lease``; the
default is discovery.default_owner), and goes when that owner goes; a name whose
value is an MrDesc also goes when its region is deregistered.  The directory
(transferd/discovery/) holds them; this module says who may do what.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable
from typing import TYPE_CHECKING, Any

from transferd.discovery.backend import Embedded
from transferd.discovery.directory import Directory, Entry, Subscription
from transferd.discovery.names import check_name, check_prefix
from transferd.discovery.records import Change, Kind, check_kind, decode_value
from transferd.discovery.records import Op as ChangeOp
from transferd.discovery.service import record_to_wire
from transferd.memory.leases import Lease
from transferd.protocol.errors import BadRequest, NotFound, TransferdError
from transferd.protocol.values import MrDesc

from .caller import Caller
from .owners import owner_name

if TYPE_CHECKING:
    from transferd.discovery.service import Discovery

    from .service import Service

# What PUBLISH and UNPUBLISH say: the reply's fields, and whether the store holds it
# (False: etcd is away; written there once it is back).
Confirmed = dict[str, Any] | Awaitable[dict[str, Any]]
# A name looked up: (name, kind, value bytes, node).
Found = tuple[str, str, bytes, str]


class Names:
    def __init__(self, service: Service) -> None:
        self.service = service

    @property
    def discovery(self) -> Discovery:
        return self.service.discovery

    @property
    def directory(self) -> Directory:
        return self.service.discovery.directory

    def owner_gone(self, owner: Hashable) -> None:
        """``owner``'s names go (and its watches: the directory's subscriptions)."""
        if self.service.has_discovery:
            self.directory.owner_gone(owner)

    # -- publish, lookup, unpublish ---------------------------------------------------------

    def publish(self, caller: Caller, name: Any, kind: Any, data: bytes,
                ttl: float | None = None, *, owner: str | None = None,
                lease: str | None = None) -> Confirmed:
        """Publish ``data`` (the encoded value of ``kind``) as ``name``; ``ttl`` seconds
        (None: none).  An MrDesc is published only through the node that holds its
        region, and goes when that region does."""
        disc = self.discovery
        name = check_name(name)
        kind = check_kind(kind)
        if len(data) > disc.directory.limits.max_value_bytes:
            disc.directory.publish(name, kind, data, None)  # raises TOO_LARGE, naming the key
        value = decode_value(kind, data)
        if ttl is not None and not ttl > 0:
            raise BadRequest("field 'ttl_ms' must be positive (omit it: no ttl)")
        region = self._local_region(value) if isinstance(value, MrDesc) else None
        got = self.service.owner_for(caller, owner, lease, disc.default_owner)
        disc.directory.publish(name, kind, data, got, ttl, region)
        if region is not None and not disc.directory.awaits_region(region):
            self._watch_region(disc.directory, region)
        return self._confirmed(name, {"name": name, "owner": owner_name(got),
                                      "node": disc.directory.node_name})

    def _local_region(self, desc: MrDesc) -> Any:
        """The region of this node an MrDesc names (its name goes when the region does)."""
        engine = self.service.engine
        if engine is None:
            raise BadRequest("this daemon runs without the transfer engine: it holds no region "
                             "an MrDesc could name")
        node = desc.node[0]
        if node != engine.node:
            raise BadRequest(f"an MrDesc is published through the daemon that holds its "
                             f"region (node {node:016x}), not this one ({engine.node:016x})")
        try:
            region = engine.regions.by_rkey(desc.rkeys[0][1], 0)
        except NotFound:
            raise NotFound("the MrDesc names no registered region of this daemon "
                           "(deregistered, or its buffer freed)") from None
        if region.ptr != desc.ptr or tuple(k for _, k in desc.rkeys) != region.rkeys:
            raise BadRequest("the MrDesc does not match the region its first rkey names")
        return region

    @staticmethod
    def _watch_region(directory: Directory, region: Any) -> None:
        loop = asyncio.get_running_loop()

        def gone(_: Any) -> None:  # from whichever thread let the region's last write go
            with contextlib.suppress(RuntimeError):  # the loop is gone: so is the directory
                loop.call_soon_threadsafe(directory.region_gone, region)

        region.drained().add_done_callback(gone)

    def _confirmed(self, name: str, body: dict[str, Any]) -> Confirmed:
        """``body`` once the store holds the change (bounded by discovery.timeout_s)."""
        disc = self.discovery
        wait = disc.backend.confirmed(name)
        if wait is None:
            # Embedded: this node is the store.  Else the store is away: written once back.
            body["synced"] = isinstance(disc.backend, Embedded)
            return body

        async def later() -> dict[str, Any]:
            body["synced"] = bool(await wait)
            return body

        return later()

    def lookup(self, name: Any) -> Found | Awaitable[Found]:
        """The value of ``name``: here, or (the mirror lacks it) read from the store now.
        NotFound when it is nowhere."""
        disc = self.discovery
        try:
            e = disc.directory.lookup(name)
            return (e.name, e.kind.value, e.data, e.node)
        except NotFound as exc:
            fetch = disc.backend.fetch(name)
            if fetch is None:
                raise
            missing = exc

        async def from_store() -> Found:
            got = await fetch
            if got is None:
                raise missing
            kind, data, node = got
            try:
                decode_value(kind, data)
            except TransferdError:
                raise missing from None  # a malformed record is no value
            return (name, kind, data, node)

        return from_store()

    def unpublish(self, caller: Caller, name: Any) -> Confirmed:
        """Remove a name published through this node; only its owner (a caller's own, a
        lease's holders, the node's by anybody who knows it) may."""
        name = check_name(name)

        def may(e: Entry) -> None:
            if isinstance(e.owner, Caller) and e.owner is not caller:
                raise BadRequest(f"name {name!r} is owned by another connection "
                                 f"({e.owner.peer}): only it can unpublish it")
            if isinstance(e.owner, Lease) and caller not in e.owner.holders:
                raise BadRequest(f"name {name!r} is owned by lease {e.owner.name!r}, which "
                                 "this connection has not joined (LEASE with join: true)")

        self.directory.unpublish(name, may)
        return self._confirmed(name, {"name": name})

    # -- peers, listing, status -------------------------------------------------------------

    def peers(self) -> list[dict[str, Any]]:
        """The nodes alive, as records (this node's first); malformed ones left out."""
        d = self.directory
        out = []
        for rec in d.peers():
            wire = record_to_wire(rec)
            if wire is None:
                d.ignore("node", f"a malformed node record {str(rec)[:80]}")
                continue
            out.append(wire)
        return out

    def status(self) -> dict[str, Any]:
        return self.discovery.status()

    def listing(self, prefix: Any = "", after: Any = "", limit: int | None = None
                ) -> tuple[list[Entry], bool]:
        prefix = check_prefix(prefix)
        if not isinstance(after, str):
            raise BadRequest("field 'after' must be a string")
        return self.directory.listing(prefix, limit or None, after)

    # -- watches --------------------------------------------------------------------------

    def watch(self, caller: Caller, prefix: Any, push: Callable[[Change, bool], None], *,
              initial: bool = True) -> tuple[Subscription, list[Change]]:
        """Subscribe ``caller`` to the changes under ``prefix``: ``push(change, new)`` for
        each from now on.  With ``initial``, every visible name there now comes first
        (returned, as puts, for the caller to hand on before any change)."""
        d = self.directory
        prefix = check_prefix(prefix)
        if not isinstance(initial, bool):
            raise BadRequest("field 'initial' must be a boolean")
        sub = d.subscribe(prefix, caller, push)
        now: list[Change] = []
        if initial:
            after = ""
            while True:  # every visible name under the prefix, as puts, before any change
                entries, more = d.listing(prefix, None, after)
                now += [e.change(ChangeOp.PUT) for e in entries]
                if not more or not entries:
                    break
                after = entries[-1].name
        return sub, now

    def unwatch(self, sub: Subscription) -> bool:
        return self.directory.unsubscribe(sub)


__all__ = ["Change", "Confirmed", "Found", "Kind", "Names"]
