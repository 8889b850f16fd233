"""The engine in the test's own process (``Client.connect("inproc://")``) as a peer of
real daemons and of other inproc engines: inproc -> daemon, daemon -> inproc and
inproc -> inproc, over tcp and over chaos (out of order, every write in pieces), single
and paged writes, scatter, barrier and messages, every byte checked by checksum.  The
daemons are the session's trios (engine_cluster.py: they prove the cluster secret;
so does each inproc engine, from the same engine.secret_file)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client import Client, Completion, MrDesc, Pages, ScatterDst, SharedBuffer
from client.inproc import InprocClient
from tests.helpers import REPO, async_test, digest, metric, pattern, scrape
from tests.integration import engine_cluster
from tests.integration.engine_cluster import (
    HANDSHAKE_TIMEOUT_S,
    RAILS,
    TRIOS,
    WAIT,
    Cluster,
    MiB,
    client_url,
    engine_env,
    fresh_imm,
    secret_file,
    settle,
    start_many,
    verified,
)
from transferd.protocol.errors import (
    BadRequest,
    Cancelled,
    ConnectionLost,
    NotFound,
    OutOfBounds,
    OutOfMemory,
    TransferdError,
    UnknownCommand,
)

clusters = engine_cluster.clusters

# Rails of the inproc engines (loopback aliases no trio uses).
INPROC_RAILS = (("127.0.0.12", "127.0.0.13"), ("127.0.0.14", "127.0.0.15"))


def inproc_overrides(domain: str, n: int = 0) -> dict[str, Any]:
    """The engine settings a trio of ``domain`` runs with, for an inproc engine."""
    trio = {"tcp": "tcp", "chaos": "chaos"}[domain]
    _, engine = TRIOS[trio]
    out: dict[str, Any] = {
        "engine.host_rails": ",".join(INPROC_RAILS[n]), "engine.domain": domain,
        "engine.secret_file": secret_file(), "engine.handshake_timeout_s": HANDSHAKE_TIMEOUT_S,
        "engine.chaos_seed": 40 + n}
    out.update({f"engine.{k}": v for k, v in engine.items()})
    return out


@contextlib.asynccontextmanager
async def inproc(domain: str, n: int = 0) -> AsyncIterator[InprocClient]:
    c = await Client.connect("inproc://", overrides=inproc_overrides(domain, n), timeout=WAIT)
    assert isinstance(c, InprocClient)
    try:
        yield c
    finally:
        await asyncio.wait_for(c.close(), WAIT)


class Side:
    """One end of an exchange: a client, and how it makes a region of known bytes."""

    def __init__(self, client: Client, own_memory: bool) -> None:
        self.client = client
        # An inproc side registers the test's own numpy arrays (no copy into node memory).
        self.own_memory = own_memory
        self.arrays: list[np.ndarray] = []
        self.buffers: list[Any] = []

    async def region(self, size: int, seed: int | None = None) -> tuple[Any, Any, Any]:
        data = pattern(size, seed) if seed is not None else bytes(size)
        if self.own_memory:
            assert isinstance(self.client, InprocClient)
            arr = np.frombuffer(bytearray(data), dtype=np.uint8)
            self.arrays.append(arr)
            buf = await self.client.register_memory(arr)
        else:
            buf = await self.client.alloc_buffer(size)
            if seed is not None:
                await self.client.set_tensor(buf.tensor(), data)
        self.buffers.append(buf)
        mr, desc = await self.client.reg_mr(buf)
        return buf, mr, desc

    async def read(self, buf: Any) -> bytes:
        return bytes(await self.client.get_tensor(buf.tensor()))

    async def close(self) -> None:
        for buf in self.buffers:
            with contextlib.suppress(Exception):
                await self.client.free_buffer(buf)


# Each client's received messages.  One pool of receives per client: the engine hands a
# connection's messages to the callback of its first SUBMIT_RECVS (engine/receives.py).
_INBOXES: dict[int, tuple[Client, list[bytes]]] = {}


def inbox(client: Client) -> list[bytes]:
    got = _INBOXES.get(id(client))
    if got is None or got[0] is not client:
        box: list[bytes] = []
        client.submit_recvs(64 * 1024, 64, box.append)
        got = _INBOXES[id(client)] = (client, box)
    return got[1]


async def exchange(src: Side, dsts: list[Side]) -> None:
    """Writes of every kind from ``src`` into each of ``dsts``, checked by checksum."""
    size = 2 * MiB
    page = 16 * 1024
    sbuf, smr, _ = await src.region(size, seed=5)
    want_src = await src.read(sbuf)
    regions = [await d.region(size) for d in dsts]
    imm = fresh_imm()
    expects = [await d.client.expect_imm_count(imm, 1 + 8 + 1, wait=False) for d in dsts]
    done: list[Completion] = []
    wants: list[bytearray] = []
    for _, _, desc in regions:
        want = bytearray(size)
        # One single write of 1 MiB (sharded over both rails, in pieces under chaos).
        done.append(await src.client.submit_single_write(MiB, imm, (smr, 0), (desc, 0)))
        want[:MiB] = want_src[:MiB]
        # Eight pages, scattered backwards into the upper half.
        n = 8
        src_pages = Pages(list(range(n)), page, MiB)
        dst_pages = Pages(list(reversed(range(n))), page, MiB)
        done.append(await src.client.submit_paged_writes(
            page, imm, (smr, src_pages), (desc, dst_pages)))
        for i in range(n):
            j = n - 1 - i
            want[MiB + j * page: MiB + (j + 1) * page] = \
                want_src[MiB + i * page: MiB + (i + 1) * page]
        wants.append(want)
    # A scatter of one more slice to each destination, then a barrier over all of them.
    group = await src.client.add_peer_group(
        [await d.client.main_address() for d in dsts])
    tail = size - 4096
    scatter = [ScatterDst(4096, tail, (desc, tail)) for _, _, desc in regions]
    done.append(await src.client.submit_scatter(group, imm, smr, scatter))
    for want in wants:
        want[tail:] = want_src[tail:]
    assert await settle(done) == [None] * len(done)
    assert await settle(expects) == [None] * len(expects)
    bimm = fresh_imm()
    barriers = [await d.client.expect_imm_count(bimm, 1, wait=False) for d in dsts]
    await (await src.client.submit_barrier(group, bimm, [desc for _, _, desc in regions])
           ).wait(WAIT)
    assert await settle(barriers) == [None] * len(barriers)
    for d, (buf, _, _), want in zip(dsts, regions, wants, strict=True):
        assert digest(await d.read(buf)) == digest(want)
        if d.own_memory:  # the bytes landed in the test's own array, where it lies
            assert digest(d.arrays[-1]) == digest(want)
    # Messages: each destination posts receives and gets one message, byte for byte.
    for i, d in enumerate(dsts):
        got = inbox(d.client)
        got.clear()
        msg = pattern(60_000, 90 + i)
        await (await src.client.submit_send(await d.client.main_address(), msg)).wait(WAIT)
        for _ in range(int(WAIT * 100)):
            if got:
                break
            await asyncio.sleep(0.01)
        assert got and digest(got[0]) == digest(msg)


DOMAINS = ("tcp", "chaos")
own_daemons = engine_cluster.own_daemons


@pytest.mark.parametrize("domain", DOMAINS)
@async_test(timeout=90)
async def test_inproc_writes_to_daemons(domain: str, clusters: Callable[[str], Cluster]
                                        ) -> None:
    cl = clusters(domain)
    async with inproc(domain) as me:
        b = await Client.connect(client_url(cl.b), timeout=WAIT)
        c = await Client.connect(client_url(cl.c), timeout=WAIT)
        sides = [Side(b, False), Side(c, False)]
        src = Side(me, True)
        try:
            await exchange(src, sides)
        finally:
            for s in (src, *sides):
                await s.close()
            await b.close()
            await c.close()
    cl.check_alive("after an inproc engine wrote to it and went")


@pytest.mark.parametrize("domain", DOMAINS)
@async_test(timeout=90)
async def test_daemons_write_to_inproc(domain: str, clusters: Callable[[str], Cluster]
                                       ) -> None:
    cl = clusters(domain)
    async with inproc(domain) as me:
        a = await Client.connect(client_url(cl.a), timeout=WAIT)
        src = Side(a, False)
        # One destination in the test's own memory, one in the inproc node's.
        dst_own, dst_node = Side(me, True), Side(me, False)
        try:
            await exchange(src, [dst_own])
            await exchange(src, [dst_node])
        finally:
            for s in (src, dst_own, dst_node):
                await s.close()
            await a.close()
    cl.check_alive("after it wrote to an inproc engine that went")


@pytest.mark.parametrize("domain", DOMAINS)
@async_test(timeout=90)
async def test_inproc_to_inproc(domain: str) -> None:
    async with inproc(domain, 0) as one, inproc(domain, 1) as two:
        sides = [Side(one, True), Side(two, True), Side(two, False), Side(one, False)]
        try:
            await exchange(sides[0], [sides[1]])
            await exchange(sides[2], [sides[3]])
        finally:
            for s in sides:
                await s.close()


# -- a process holding an inproc engine ends: the daemons it talked to are left clean -----


def _links(url: str, name: str, **labels: str) -> float:
    return sum(v for k, v in scrape(url).items() if k.split("{", 1)[0] == name
               and all(f'{lk}="{lv}"' in k for lk, lv in labels.items()))


@pytest.mark.parametrize("end", ["close", "exit", "kill"])
@async_test(timeout=90)
async def test_a_process_using_inproc_that_ends_leaves_the_daemon_clean(end: str) -> None:
    """The process wrote 4 x 64 KiB (counted once each) and took a write from the
    daemon; then it closes, returns without closing, or is SIGKILLed.  The daemon drops
    its links both ways, counts nothing again, refuses writes into the gone process's
    region with a typed error, and serves on."""
    [d] = start_many([{"env": engine_env(["127.0.0.30"], secret_file=secret_file(),
                                         handshake_timeout_s=HANDSHAKE_TIMEOUT_S)}])
    proc: subprocess.Popen[str] | None = None
    try:
        assert d.metrics_url is not None
        b = await Client.connect(d.url, timeout=WAIT)
        region = await b.alloc_buffer(MiB)
        mr, desc = await b.reg_mr(region)
        imm, writes = fresh_imm(), 4
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.inproc_peer", secret_file(), "127.0.0.31",
             desc.to_bytes().hex(), str(imm), str(writes), end],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdin is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), WAIT)
        assert line, proc.stderr.read() if proc.stderr else ""
        said = json.loads(line)
        # Every write landed and counted once; then consumed, so the count is 0.
        await asyncio.wait_for(b.expect_imm_count(imm, writes), WAIT)
        assert await b.imm_count(imm) == 0
        got = await b.get_tensor(region.tensor(0, writes * 64 * 1024))
        for i in range(writes):
            assert hashlib.sha256(got[i * 65536:(i + 1) * 65536]).hexdigest() == said["sha256"]
        # The daemon writes into the process's own memory (its link to it is up).
        theirs = MrDesc.from_bytes(bytes.fromhex(said["desc"]))
        await (await b.submit_single_write(4096, None, (mr, 0), (theirs, 0))).wait(WAIT)
        assert _links(d.metrics_url, "transferd_engine_inbound_links") >= 1
        assert _links(d.metrics_url, "transferd_engine_links", state="ready") >= 1
        if end == "kill":
            proc.kill()
        else:
            proc.stdin.write("\n")
            proc.stdin.flush()
        rc = await asyncio.to_thread(proc.wait, WAIT)
        assert rc == (-signal.SIGKILL if end == "kill" else 0), proc.stderr.read() \
            if proc.stderr else ""
        # Its links to the daemon are gone; nothing it sent is counted again.
        assert await poll_value(lambda: _links(d.metrics_url or "",
                                               "transferd_engine_inbound_links"), 0) == 0
        assert await b.imm_count(imm) == 0
        # Its region is unknown now: a write there fails, typed, and bounded.
        [err] = await settle([await b.submit_single_write(4096, None, (mr, 0), (theirs, 0),
                                                          timeout=10)])
        assert isinstance(err, TransferdError), err
        assert await poll_value(lambda: _links(d.metrics_url or "", "transferd_engine_links",
                                               state="ready"), 0) == 0
        # And the daemon serves on: a fresh region, a local round trip.
        await b.set_tensor(region.tensor(0, 4), b"live")
        assert bytes(await b.get_tensor(region.tensor(0, 4))) == b"live"
        await b.close()
        assert d.alive()
        assert "Traceback" not in d.stderr and " ERROR " not in d.stderr, d.output()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        d.stop()


async def poll_value(fn: Callable[[], float], want: float, timeout: float = WAIT) -> float:
    """``fn()`` until it returns ``want`` (bounded); its last value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        v = fn()
        if v == want or loop.time() > deadline:
            return v
        await asyncio.sleep(0.05)


