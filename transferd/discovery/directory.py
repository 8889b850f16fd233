"""The daemon's directory: names with their owners, the cluster's mirror, watchers.

Two tables.  ``local``: the names published through this daemon, each with
its owner (a connection, a lease, or ``None`` for the daemon: opaque here, as
buffers' owners are), an optional ttl, and for an MrDesc the region it names.
``remote``: what the backend says other daemons published (empty with the
embedded backend).  A name visible here is the local entry, else the remote
one; watchers hear every change of what is visible under their prefix.

Everything is bounded by :class:`~.names.Limits`: names per owner and per
daemon, the value's size, the mirror's names and nodes, watches.  Nothing here
does I/O: the backend (``backend.changed(name)``) carries local changes out and
calls :meth:`remote_put` and friends with what comes in, on the daemon's loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from transferd.protocol.errors import BadRequest, NotFound, OverLimit

from .backend import Backend, Embedded
from .names import Limits, check_name, check_prefix, check_text
from .records import Change, Kind, Op, decode_value

log = logging.getLogger("transferd.discovery")


@dataclass(eq=False)
class Entry:
    name: str
    kind: Kind
    data: bytes
    # The node name of the daemon it was published through.
    node: str
    local: bool = True
    # Local entries only: who owns it (None: the daemon), its ttl timer, the
    # region an MrDesc names (the name goes when the region is deregistered).
    owner: Hashable | None = field(default=None, repr=False)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    region: Any = field(default=None, repr=False)

    def change(self, op: Op) -> Change:
        return Change(op, self.name, decode_value(self.kind, self.data), self.node)

    def alive(self) -> bool:
        """False once the region an MrDesc names is deregistered (its rkeys revoked)."""
        return self.region is None or not getattr(self.region, "closed", False)


def _ended(change: Change, new: bool) -> None:
    """An ended subscription's deliver (never called: ``ended`` is checked first)."""


@dataclass(eq=False)
class Subscription:
    prefix: str
    owner: Hashable
    # deliver(change, new): ``new`` when the name was not visible before a put (a
    # watcher that has not seen the put yet may drop both it and a later delete).
    deliver: Callable[[Change, bool], None]
    ended: bool = False


