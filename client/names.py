"""Names on the client: publish, lookup, unpublish, watch, peers (the cluster's directory).

::

    await c.publish("prefill-3/kv", desc)            # an MrDesc, a NetAddr or bytes
    desc = await c.lookup("prefill-3/kv")            # NotFound when absent
    async with c.watch("prefill-") as changes:       # puts and deletes, with the value
        async for change in changes: ...
    nodes = await c.peers()                          # the daemons alive

A published name belongs to an owner on the daemon it was published through:
this connection by default (discovery.default_owner), ``owner="daemon"``, or
``lease=NAME``; it goes when its owner goes, after ``ttl`` seconds if given,
and (an MrDesc's) when its region is deregistered.  Where the names live (this
daemon alone, or etcd for the cluster) is the daemon's ``[discovery] url``;
docs/discovery.md is the guide, docs/protocol.md the wire reference.

:class:`Names` is the client's part for these commands: it takes the
connection, and :class:`client.Client` delegates to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transferd.discovery.backlog import Backlog
from transferd.discovery.records import Change, Peer, Value, decode_value, encode_value
from transferd.protocol.constants import Command
from transferd.protocol.errors import (
    BadFrame,
    BadRequest,
    Cancelled,
    ConnectionLost,
    NotFound,
    OverLimit,
    TransferdError,
    UnknownCommand,
    error_from_body,
)
from transferd.protocol.frames import Frame

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger("transferd.client")


@dataclass(frozen=True)
class Published:
    """What PUBLISH said: the owner, the node it went through, whether the store holds it
    (False: the daemon's etcd is away; the name is written there once it is back)."""

    name: str
    owner: str
    node: str
    synced: bool


@dataclass(frozen=True)
class NameInfo:
    """One row of :meth:`Names.names`: a name, its value's kind and size, its node."""

    name: str
    kind: str
    node: str
    size: int


# A name's ttl in ms is a u32 on the wire (49 days).
MAX_TTL_MS = 0xFFFFFFFF


def _ttl_ms(ttl: Any) -> int:
    """``ttl`` seconds as PUBLISH's ttl_ms; BadRequest for what no ttl can be."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl) \
            or ttl <= 0:
        raise BadRequest(f"ttl must be a positive number of seconds (None: no ttl), not "
                         f"{ttl!r}")
    ms = max(1, round(ttl * 1000))  # under a millisecond: the shortest there is
    if ms > MAX_TTL_MS:
        raise BadRequest(f"ttl of {ttl:g} s is over the most a name's ttl can be "
                         f"({MAX_TTL_MS // 1000} s, 49 days)")
    return ms


class Names:
    def __init__(self, conn: Connection, *, flush: Callable[[], Awaitable[None]] | None = None,
                 timeout: float | None = None, features: list[str] | None = None) -> None:
        self.conn = conn
        self._flush = flush
        self.timeout = timeout
        self.served = features is None or "names" in features
        # WATCH seq -> its stream, for the EVENTs (weakly: a watch nobody refers to
        # any more ends itself, see Watch).
        self.watches: weakref.WeakValueDictionary[int, Watch] = weakref.WeakValueDictionary()

    def _check(self) -> None:
        if not self.served:
            raise UnknownCommand("this daemon serves no names (HELLO lists no 'names': an "
                                 "older daemon, or --protocol-minor 1)")

    async def _request(self, cmd: Command, body: dict[str, Any], *, flush: bool = False
                       ) -> Frame:
        self._check()
        if flush and self._flush is not None:
            # A flush point: writes queued before a publish are out before the name is,
            # so whoever looks the name up finds them in place.
            await self._flush()
        return await self.conn.request(cmd, body, timeout=self.timeout)

    async def publish(self, name: str, value: Value, ttl: float | None = None, *,
                      owner: str | None = None, lease: str | None = None) -> Published:
        kind, raw = encode_value(value)
        body: dict[str, Any] = {"name": name, "kind": kind.value, "value": raw}
        if ttl is not None:
            body["ttl_ms"] = _ttl_ms(ttl)
        if owner is not None:
            body["owner"] = owner
        if lease is not None:
            body["lease"] = lease
        r = (await self._request(Command.PUBLISH, body, flush=True)).body
        return Published(str(r.get("name", name)), str(r.get("owner", "")),
                         str(r.get("node", "")), bool(r.get("synced", False)))

    async def lookup(self, name: str) -> Value:
        r = (await self._request(Command.LOOKUP, {"name": name})).body
        return decode_value(r.get("kind"), r.get("value") or b"")

    async def unpublish(self, name: str) -> bool:
        """Remove a name published through this daemon; whether the store confirmed it."""
        r = (await self._request(Command.UNPUBLISH, {"name": name}, flush=True)).body
        return bool(r.get("synced", False))

    async def peers(self) -> list[Peer]:
        r = (await self._request(Command.PEERS, {})).body
        rows = r.get("peers") or []
        try:
            if not isinstance(rows, list):
                raise TypeError
            return [Peer.from_body(p) for p in rows]
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            raise BadFrame(f"the server's PEERS reply is not a list of peer records: "
                           f"{str(rows)[:100]}") from None

    async def discovery_status(self) -> dict[str, Any]:
        """Where the daemon's names live and whether that store is reachable now."""
        r = (await self._request(Command.PEERS, {})).body
        status = r.get("discovery") or {}
        if not isinstance(status, dict):
            raise BadFrame(f"the server's PEERS reply: 'discovery' is {str(status)[:40]!r}, "
                           "not a map")
        return dict(status)

    async def names(self, prefix: str = "", limit: int | None = None) -> list[NameInfo]:
        """The names under ``prefix`` (sorted), page after page, at most ``limit``."""
        out: list[NameInfo] = []
        after = ""
        while limit is None or len(out) < limit:
            body: dict[str, Any] = {"prefix": prefix, "after": after}
            if limit is not None:
                body["limit"] = limit - len(out)
            r = (await self._request(Command.NAMES, body)).body
            rows = r.get("names") or []
            try:
                if not isinstance(rows, list):
                    raise TypeError
                page = [NameInfo(str(n["name"]), str(n.get("kind", "")),
                                 str(n.get("node", "")), int(n.get("size", 0)))
                        for n in rows]
            except (TypeError, ValueError, KeyError, AttributeError):
                raise BadFrame(f"the server's NAMES reply is not a list of names: "
                               f"{str(rows)[:100]}") from None
            # Sorted, every one past 'after': a page that does not move on would be asked
            # for again and again (a lying server's, this list growing without end).
            if any(n.name <= prev for prev, n in zip([after] + [p.name for p in page], page,
                                                    strict=False)):
                raise BadFrame(f"the server's NAMES reply after {after!r} is not sorted past "
                               "it: the listing would not end")
            out += page
            if not r.get("more") or not rows:
                break
            after = out[-1].name
        return out

    def watch(self, prefix: str = "", *, initial: bool = True) -> Watch:
        """Changes of the names under ``prefix``; with ``initial`` every name there now
        comes first, as a put.  ``async for change in c.watch(p)``, best inside
        ``async with`` (leaving it ends the watch on the daemon)."""
        self._check()
        return Watch(self, prefix, initial)

    # -- events ----------------------------------------------------------------------------

    def on_event(self, frame: Frame) -> bool:
        if frame.cmd != Command.WATCH:
            return False
        w = self.watches.get(frame.seq)
        if w is None:
            return True  # a watch that ended here: its last EVENTs are nobody's failure
        if frame.is_error:
            w._end(error_from_body(frame.body, seq=frame.seq, fatal=False))
        else:
            try:
                w._push(Change.from_body(frame.body), bool(frame.body.get("new")))
            except (TransferdError, ValueError, KeyError) as exc:
                log.warning("watch %r: a change that does not parse: %s", w.prefix, exc)
        return True

    def lost(self, exc: TransferdError) -> None:
        watches, self.watches = self.watches, weakref.WeakValueDictionary()
        for w in list(watches.values()):
            w._end(ConnectionLost(exc.message))


class Watch:
    """A stream of :class:`Change`; an async iterator and an async context manager.

    Changes the daemon sent and the caller has not taken yet wait here one per
    name (the latest, in the place of the first), as on the daemon: a slow reader
    loses intermediate values of a name, never its last state, and a name that
    came and went before the caller took its put is not told at all.  So what
    waits is bounded by the names under the prefix, whatever their churn.

    Leaving ``async for`` early (``break``) without ``async with`` or
    :meth:`close`: once nothing refers to the watch any more, it ends on the
    daemon by itself (a CANCEL is sent), so the connection's watches do not add up.
    """

    # The most changes (names) that wait here: past it the watch ends with OVER_LIMIT (a
    # server streaming ever new names, or far more than the daemon's own caps allow).
    max_pending = 1 << 20

    def __init__(self, names: Names, prefix: str, initial: bool) -> None:
        self.names = names
        self.prefix = prefix
        self.initial = initial
        self.seq = 0
        # How many names were under the prefix when it started (with ``initial``).
        self.count = 0
        self._pending = Backlog()
        self._wake: asyncio.Event | None = None
        self._error: TransferdError | None = None
        self._started = False
        self._closed = False
        self._finalizer: weakref.finalize | None = None

    async def start(self) -> Watch:
        if self._started:
            return self
        self._started = True
        self._wake = asyncio.Event()
        n = self.names
        fut = n.conn.request(Command.WATCH, {"prefix": self.prefix, "initial": self.initial},
                             timeout=n.timeout)
        self.seq = n.conn.last_seq
        n.watches[self.seq] = self  # before the reply: EVENTs follow it at once
        try:
            reply = await fut
        except BaseException:
            n.watches.pop(self.seq, None)
            raise
        self.count = int(reply.body.get("names", 0))
        if self._error is not None:
            return self  # ended already (its EVENTs came with the reply)
        # Dropped without close(): CANCEL it then (holds neither self nor the Names).
        self._finalizer = weakref.finalize(self, _abandoned, n.conn, self.seq,
                                           asyncio.get_running_loop())
        self._finalizer.atexit = False
        return self

    def _push(self, change: Change, new: bool = False) -> None:
        self._pending.add(change, new)
        if len(self._pending) > self.max_pending:
            # As the daemon ends a watch its connection lags on: over, and ended there too.
            self._pending.clear()
            if self._finalizer is not None:
                self._finalizer.detach()
            _abandoned(self.names.conn, self.seq, asyncio.get_running_loop())  # CANCEL
            self._end(OverLimit(f"watch {self.prefix!r}: over {self.max_pending} changes "
                                "wait here unread; watch again"))
        if self._wake is not None:
            self._wake.set()

    def _end(self, error: TransferdError) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()  # ended on the daemon: nothing to cancel
        if self._error is None:
            self._error = error
        self.names.watches.pop(self.seq, None)
        if self._wake is not None:
            self._wake.set()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> Change:
        await self.start()
        assert self._wake is not None
        while True:
            if len(self._pending):
                return self._pending.take()[0]
            if self._error is not None or self._closed:
                if self._closed or isinstance(self._error, Cancelled):
                    raise StopAsyncIteration
                raise self._error  # type: ignore[misc]
            self._wake.clear()
            await self._wake.wait()

    async def next(self, timeout: float | None = None) -> Change:
        """The next change, or TimeoutError after ``timeout`` seconds."""
        return await asyncio.wait_for(self.__anext__(), timeout)

    async def close(self) -> None:
        """End the watch on the daemon (CANCEL of its seq); what waited here is dropped."""
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        self._pending.clear()
        if self._wake is not None:
            self._wake.set()
        n = self.names
        if self.seq and self._error is None and n.conn.lost is None:
            with contextlib.suppress(NotFound, ConnectionLost):
                await n.conn.request(Command.CANCEL, {"seq": self.seq}, timeout=n.timeout)
        n.watches.pop(self.seq, None)

    aclose = close

    async def __aenter__(self) -> Watch:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<Watch {self.prefix!r} seq={self.seq} waiting={len(self._pending)}>"


def _abandoned(conn: Connection, seq: int, loop: asyncio.AbstractEventLoop) -> None:
    """A started watch was dropped: end it on the daemon, unless it ended already."""

    def cancel() -> None:
        if conn.lost is not None:
            return
        fut = conn.request(Command.CANCEL, {"seq": seq})
        # NOT_FOUND (it had ended), or the connection's end: nobody is waiting for either.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    with contextlib.suppress(RuntimeError):  # the loop is closed: so is the connection
        loop.call_soon_threadsafe(cancel)


class SyncWatch:
    """:class:`Watch` for :class:`client.SyncClient`: a blocking iterator."""

    def __init__(self, run: Callable[[Any], Any], watch: Watch) -> None:
        self._run = run
        self.watch = watch

    def __iter__(self) -> SyncWatch:
        return self

    def __next__(self) -> Change:
        try:
            return self._run(self.watch.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def next(self, timeout: float | None = None) -> Change:
        return self._run(self.watch.next(timeout))

    def close(self) -> None:
        self._run(self.watch.close())

    def __enter__(self) -> SyncWatch:
        self._run(self.watch.start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