# -- the same API, typed where it has no meaning -------------------------------------------


@async_test(timeout=60)
async def test_what_has_no_meaning_in_process_is_refused_typed() -> None:
    for url, kw in [("inproc://", {"token": "x"}), ("inproc://", {"tls_ca": "/ca.pem"}),
                    ("inproc://?colour=red", {}), ("inproc://host/path", {}),
                    ("inproc://?metrics_port=http", {})]:
        with pytest.raises(BadRequest):
            await Client.connect(url, **kw)
    async with inproc("tcp") as me:
        with pytest.raises(BadRequest, match="read-only"):
            await me.register_memory(b"immutable bytes")
        with pytest.raises(BadRequest, match="contiguous"):
            await me.register_memory(np.zeros((8, 8), dtype=np.uint8)[:, ::2])
        with pytest.raises(UnknownCommand):
            await me.copy_from_device((0, 0, 1), None)
        with pytest.raises(UnknownCommand):
            me.conn.request()
        # Out of bounds, unknown ids, bad imm: the daemon's own errors, from the Service.
        buf = await me.alloc_buffer(4096)
        with pytest.raises(OutOfBounds):
            await me.set_tensor((buf.id, 4090, 10), b"0123456789")
        with pytest.raises(NotFound):
            await me.get_tensor((buf.id + 1000, 0, 1))
        mr, desc = await me.reg_mr(buf)
        # Checked before anything is queued; the Completion's error, as over the wire.
        [err] = await settle([await me.submit_single_write(8192, None, (mr, 0), (desc, 0))])
        assert isinstance(err, OutOfBounds), err
        with pytest.raises(BadRequest):
            await me.expect_imm_count(1 << 33, 1)
        # A caller's bytearray is held (not resizable) while registered, and let go after.
        own = bytearray(4096)
        reg = await me.register_memory(own)
        with pytest.raises(BufferError):
            own.extend(b"x")
        await me.free_buffer(reg)
        own.extend(b"x")
        # Cancel: an expectation ends CANCELLED, once.
        c = await me.expect_imm_count(fresh_imm(), 1, wait=False)
        assert await c.cancel() is True
        with pytest.raises(Cancelled):
            await c
        assert await c.cancel() is False
    # Closed: every call says so, typed.
    with pytest.raises(ConnectionLost):
        await me.alloc_buffer(10)