class Directory:
    def __init__(self, node_name: str, limits: Limits | None = None,
                 loop: asyncio.AbstractEventLoop | None = None,
                 backend: Backend | None = None) -> None:
        self.node_name = node_name
        self.limits = limits or Limits()
        self._loop = loop
        self.local: dict[str, Entry] = {}
        self.remote: dict[str, Entry] = {}
        # Node records by node name: this daemon's own, and the others' (mirror).
        self.record: dict[str, Any] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self._owned: Counter[Hashable | None] = Counter()
        self._by_region: dict[int, set[str]] = {}
        # Regions whose end is awaited (one callback each, however often names are
        # published on them), by id; each held until it ends (region_gone).
        self._awaited: dict[int, Any] = {}
        self._subs: list[Subscription] = []
        self._subs_of: Counter[Hashable] = Counter()
        # Remote entries refused for a bound (logged once per kind of refusal).
        self.ignored = 0
        self._warned: set[str] = set()
        self.backend: Backend = backend or Embedded()
        self.backend.attach(self)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    # -- what clients see ---------------------------------------------------------------

    def visible(self, name: str) -> Entry | None:
        e = self.local.get(name)
        if e is not None:
            if e.alive():
                return e
            self._drop_local(e)  # its region went before the callback came: gone now
        return self.remote.get(name)

    def lookup(self, name: Any) -> Entry:
        check_name(name)
        e = self.visible(name)
        if e is None:
            raise NotFound(f"no name {name!r} (never published, unpublished, or its owner "
                           "is gone)")
        return e

    def listing(self, prefix: str = "", limit: int | None = None,
                after: str = "") -> tuple[list[Entry], bool]:
        """The visible names under ``prefix``, sorted, after ``after``; and whether more."""
        check_prefix(prefix)
        limit = min(limit or self.limits.max_listing, self.limits.max_listing)
        names = sorted({n for n in (*self.local, *self.remote)
                        if n.startswith(prefix) and n > after})
        out: list[Entry] = []
        for i, n in enumerate(names):
            e = self.visible(n)
            if e is None:
                continue
            if len(out) == limit:
                return out, i < len(names)
            out.append(e)
        return out, False

    def peers(self) -> list[dict[str, Any]]:
        """Node records: this daemon's first, then the others', by name."""
        out = [dict(self.record, local=True)] if self.record else []
        for name in sorted(self.nodes):
            if name != self.node_name:
                out.append(dict(self.nodes[name], local=False))
        return out

    # -- local names ----------------------------------------------------------------------

    def publish(self, name: str, kind: Kind, data: bytes, owner: Hashable | None,
                ttl: float | None = None, region: Any = None) -> Entry:
        check_name(name)
        lim = self.limits
        if len(data) > lim.max_value_bytes:
            raise OverLimit(f"a value of {len(data)} bytes is over discovery.max_value_bytes "
                            f"({lim.max_value_bytes})")
        old = self.local.get(name)
        if old is not None and old.owner is not owner:
            if old.alive():
                raise BadRequest(f"name {name!r} is published by another owner here "
                                 f"({_owner_text(old.owner)}): unpublish it there first, or "
                                 "pick another name")
            self._drop_local(old)
            old = None
        if old is None:
            if len(self.local) >= lim.max_names:
                raise OverLimit(f"{len(self.local)} names published through this daemon: "
                                f"the most it holds (discovery.max_names)")
            if self._owned[owner] >= lim.max_names_per_owner:
                raise OverLimit(f"{self._owned[owner]} names published by this owner: the "
                                "most one owner may hold (discovery.max_names_per_owner)")
        remote = self.remote.get(name)
        if remote is not None and remote.node != self.node_name:
            raise BadRequest(f"name {name!r} is published through node {remote.node!r}: "
                             "unpublish it there first, or pick another name")
        before = self.visible(name)
        entry = Entry(name, kind, bytes(data), self.node_name, True, owner)
        if old is not None:
            self._unbind(old)
        else:
            self._owned[owner] += 1
        self.local[name] = entry
        if region is not None:
            entry.region = region
            self._by_region.setdefault(id(region), set()).add(name)
        if ttl is not None:
            entry.timer = self.loop.call_later(ttl, self._expired, entry)
        self._changed(name, before)
        self.backend.changed(name)
        return entry

    def unpublish(self, name: str, may: Callable[[Entry], None] | None = None) -> Entry:
        """Remove a local name; ``may(entry)`` raises when the caller may not."""
        check_name(name)
        e = self.local.get(name)
        if e is None or not e.alive():
            if e is not None:
                self._drop_local(e)
            r = self.remote.get(name)
            if r is not None:
                raise BadRequest(f"name {name!r} was published through node {r.node!r}: "
                                 "only its owner there can unpublish it")
            raise NotFound(f"no name {name!r} published through this daemon")
        if may is not None:
            may(e)
        self._drop_local(e)
        return e

    def owner_gone(self, owner: Hashable) -> int:
        """``owner`` (a connection, a lease) is gone: so are its names and its watches."""
        for sub in [s for s in self._subs if s.owner is owner]:
            self.unsubscribe(sub)
        if not self._owned.get(owner):
            return 0
        gone = [e for e in self.local.values() if e.owner is owner]
        for e in gone:
            self._drop_local(e)
        return len(gone)

    def awaits_region(self, region: Any) -> bool:
        """Whether the end of ``region`` is awaited already; from now on it is."""
        if id(region) in self._awaited:
            return True
        self._awaited[id(region)] = region
        return False

    def region_gone(self, region: Any) -> int:
        if self._awaited.get(id(region)) is region:
            del self._awaited[id(region)]
        names = self._by_region.pop(id(region), set())
        n = 0
        for name in names:
            e = self.local.get(name)
            if e is not None and e.region is region:
                self._drop_local(e)
                n += 1
        return n

    def close(self) -> None:
        for e in list(self.local.values()):
            if e.timer is not None:
                e.timer.cancel()
        for sub in list(self._subs):
            self.unsubscribe(sub)

    def _expired(self, entry: Entry) -> None:
        entry.timer = None
        if self.local.get(entry.name) is entry:
            self._drop_local(entry)

    def _drop_local(self, e: Entry) -> None:
        if self.local.get(e.name) is not e:
            return
        del self.local[e.name]
        self._unbind(e)
        self._owned[e.owner] -= 1
        if self._owned[e.owner] <= 0:
            del self._owned[e.owner]
        self._changed(e.name, e)
        self.backend.changed(e.name)

    def _unbind(self, e: Entry) -> None:
        if e.timer is not None:
            e.timer.cancel()
            e.timer = None
        if e.region is not None:
            names = self._by_region.get(id(e.region))
            if names is not None:
                names.discard(e.name)
                if not names:
                    del self._by_region[id(e.region)]

    # -- what the backend brings in ----------------------------------------------------

    def remote_put(self, name: str, kind: Any, data: bytes, node: str) -> bool:
        """Another daemon's name (from the backend); False when refused by a bound."""
        try:
            check_name(name)
            check_text(node, "node")  # shown by NAMES and in logs, as the name is
            k = Kind(kind)
            decode_value(k, data)
        except (ValueError, BadRequest):
            return self.ignore("malformed", f"a malformed name record {name[:64]!r}")
        if len(data) > self.limits.max_value_bytes:
            return self.ignore("value", f"name {name!r} from {node!r}: a value of {len(data)} "
                                "bytes, over discovery.max_value_bytes")
        if name not in self.remote and len(self.remote) >= self.limits.max_cluster_names:
            return self.ignore("names", f"the cluster holds over discovery.max_cluster_names "
                                f"({self.limits.max_cluster_names}) names: {name!r} not mirrored")
        before = self.visible(name)
        self.remote[name] = Entry(name, k, bytes(data), node, local=False)
        self._changed(name, before)
        return True

    def remote_delete(self, name: str) -> None:
        if name not in self.remote:
            return
        before = self.visible(name)
        del self.remote[name]
        self._changed(name, before)

    def remote_reset(self, entries: Iterable[tuple[str, Any, bytes, str]]) -> None:
        """The backend's full view (after a (re)connect): the mirror becomes exactly that."""
        fresh: set[str] = set()
        for name, kind, data, node in entries:
            if self.remote_put(name, kind, data, node):
                fresh.add(name)
        for name in [n for n in self.remote if n not in fresh]:
            self.remote_delete(name)

    def node_put(self, name: str, record: dict[str, Any]) -> bool:
        if name not in self.nodes and len(self.nodes) >= self.limits.max_nodes:
            return self.ignore("nodes", f"over discovery.max_nodes ({self.limits.max_nodes}) "
                                f"node records: {name!r} not mirrored")
        self.nodes[name] = record
        return True

    def node_delete(self, name: str) -> None:
        self.nodes.pop(name, None)

    def nodes_reset(self, records: Iterable[tuple[str, dict[str, Any]]]) -> None:
        self.nodes.clear()
        for name, record in records:
            self.node_put(name, record)

    def ignore(self, why: str, text: str) -> bool:
        self.ignored += 1
        if why not in self._warned:  # once per kind: a flood of records is not a flood of logs
            self._warned.add(why)
            log.warning("discovery: %s (further ones are counted, not logged)", text)
        return False

    # -- watchers ----------------------------------------------------------------------

    def subscribe(self, prefix: str, owner: Hashable,
                  deliver: Callable[[Change, bool], None]) -> Subscription:
        check_prefix(prefix)
        lim = self.limits
        if len(self._subs) >= lim.max_watches:
            raise OverLimit(f"{len(self._subs)} watches on this daemon: the most it holds "
                            "(discovery.max_watches)")
        if self._subs_of[owner] >= lim.max_watches_per_connection:
            raise OverLimit(f"{self._subs_of[owner]} watches on this connection: the most one "
                            "holds (discovery.max_watches_per_connection)")
        sub = Subscription(prefix, owner, deliver)
        self._subs.append(sub)
        self._subs_of[owner] += 1
        return sub

    def unsubscribe(self, sub: Subscription) -> bool:
        if sub.ended:
            return False
        sub.ended = True
        # Its deliver is never called again; it is a method of what holds this
        # subscription (a WATCH's stream), a reference cycle otherwise, left for the
        # cyclic collector at every unwatch and every close of a watching connection.
        sub.deliver = _ended
        self._subs.remove(sub)
        self._subs_of[sub.owner] -= 1
        if self._subs_of[sub.owner] <= 0:
            del self._subs_of[sub.owner]
        return True

    @property
    def watches(self) -> int:
        return len(self._subs)

    def _changed(self, name: str, before: Entry | None) -> None:
        after = self.visible(name)
        if after is before or not self._subs:
            return
        if after is not None:
            change = after.change(Op.PUT)
        else:
            assert before is not None
            change = before.change(Op.DELETE)
        new = before is None
        for sub in list(self._subs):
            if not sub.ended and name.startswith(sub.prefix):
                try:
                    sub.deliver(change, new)
                except Exception:  # one watcher's failure is not the publisher's
                    log.exception("discovery: a watcher failed")

    # -- counts -------------------------------------------------------------------------

    def owned_by(self, owner: Hashable | None) -> int:
        return self._owned.get(owner, 0)


def _owner_text(owner: Hashable | None) -> str:
    if owner is None:
        return "the daemon"
    return str(getattr(owner, "peer", None) or "a connection")

