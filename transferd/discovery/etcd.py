"""The etcd v3 backend: this daemon's node record and names under a kept-alive lease.

Layout under ``discovery.prefix`` (default ``/transferd``)::

    PREFIX/nodes/NODE_NAME   {"v": 1, "name", "node", "addr", "version", "rails", ...}
    PREFIX/names/NAME        {"v": 1, "kind", "value" (base64), "node": NODE_NAME}

Every key this daemon writes hangs on its lease (TTL ``discovery.ttl_s``, kept
alive every ttl/3), so a daemon that dies takes its record and names with it
within the TTL.  A *session* is one stretch of contact: reuse the lease if it is
still alive (else grant one), write the node record, read the whole prefix
(the mirror becomes exactly that, and stale keys of an earlier run of this node
go), then run three loops until one fails: the keepalive (the liveness check),
the watch from the snapshot's revision on (others' puts and deletes into the
mirror), and the writer (each local change, in order, as a guarded txn).

A name belongs to the daemon whose node name is in its record: a put is a txn
that creates the key, or replaces it only where it is this node's (its lease,
or its node name: a restart takes its names back); anything else is a conflict,
refused to the publisher.  A delete only ever deletes this node's key.

When etcd is away the session ends; the daemon keeps its mirror and its own
names and goes on serving them, logs it, sets ``transferd_discovery_up`` to 0,
and tries again with a back-off (0.1 s doubling to ``discovery.retry_max_s``,
with jitter).  Nothing but a publish's confirmation (bounded by
``discovery.timeout_s``) ever waits on etcd.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import random
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from transferd.protocol.errors import BadRequest

from .backend import Backend, State
from .etcd_client import EtcdClient, b64, first_kvs, kv_key, kv_value, prefix_end
from .http import StoreError, TooLarge, Unavailable
from .names import Limits

log = logging.getLogger("transferd.discovery")

# The largest node record mirrored (rails, urls and capabilities are a few hundred bytes).
MAX_RECORD = 16 * 1024
# Keys read per page of the snapshot, and the bytes of one page's reply: 128 of
# the largest records mirrored (MAX_RECORD, base64 in JSON) fit.  A page over
# it holds larger values, which nobody mirrors: it is read again in smaller
# pages, down to one key, and a key too large alone is stepped over, unread.
PAGE = 128
PAGE_BYTES = 4 << 20
# A still-away store is logged again at most this often.
AWAY_LOG_S = 60.0


class Conflict(BadRequest):
    """The name is another node's in etcd."""


class NodeNameTaken(Exception):
    """Another live daemon's lease holds this node name's record."""


def ssl_context(tls: bool, ca_file: str = "", cert_file: str = "",
                key_file: str = "") -> ssl.SSLContext | None:
    if not tls:
        return None
    ctx = ssl.create_default_context(cafile=ca_file or None)
    if cert_file:
        ctx.load_cert_chain(cert_file, key_file or None)
    return ctx