@async_test(timeout=60)
async def test_inproc_metrics_are_off_by_default_and_exported_on_request() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    async with inproc("tcp") as me:
        assert me.metrics_url is None
    mine = CollectorRegistry()
    c = await Client.connect("inproc://?metrics_port=0", registry=mine,
                             overrides=inproc_overrides("tcp"))
    assert isinstance(c, InprocClient)
    try:
        buf = await c.alloc_buffer(MiB)
        assert c.metrics_url is not None
        page = await asyncio.to_thread(scrape, c.metrics_url)
        assert metric(page, "transferd_buffer_allocated_bytes", device="cpu") >= MiB
        assert b"transferd_buffer_allocated_bytes" in generate_latest(mine)
        await c.free_buffer(buf)
    finally:
        await c.close()
    assert b"transferd_buffer_allocated_bytes" not in generate_latest(mine)  # unregistered at close


def test_sync_client_runs_the_engine_on_its_thread() -> None:
    from client import SyncClient

    with SyncClient.connect("inproc://", overrides=inproc_overrides("tcp")) as one, \
            SyncClient.connect("inproc://", overrides=inproc_overrides("tcp", 1)) as two:
        src = np.frombuffer(bytearray(pattern(MiB, 3)), dtype=np.uint8)
        dst = np.zeros(MiB, dtype=np.uint8)
        smr, _ = one.reg_mr(one.register_memory(src))
        _, desc = two.reg_mr(two.register_memory(dst))
        imm = fresh_imm()
        one.wait(one.submit_single_write(MiB, imm, (smr, 0), (desc, 0)), WAIT)
        two.wait(two.expect_imm_count(imm, 1, wait=False), WAIT)
        assert digest(dst) == digest(src)


