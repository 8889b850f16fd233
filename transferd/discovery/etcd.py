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
import contextlib
import json
import logging
import random
import ssl
import time
from collections import Counter
from collections.abc import Awaitable
from typing import Any

from transferd.protocol.errors import BadRequest

from .backend import Backend, State
from .etcd_client import EtcdClient, b64, first_kvs, kv_key, kv_value, prefix_end, unb64
from .http import StoreError, Unavailable

log = logging.getLogger("transferd.discovery")

# The largest node record mirrored (rails, urls and capabilities are a few hundred bytes).
MAX_RECORD = 16 * 1024
# Keys read per page of the snapshot.
PAGE = 1000
# A still-away store is logged again at most this often.
AWAY_LOG_S = 60.0


class Conflict(BadRequest):
    """The name is another node's in etcd."""


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
        self._record_dirty = False
        self._wake: asyncio.Event | None = None
        self._waiters: dict[str, list[asyncio.Future[bool]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._away_logged = 0.0

    # -- keys -----------------------------------------------------------------------------

    def _node_key(self, name: str) -> bytes:
        return f"{self.prefix}/nodes/{name}".encode()

    def _name_key(self, name: str) -> bytes:
        return f"{self.prefix}/names/{name}".encode()

    @property
    def _root(self) -> bytes:
        return f"{self.prefix}/".encode()

    @property
    def _my(self) -> str:
        assert self.directory is not None
        return self.directory.node_name

    # -- the Backend interface ------------------------------------------------------------

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    def changed(self, name: str) -> None:
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
                if got is not None and got[2].get("node") != self._my:
                    body = got[2]
                    return str(body.get("kind")), unb64(body.get("value")), \
                        str(body.get("node", ""))
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
            except Exception as exc:  # a bug must not end discovery for good
                log.exception("discovery: etcd session failed")
                self._away(f"{type(exc).__name__}: {exc}")
                reached = self._reached
            if reached:
                backoff = 0.1
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, self.retry_max_s)

    _reached = False

    def _away(self, why: str) -> None:
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
            what = "lost" if was is State.UP else "unreachable"
            log.warning("discovery: etcd %s (%s): %s; retrying every %g s at most",
                        what, why, known, self.retry_max_s)
        elif now - self._away_logged >= AWAY_LOG_S:
            self._away_logged = now
            log.warning("discovery: etcd still away (%s) for %.0f s: %s", why,
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
        d = self.directory
        assert d is not None
        self._record_dirty = False
        raw = json.dumps(d.record).encode()
        await self.client.put(self._node_key(self._my), raw, self.lease)

    async def _snapshot(self) -> int:
        """Read the whole prefix into the mirror; stale keys of this node go.  Its revision."""
        d = self.directory
        assert d is not None
        c = self.client
        start, end = self._root, prefix_end(self._root)
        revision = 0
        names: list[tuple[str, Any, bytes, str]] = []
        nodes: list[tuple[str, dict[str, Any]]] = []
        stale: list[tuple[bytes, int]] = []
        cap = d.limits.max_cluster_names + d.limits.max_nodes + 1
        seen = 0
        while True:
            r = await c.range(start, end, limit=PAGE, revision=revision)
            revision = revision or int(r.get("header", {}).get("revision", 0))
            kvs = r.get("kvs") or []
            for kv in kvs:
                seen += 1
                key = kv_key(kv)
                got = self._parse(key, kv)
                if got is None:
                    continue
                kind, name, body = got
                if kind == "node":
                    if name != self._my:
                        nodes.append((name, body))
                elif body.get("node") == self._my:
                    if name not in d.local:  # an earlier run's: not ours any more
                        stale.append((key, int(kv.get("mod_revision", 0))))
                else:
                    names.append((name, body.get("kind"), unb64(body.get("value")),
                                  str(body.get("node", ""))))
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
        except ValueError:
            body = None
        if not isinstance(body, dict):
            d.ignore("json", f"a record that is not a JSON object at {key[:80]!r}")
            return None
        return ("node" if section == "nodes" else "name"), name, body

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
            d.node_put(name, body)
        elif body.get("node") != self._my:
            d.remote_put(name, body.get("kind"), unb64(body.get("value")),
                         str(body.get("node", "")))
        elif theirs:
            self._duplicate(self._my, f"a name {name!r} of another lease")
        # else: the echo of our own write

    _duplicate_logged = False

    def _duplicate(self, name: str, what: Any) -> None:
        self.counts["conflicts"] += 1
        if not self._duplicate_logged:
            self._duplicate_logged = True
            log.error("discovery: another daemon (%s) writes as node %r: discovery.node_name "
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
                try:
                    await self._sync(name)
                except Conflict as exc:
                    self.counts["conflicts"] += 1
                    d = self.directory
                    assert d is not None
                    e = d.local.get(name)
                    if e is not None:
                        log.warning("discovery: %s: dropped here", exc.message)
                        d._drop_local(e)
                        self._dirty.pop(name, None)  # nothing of ours to delete there
                    for w in waiters:
                        if not w.done():
                            w.set_exception(exc)
                    continue
                except BaseException:
                    self._dirty[name] = None  # written in the next session
                    self._waiters.setdefault(name, []).extend(waiters)
                    raise
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
            return
        value = b64(json.dumps({"v": 1, "kind": e.kind.value, "value": b64(e.data),
                                "node": self._my}).encode())
        put = {"request_put": {"key": key, "value": value, "lease": str(self.lease)}}
        for _ in range(4):
            r = await c.txn([{"target": "CREATE", "key": key, "create_revision": "0"}], [put],
                            [{"request_range": {"key": key}}])
            if r.get("succeeded"):
                return
            kvs = first_kvs(r)
            if not kvs:
                continue  # deleted meanwhile: try to create it again
            kv = kvs[0]
            holder = self._holder(kv)
            if str(kv.get("lease", "0")) != str(self.lease) and holder != self._my:
                raise Conflict(f"name {name!r} is published through node {holder!r}: "
                               "unpublish it there first, or pick another name")
            r = await c.txn([{"target": "MOD", "key": key,
                              "mod_revision": str(kv.get("mod_revision", "0"))}], [put])
            if r.get("succeeded"):
                return
        raise Unavailable(f"name {name!r}: etcd kept changing under us")

    def _holder(self, kv: dict[str, Any]) -> str:
        try:
            body = json.loads(kv_value(kv))
        except ValueError:
            return "?"
        return str(body.get("node", "?")) if isinstance(body, dict) else "?"

    def _resolve_all(self, value: bool) -> None:
        waiters, self._waiters = self._waiters, {}
        for ws in waiters.values():
            for w in ws:
                if not w.done():
                    w.set_result(value)