class EtcdBackend(Backend):
    kind = "etcd"

    def __init__(self, client: EtcdClient, *, prefix: str = "/transferd", ttl_s: int = 10,
                 timeout_s: float = 2.0, retry_max_s: float = 5.0, url: str = "") -> None:
        super().__init__()
        self.client = client
        self.url = url
        self.prefix = prefix.rstrip("/")
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.retry_max_s = retry_max_s
        self.state = State.CONNECTING
        self.lease = 0
        self.counts: Counter[str] = Counter()
        self.error = ""
        self.since = time.time()
        self._dirty: dict[str, None] = {}
        # Names of this node that etcd may hold (found in the snapshot, written, or
        # being written): only those need a delete when they go here.
        self._stored: set[str] = set()
        self._writing: str | None = None
        self._record_dirty = False
        self._wake: asyncio.Event | None = None
        self._waiters: dict[str, list[asyncio.Future[bool]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._away_logged = 0.0
        # The unexpected errors logged with their traceback.
        self._tracebacks: set[str] = set()

    # -- keys -----------------------------------------------------------------------------

    def _node_key(self, name: str) -> bytes:
        return f"{self.prefix}/nodes/{name}".encode()

    def _name_key(self, name: str) -> bytes:
        return f"{self.prefix}/names/{name}".encode()

    @property
    def _root(self) -> bytes:
        return f"{self.prefix}/".encode()

    @property
    def _limits(self) -> Limits:
        assert self.directory is not None
        return self.directory.limits

    @property
    def _my(self) -> str:
        assert self.directory is not None
        return self.directory.node_name

    # -- the Backend interface ------------------------------------------------------------

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    def changed(self, name: str) -> None:
        d = self.directory
        if d is not None and name not in d.local and name not in self._stored:
            # Gone before it reached etcd: nothing there to undo.  (So names that come
            # and go while etcd is away queue nothing: the queue is bounded by the
            # names here and those etcd may hold, not by the churn.)
            self._dirty.pop(name, None)
            self._resolve(name, True)
            return
        self._dirty[name] = None
        if self._wake is not None:
            self._wake.set()

    def record_changed(self) -> None:
        self._record_dirty = True
        if self._wake is not None:
            self._wake.set()

    def confirmed(self, name: str) -> Awaitable[bool] | None:
        if self.state is not State.UP:
            return None
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if name not in self._dirty and name != self._writing:
            fut.set_result(True)  # nothing to write: etcd has it as it is here
            return fut
        self._waiters.setdefault(name, []).append(fut)

        async def wait() -> bool:
            try:
                return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            except TimeoutError:
                return False

        return wait()

    def fetch(self, name: str) -> Awaitable[tuple[str, bytes, str] | None] | None:
        if self.state is not State.UP:
            return None

        async def get() -> tuple[str, bytes, str] | None:
            # Published through another daemon a moment ago: its watch event is on
            # its way, the store has it now (a lookup reads its own writes' peers).
            key = self._name_key(name)
            try:
                r = await asyncio.wait_for(self.client.range(key), self.timeout_s)
            except (Unavailable, StoreError, TimeoutError):
                return None
            for kv in r.get("kvs") or ():
                got = self._parse(key, kv)
                rec = self._name_record(key, got[2]) if got is not None else None
                # What the mirror would not hold, a lookup does not answer either.
                if rec is not None and rec[2] != self._my and \
                        len(rec[1]) <= self._limits.max_value_bytes:
                    return rec
            return None

        return get()

    async def close(self) -> None:
        self.state = State.CLOSED
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        self._resolve_all(False)
        if self.lease:
            # Gone at once for the others, not a TTL later.
            with contextlib.suppress(Unavailable, StoreError, TimeoutError):
                await asyncio.wait_for(self.client.revoke(self.lease), 1.0)
        self.client.close()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "backend": self.kind, "state": self.state.value, "url": self.url,
            "endpoint": self.client.where, "since": self.since,
            "lease": f"{self.lease:x}" if self.lease else "", "ttl_s": self.ttl_s,
            "pending": len(self._dirty), "sessions": self.counts["sessions"],
            "failures": self.counts["failures"], "conflicts": self.counts["conflicts"],
        }
        if self.error:
            out["error"] = self.error
        return out

    # -- sessions -------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.1
        while self.state is not State.CLOSED:
            reached = False
            try:
                reached = await self._session()
            except asyncio.CancelledError:
                raise
            except (Unavailable, StoreError) as exc:
                self._away(str(exc))
                reached = self._reached
            except NodeNameTaken as exc:
                self.counts["conflicts"] += 1
                self._away(str(exc), "refused this node", logging.ERROR)
            except Exception as exc:  # a bug must not end discovery for good
                why = f"{type(exc).__name__}: {exc}"
                # Each once (16 at most): a retry loop must not flood the journal.
                if why not in self._tracebacks and len(self._tracebacks) < 16:
                    self._tracebacks.add(why)
                    log.exception("discovery: etcd session failed")
                self._away(why)
                reached = self._reached
            if reached:
                backoff = 0.1
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, self.retry_max_s)

    _reached = False

    def _away(self, why: str, what: str = "", level: int = logging.WARNING) -> None:
        self.counts["failures"] += 1
        self.error = why
        d = self.directory
        known = f"serving the {len(d.local) + len(d.remote)} names and {len(d.nodes)} " \
                "node records known" if d is not None else ""
        now = time.monotonic()
        if self.state is State.UP or self.state is State.CONNECTING:
            was = self.state
            self.state = State.AWAY
            self.since = time.time()
            self._away_logged = now
            what = what or ("lost" if was is State.UP else "unreachable")
            log.log(level, "discovery: etcd %s (%s): %s; retrying every %g s at most",
                    what, why, known, self.retry_max_s)
        elif now - self._away_logged >= AWAY_LOG_S:
            self._away_logged = now
            log.log(level, "discovery: etcd still away (%s) for %.0f s: %s", why,
                    time.time() - self.since, known)
        self._resolve_all(False)

    async def _session(self) -> bool:
        self._reached = False
        c = self.client
        d = self.directory
        assert d is not None
        if self.lease and await c.keepalive(self.lease) <= 0:
            self.lease = 0  # expired while etcd was away: our keys went with it
        if not self.lease:
            self.lease = await c.grant(self.ttl_s)
        await self._put_record()
        revision = await self._snapshot()
        for name in d.local:
            self._dirty[name] = None
        self.counts["sessions"] += 1
        away = time.time() - self.since
        if self.state is State.AWAY:
            log.info("discovery: etcd back at %s after %.1f s: registered as %r again "
                     "(%d local names to write, %d peers, %d names mirrored)", c.where, away,
                     self._my, len(d.local), len(d.nodes), len(d.remote))
        else:
            log.info("discovery: etcd at %s: registered as %r (lease %x, ttl %d s)", c.where,
                     self._my, self.lease, self.ttl_s)
        self.state = State.UP
        self.since = time.time()
        self.error = ""
        self._reached = True
        assert self._wake is not None
        self._wake.set()
        loops = [asyncio.ensure_future(self._keepalive()),
                 asyncio.ensure_future(self._watch(revision + 1)),
                 asyncio.ensure_future(self._writer())]
        try:
            done, _ = await asyncio.wait(loops, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # raises what ended it
            raise Unavailable("a discovery loop ended")
        finally:
            for t in loops:
                t.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    async def _put_record(self) -> None:
        """Write this node's record: create it, or replace it where this lease (or no
        lease: a record written by hand) holds it; another live lease holding it is
        another daemon under this node name, whose record is left alone."""
        d = self.directory
        assert d is not None
        self._record_dirty = False

        def taken(kv: dict[str, Any]) -> Exception | None:
            held = str(kv.get("lease", "0") or "0")
            if held in ("0", str(self.lease)):
                return None
            return NodeNameTaken(
                f"node name {self._my!r} is registered by another daemon that keeps its "
                f"lease alive (lease {int(held):x}, {self._urls_of(kv)}): "
                "discovery.node_name must be unique in the cluster; this one serves its own "
                "clients and registers once the name is free (a daemon of this name that "
                "died frees it within its ttl)")

        await self._guarded_put(b64(self._node_key(self._my)),
                                b64(json.dumps(d.record).encode()), taken,
                                f"node record {self._my!r}")

    async def _guarded_put(self, key: str, value: str,
                           refuse: Callable[[dict[str, Any]], Exception | None],
                           what: str) -> None:
        """Put ``key`` (base64) on this lease: create it, or replace the one there
        unless ``refuse(kv)`` gives the error to raise instead."""
        c = self.client
        put = {"request_put": {"key": key, "value": value, "lease": str(self.lease)}}
        for _ in range(4):
            r = await c.txn([{"target": "CREATE", "key": key, "create_revision": "0"}], [put],
                            [{"request_range": {"key": key}}])
            if r.get("succeeded"):
                return
            kvs = first_kvs(r)
            if not kvs:
                continue  # deleted meanwhile: create it again
            kv = kvs[0]
            refused = refuse(kv)
            if refused is not None:
                raise refused
            r = await c.txn([{"target": "MOD", "key": key,
                              "mod_revision": str(kv.get("mod_revision", "0"))}], [put])
            if r.get("succeeded"):
                return
        raise Unavailable(f"{what}: etcd kept changing under us")

    def _urls_of(self, kv: dict[str, Any]) -> str:
        try:
            urls = json.loads(kv_value(kv)).get("urls")
        except (ValueError, AttributeError, RecursionError):  # (nested past the stack)
            urls = None
        if isinstance(urls, list) and urls:
            return "at " + ", ".join(str(u)[:100] for u in urls[:4])
        return "at an unknown address"

    async def _snapshot(self) -> int:
        """Read the whole prefix into the mirror; stale keys of this node go.  Its revision."""
        d = self.directory
        assert d is not None
        c = self.client
        start, end = self._root, prefix_end(self._root)
        names: list[tuple[str, Any, bytes, str]] = []
        nodes: list[tuple[str, dict[str, Any]]] = []
        stale: list[tuple[bytes, int]] = []
        stored: set[str] = set()
        cap = d.limits.max_cluster_names + d.limits.max_nodes + 1
        seen = 0
        page = PAGE
        # The snapshot's revision: every page is read at it (and the watch goes on from it).
        r = await c.range(start, end, limit=1, keys_only=True)
        revision = int(r.get("header", {}).get("revision", 0))
        while True:
            try:
                r = await c.range(start, end, limit=page, revision=revision,
                                  max_response=PAGE_BYTES)
            except TooLarge:
                if page > 1:
                    page = max(1, page // 8)
                    continue
                # One key alone is over the bound: step over it, unread.
                r = await c.range(start, end, limit=1, revision=revision, keys_only=True)
                kvs = r.get("kvs") or []
                if not kvs:
                    break
                d.ignore("record", f"a record over {PAGE_BYTES} bytes at "
                                   f"{kv_key(kvs[0])[:80]!r}")
                start = kv_key(kvs[0]) + b"\0"
                continue
            page = min(PAGE, page * 2)
            kvs = r.get("kvs") or []
            for kv in kvs:
                seen += 1
                key = kv_key(kv)
                got = self._parse(key, kv)
                if got is None:
                    continue
                kind, name, body = got
                if kind == "node":
                    if name == self._my:
                        # Our own key under another lease: another daemon wrote there
                        # after our put (as the watch would tell, had it begun).
                        if str(kv.get("lease", "0")) != str(self.lease):
                            self._duplicate(name, body.get("node"))
                    elif self._node_record(key, name, body):
                        nodes.append((name, body))
                    continue
                rec = self._name_record(key, body)
                if rec is None:
                    continue
                if rec[2] == self._my:
                    if name not in d.local:  # an earlier run's: not ours any more
                        stale.append((key, int(kv.get("mod_revision", 0))))
                    else:
                        stored.add(name)
                else:
                    names.append((name, *rec))
            if not r.get("more") or not kvs or seen >= cap:
                if r.get("more") and seen >= cap:
                    log.warning("discovery: over %d keys under %s: the rest not mirrored",
                                cap, self.prefix)
                break
            start = kv_key(kvs[-1]) + b"\0"
        d.nodes_reset(nodes)
        d.remote_reset(names)
        for key, mod in stale:
            await c.txn([{"target": "MOD", "key": b64(key), "mod_revision": str(mod)}],
                        [{"request_delete_range": {"key": b64(key)}}])
        # What etcd holds of ours is known now: the deletes queued while it was away are
        # done above (or were never needed); every local name is written again next.
        self._stored = stored
        for name in [n for n in self._dirty if n not in d.local]:
            del self._dirty[name]
            self._resolve(name, True)
        return revision

    def _parse(self, key: bytes, kv: dict[str, Any]) -> tuple[str, str, Any] | None:
        """("node" | "name", its name, the record) of a key under the prefix; None: not ours."""
        root = self._root
        if not key.startswith(root):
            return None
        rest = key[len(root):].decode(errors="replace")
        section, _, name = rest.partition("/")
        if section not in ("nodes", "names") or not name:
            return None
        raw = kv_value(kv)
        d = self.directory
        assert d is not None
        if len(raw) > MAX_RECORD:
            d.ignore("record", f"a record of {len(raw)} bytes at {key[:80]!r}")
            return None
        try:
            body = json.loads(raw) if raw else {}
        except (ValueError, RecursionError):  # not JSON, or nested past the stack
            body = None
        if not isinstance(body, dict):
            d.ignore("json", f"a record that is not a JSON object at {key[:80]!r}")
            return None
        return ("node" if section == "nodes" else "name"), name, body

    def _name_record(self, key: bytes, body: dict[str, Any]) -> tuple[str, bytes, str] | None:
        """(kind, value, node) of a name's record; None (counted) when a field is not
        what this daemon writes: a record is data from whoever can write to etcd."""
        kind, value, node = body.get("kind"), body.get("value"), body.get("node")
        if isinstance(kind, str) and isinstance(value, str) and isinstance(node, str):
            try:
                return kind, base64.b64decode(value, validate=True), node
            except ValueError:  # binascii.Error
                pass
        assert self.directory is not None
        self.directory.ignore("malformed", f"a malformed name record at {key[:80]!r}")
        return None

    def _node_record(self, key: bytes, name: str, body: dict[str, Any]) -> bool:
        """Whether a node record can be shown (PEERS); its name is the key's, whatever
        it says (no record passes for another node's by its contents)."""
        from .service import record_to_wire

        body["name"] = name
        if record_to_wire(body) is not None:
            return True
        assert self.directory is not None
        self.directory.ignore("node", f"a malformed node record at {key[:80]!r}")
        return False

    # -- the three loops ------------------------------------------------------------------

    async def _keepalive(self) -> None:
        period = self.ttl_s / 3
        while True:
            await asyncio.sleep(period)
            if await self.client.keepalive(self.lease) <= 0:
                raise Unavailable(f"lease {self.lease:x} expired")

    async def _watch(self, revision: int) -> None:
        d = self.directory
        assert d is not None
        async for res in self.client.watch(self._root, prefix_end(self._root), revision):
            if res.get("canceled"):
                why = res.get("cancel_reason") or "compacted"
                raise Unavailable(f"the watch was cancelled ({why})")
            for ev in res.get("events") or ():
                kv = ev.get("kv") or {}
                key = kv_key(kv)
                if ev.get("type") == "DELETE":
                    self._deleted(key)
                else:
                    self._put(key, kv)

    def _put(self, key: bytes, kv: dict[str, Any]) -> None:
        d = self.directory
        assert d is not None
        got = self._parse(key, kv)
        if got is None:
            return
        kind, name, body = got
        theirs = str(kv.get("lease", "0")) != str(self.lease)
        if kind == "node":
            if name == self._my:
                if theirs:
                    # Not put back: two daemons doing so would overwrite each other forever.
                    self._duplicate(name, body.get("node"))
                return
            if self._node_record(key, name, body):
                d.node_put(name, body)
            return
        rec = self._name_record(key, body)
        if rec is None:
            return
        if rec[2] != self._my:
            d.remote_put(name, *rec)
        elif theirs:
            self._duplicate(self._my, f"a name {name!r} of another lease")
        # else: the echo of our own write

    _duplicate_logged = False

    def _duplicate(self, name: str, what: Any) -> None:
        self.counts["conflicts"] += 1
        if not self._duplicate_logged:
            self._duplicate_logged = True
            log.error("discovery: another daemon (%r) writes as node %r: discovery.node_name "
                      "must be unique in the cluster", what, name)

    def _deleted(self, key: bytes) -> None:
        d = self.directory
        assert d is not None
        root = self._root
        if not key.startswith(root):
            return
        section, _, name = key[len(root):].decode(errors="replace").partition("/")
        if section == "nodes":
            if name == self._my:
                self.record_changed()  # deleted by hand, or our lease revoked: put back
                return
            d.node_delete(name)
        elif section == "names":
            d.remote_delete(name)
            if name in d.local:
                self.changed(name)  # ours, removed behind our back: written again

    async def _writer(self) -> None:
        wake = self._wake
        assert wake is not None
        while True:
            await wake.wait()
            wake.clear()
            if self._record_dirty:
                await self._put_record()
            while self._dirty:
                name = next(iter(self._dirty))
                del self._dirty[name]
                waiters = self._waiters.pop(name, [])
                self._writing = name
                try:
                    await self._sync(name)
                except Conflict as exc:
                    self.counts["conflicts"] += 1
                    d = self.directory
                    assert d is not None
                    self._stored.discard(name)  # nothing of ours to delete there
                    e = d.local.get(name)
                    if e is not None:
                        log.warning("discovery: %s: dropped here", exc.message)
                        d._drop_local(e)
                    for w in waiters:
                        if not w.done():
                            w.set_exception(exc)
                    continue
                except BaseException:
                    self._dirty[name] = None  # written in the next session
                    self._waiters.setdefault(name, []).extend(waiters)
                    raise
                finally:
                    self._writing = None
                for w in waiters:
                    if not w.done():
                        w.set_result(True)

    async def _sync(self, name: str) -> None:
        """Make etcd hold ``name`` as the directory has it now (ours, or absent)."""
        d = self.directory
        assert d is not None
        c = self.client
        key = b64(self._name_key(name))
        e = d.local.get(name)
        if e is None or not e.alive():
            r = await c.txn([{"target": "LEASE", "key": key, "lease": str(self.lease)}],
                            [{"request_delete_range": {"key": key}}],
                            [{"request_range": {"key": key}}])
            kvs = [] if r.get("succeeded") else first_kvs(r)
            if kvs and self._holder(kvs[0]) == self._my:  # an earlier run's lease
                await c.txn([{"target": "MOD", "key": key,
                              "mod_revision": str(kvs[0].get("mod_revision", "0"))}],
                            [{"request_delete_range": {"key": key}}])
            if name not in d.local:  # (published again meanwhile: written next)
                self._stored.discard(name)
            return
        self._stored.add(name)  # before the put: a delete meanwhile must follow it
        value = b64(json.dumps({"v": 1, "kind": e.kind.value, "value": b64(e.data),
                                "node": self._my}).encode())

        def theirs(kv: dict[str, Any]) -> Exception | None:
            holder = self._holder(kv)
            if str(kv.get("lease", "0")) == str(self.lease) or holder == self._my:
                return None
            return Conflict(f"name {name!r} is published through node {holder!r}: "
                            "unpublish it there first, or pick another name")

        await self._guarded_put(key, value, theirs, f"name {name!r}")

    def _holder(self, kv: dict[str, Any]) -> str:
        try:
            body = json.loads(kv_value(kv))
        except (ValueError, RecursionError):  # not JSON, or nested past the stack
            return "?"
        return str(body.get("node", "?")) if isinstance(body, dict) else "?"

    def _resolve(self, name: str, value: bool) -> None:
        for w in self._waiters.pop(name, ()):
            if not w.done():
                w.set_result(value)

    def _resolve_all(self, value: bool) -> None:
        waiters, self._waiters = self._waiters, {}
        for ws in waiters.values():
            for w in ws:
                if not w.done():
                    w.set_result(value)