def test_a_sync_inproc_engine_reads_its_config_file(tmp_path: Path) -> None:
    """``config=`` (the keyword, and ``?config=`` in the URL) is the daemon's TOML file:
    its rails are where the engine listens, its memory limit bounds the buffers."""
    from client import SyncClient

    path = tmp_path / "transferd.toml"
    rails = INPROC_RAILS[0]
    path.write_text(f'[engine]\nhost_rails = {list(rails)!r}\n'.replace("'", '"')
                    + f'secret_file = "{secret_file()}"\n[memory]\nhost_limit_mib = 2\n')
    for how in ("keyword", "query"):
        url, kw = (("inproc://", {"config": str(path)}) if how == "keyword"
                   else (f"inproc://?config={path}", {}))
        with SyncClient.connect(url, **kw) as me:
            hosts = [r.decode().rsplit(":", 1)[0] for r in me.main_address().rails]
            assert hosts == list(rails), how
            me.free_buffer(me.alloc_buffer(MiB))
            with pytest.raises(OutOfMemory, match="over the largest buffer"):
                me.alloc_buffer(3 * MiB)


# -- the engine suites with an inproc engine in the first daemon's place ------------------

# Tests about the first daemon itself (its rails, its process, a second client of it, a
# stranger dialling it) or that block the test's loop while a peer is stopped (the inproc
# engine runs on that loop): they do not apply with an inproc engine in its place.
NOT_FOR_INPROC = (
    "tests/integration/test_engine_writes.py::test_main_address_and_registration",
    "tests/integration/test_engine_writes.py::test_rails_each_bind_their_own_address",
)
SUITES = ("tests/integration/test_engine_writes.py", "tests/integration/test_engine_peers.py",
          "tests/integration/test_engine_reads.py")


def test_the_engine_suites_pass_with_an_inproc_engine_in_place_of_a_daemon() -> None:
    """tests/integration/engine_cluster.py's ``nodes`` gives the first daemon's place to
    an inproc engine of the same settings (TRANSFERD_TEST_INPROC=1): every write, paged
    write, scatter, barrier, send and count of those suites, tcp and chaos, checksummed,
    goes from (or to) the test's own process."""
    deselect = [f"--deselect={t}" for t in NOT_FOR_INPROC]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *deselect,
         *SUITES], env={**os.environ, "TRANSFERD_TEST_INPROC": "1"}, capture_output=True,
        text=True, timeout=300, cwd=REPO)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail


@async_test(timeout=60)
async def test_the_rest_of_the_api_in_process() -> None:
    """Tensors and the queue, leases, names and their watch, peers, UVM watchers, stats:
    the same results as a daemon's client gets, from the same Service."""
    async with inproc("tcp") as me:
        assert {d["name"] for d in await me.get_devices()} >= {"cpu"}
        buf = await me.alloc_buffer(8192)
        await me.buffer_clear(buf, 7)
        assert bytes(await me.get_tensor(buf.tensor(0, 4))) == b"\x07" * 4
        # The queue: writes and reads run at the flush, in order.
        me.set_tensor_async(buf.tensor(0, 4), b"abcd")
        f = me.get_tensor_async(buf.tensor(0, 4))
        assert not f.done()
        me.set_tensor_async(buf.tensor(0, 4), b"wxyz")
        await me.flush()
        assert bytes(f.result()) == b"abcd"
        await me.copy_tensor(buf.tensor(0, 4), buf.tensor(4096, 4))
        assert bytes(await me.get_tensor(buf.tensor(4096, 4))) == b"wxyz"
        assert bytes(buf.view(4096, 4)) == b"wxyz"  # the node's memory, in this process
        await me.synchronize()
        assert me.stats()["commands"]["SET_TENSOR"] == 2
        listing = await me.server_stats()
        assert any(b["id"] == buf.id for b in listing["buffers"])
        # Leases: a buffer the lease owns goes when it ends.
        async with me.lease("inproc-lease", 30) as lease:
            owned = await lease.alloc_buffer(4096)
        with pytest.raises(NotFound):
            await me.get_tensor(owned.tensor(0, 1))
        # Names: publish an MrDesc of this node, watch it, look it up, unpublish it.
        _, desc = await me.reg_mr(buf)
        async with me.watch("inproc/") as changes:
            got = await me.publish("inproc/kv", desc)
            assert got.owner == "connection" and got.synced
            change = await changes.next(WAIT)
            assert change.name == "inproc/kv" and change.value == desc
            assert await me.lookup("inproc/kv") == desc
            assert [n.name for n in await me.names("inproc/")] == ["inproc/kv"]
            await me.unpublish("inproc/kv")
            gone = await changes.next(WAIT)
            assert gone.name == "inproc/kv" and gone.op.value == "delete"
        with pytest.raises(NotFound):
            await me.lookup("inproc/kv")
        [peer] = await me.peers()
        assert peer.addr == await me.main_address() and peer.capabilities.get("inproc")
        # A UVM watcher's word, set in this process, seen by the node's watcher thread.
        seen: list[tuple[int, int]] = []
        w = await me.alloc_uvm_watcher(lambda old, new: seen.append((old, new)))
        w.set(5)
        for _ in range(int(WAIT * 100)):
            if seen:
                break
            await asyncio.sleep(0.01)
        assert seen == [(0, 5)] and w.value == 5
        # Shared memory: the type a daemon's client returns, over the node's pages.
        sh = await me.alloc_shared(4096)
        assert isinstance(sh, SharedBuffer)
        sh.view[0:4] = b"shm!"
        assert bytes(await me.get_tensor(sh.tensor(0, 4))) == b"shm!"
        await me.set_tensor(sh.tensor(4, 4), b"back")
        assert bytes(sh.array[4:8]) == b"back" and bytes(sh.local(0, 8)) == b"shm!back"
        with pytest.raises(OutOfBounds):
            sh.local(4090, 10)
        sh.unmap()  # (nothing mapped: the bytes stay the node's until freed)
        assert bytes(sh.view[0:4]) == b"shm!"
        await me.free_buffer(sh)
        with pytest.raises(NotFound):
            sh.view  # noqa: B018 - the property is the call under test


@pytest.mark.skipif(not (importlib.util.find_spec("opentelemetry")
                         and importlib.util.find_spec("opentelemetry.sdk")),
                    reason="the otel extra is not installed (pip install 'transferd[otel]')")
@async_test(timeout=60)
async def test_an_inproc_engine_exports_spans_as_log_otel_says(tmp_path: Path) -> None:
    """log.otel is read by an inproc engine as by a daemon: a traced write between two
    engines of this process has its spans (transfer, parts, landings) in log.otel_file;
    once the last engine closes, the spans are flushed and off again."""
    from transferd import tracing

    out = tmp_path / "spans.jsonl"
    otel = {"log.otel": "console", "log.otel_file": str(out)}
    tid = secrets.token_hex(16)
    clients = [await Client.connect("inproc://", overrides={**inproc_overrides("tcp", n),
                                                            **otel}, timeout=WAIT)
               for n in (0, 1)]
    one, two = clients
    try:
        src_buf = await one.alloc_buffer(64 * 1024)
        await one.set_tensor(src_buf.tensor(), pattern(64 * 1024, 9))
        src, _ = await one.reg_mr(src_buf)
        dst_buf = await two.alloc_buffer(64 * 1024)
        _, desc = await two.reg_mr(dst_buf)
        c = await one.submit_single_write(64 * 1024, None, (src, 0), (desc, 0),
                                          traceparent=f"00-{tid}-{'3' * 16}-01")
        assert await settle([c]) == [None]
        assert bytes(await two.get_tensor(dst_buf.tensor())) == pattern(64 * 1024, 9)
    finally:
        for c_ in clients:
            await asyncio.wait_for(c_.close(), WAIT)
    assert tracing.SPANS is None  # the last engine out turned them off, flushed
    spans = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    names = {s["name"] for s in spans if s["context"]["trace_id"] == f"0x{tid}"}
    assert {"transferd.single", "transferd.part", "transferd.land"} <= names, spans


def _sum(d: Any, name: str) -> float:
    """A counter of daemon ``d`` over all its labels."""
    return sum(v for k, v in scrape(d.metrics_url or "").items() if k.split("{", 1)[0] == name)


async def _verified(src: Side, dst: Side, n: int = 30, size: int = 64 * 1024) -> int:
    """``n`` verified writes of ``size`` from ``src`` to ``dst`` over a path that corrupts
    some pieces in flight: each one that succeeds is byte-exact and counted once, each
    that does not failed with the checksum's error; how many succeeded."""
    sbuf, smr, _ = await src.region(n * size, seed=17)
    want = await src.read(sbuf)
    dbuf, _, ddesc = await dst.region(n * size)
    imm = fresh_imm()
    ok = await verified([await src.client.submit_single_write(
        size, imm, (smr, i * size), (ddesc, i * size), verify=True) for i in range(n)])
    for _ in range(int(WAIT * 20)):
        if await dst.client.imm_count(imm) == len(ok):
            break
        await asyncio.sleep(0.05)
    assert await dst.client.imm_count(imm) == len(ok)
    got = await dst.read(dbuf)
    for i in ok:
        assert digest(got[i * size:(i + 1) * size]) == digest(want[i * size:(i + 1) * size]), i
    assert await src.read(sbuf) == want  # the source is never touched
    return len(ok)


@async_test(timeout=120)
async def test_verified_writes_between_inproc_and_a_daemon_over_a_corrupting_path(
        own_daemons: list[Any]) -> None:
    """Checksums with an inproc engine at either end (issue 21 over issue 20): over chaos
    with engine.chaos_corrupt on both the inproc engine and the daemon, verified writes
    each way land byte-exact (the caller's own memory on the inproc side) or fail with
    the checksum's error, and the mismatches are counted where they were found."""
    (d,) = start_many([{"env": engine_env(RAILS["a"], "chaos", chaos_corrupt=0.05,
                                          chaos_seed=11, secret_file=secret_file())}])
    own_daemons.append(d)
    overrides = {**inproc_overrides("chaos"), "engine.chaos_corrupt": 0.05}
    async with contextlib.AsyncExitStack() as stack:
        me = await Client.connect("inproc://", overrides=overrides, timeout=WAIT)
        stack.push_async_callback(lambda: asyncio.wait_for(me.close(), WAIT))
        them = await Client.connect(client_url(d), timeout=WAIT)
        stack.push_async_callback(them.close)
        mine, theirs = Side(me, True), Side(them, False)
        stack.push_async_callback(mine.close)
        stack.push_async_callback(theirs.close)
        before = _sum(d, "transferd_engine_integrity_failures_total")
        await _verified(mine, theirs)
        assert _sum(d, "transferd_engine_integrity_failures_total") > before
        await _verified(theirs, mine)
        assert _sum(d, "transferd_engine_integrity_resends_total") > 0
    assert d.alive()
