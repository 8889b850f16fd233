"""Owners and leases against live daemons: what goes when a connection closes or a lease
runs out, what stays, and the limits (docs/engine.md, "Owners and leases").

A hand-driven peer (tests/integration/test_accounting_engine.HandPeer) holds a write
half-landed, so a test sees the order: the buffer leaves the table at once, the admitted
write lands and is acknowledged, and only then is the next write refused and the memory
returned.  Checksums compare every byte another client's memory holds.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from client import Client
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, async_test, metric, pattern, scrape, wait_until
from tests.integration import engine_cluster
from tests.integration.engine_cluster import WAIT, Cluster, Node
from tests.integration.test_accounting import device
from tests.integration.test_accounting_engine import HandPeer
from transferd.memory import charge_of
from transferd.protocol.errors import BadRequest, NotFound, TooLarge
from transferd.protocol.peer import PeerCommand

MiB = 1 << 20
tcp_cluster = engine_cluster.tcp_cluster
clusters = engine_cluster.clusters


def _sha(b: bytes | bytearray | memoryview) -> bytes:
    return hashlib.sha256(bytes(b)).digest()


async def _landed(c: Client, buf: object, first: bytes) -> bool:
    return bytes(await c.get_tensor(buf.tensor(0, len(first)))) == first  # type: ignore[attr-defined]


@async_test(timeout=60)
async def test_a_closed_connection_frees_its_buffers_after_the_admitted_write_landed(
    daemon_factory: DaemonFactory,
) -> None:
    """The victim closes with a peer write half-landed in its region: its buffer id is gone
    at once, the write lands and is acknowledged, the next write is refused NOT_FOUND, and
    the memory comes back.  Another client's region on the same daemon takes writes from the
    same peer link throughout, byte for byte."""
    d = daemon_factory(["-m", "64"])
    ctl = RawConn.to(d)
    ctl.hello()
    size, half = 8 * MiB, 4 * MiB
    data = pattern(size, 21)
    other_data = pattern(MiB, 22)
    async with await Client.connect(d.url) as other:
        obuf = await other.alloc_buffer(MiB)  # the daemon's (the default owner)
        _, odesc = await other.reg_mr(obuf)
        base = device(ctl)["free"]
        victim = await Client.connect(d.url)
        buf = await victim.alloc_buffer(size, owner="connection")
        _, desc = await victim.reg_mr(buf)
        assert device(ctl)["free"] == base - charge_of(size)
        peer = await asyncio.to_thread(HandPeer, desc.rkeys[0][0])
        peer.write_header(1, desc, 0, size)
        await asyncio.to_thread(peer.sock.sendall, data[:half])
        for _ in range(200):
            if await _landed(victim, buf, data[:64]):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the first half never landed")
        await victim.close()
        # Out of the table at once: nobody finds it any more ...
        with pytest.raises(NotFound):
            await other.get_tensor(buf.tensor(0, 1))
        # ... but the admitted write still holds its memory, and lands whole.
        assert device(ctl)["free"] == base - charge_of(size)
        await asyncio.to_thread(peer.sock.sendall, data[half:])
        ack = await asyncio.to_thread(peer.recv)
        assert ack.cmd == PeerCommand.ACK and ack.body.get("ok") is True, ack.body
        # Revoked: the next write presenting the rkey is refused, nothing lands.
        peer.write_header(2, desc, 0, 4096)
        await asyncio.to_thread(peer.sock.sendall, b"\xff" * 4096)
        nack = await asyncio.to_thread(peer.recv)
        assert nack.cmd == PeerCommand.ACK and nack.body.get("code") == "NOT_FOUND", nack.body
        # The other client's region, over the same link, is untouched and still writable.
        peer.write_header(3, odesc, 0, MiB)
        await asyncio.to_thread(peer.sock.sendall, other_data)
        ack = await asyncio.to_thread(peer.recv)
        assert ack.body.get("ok") is True, ack.body
        assert _sha(await other.get_tensor(obuf.tensor())) == _sha(other_data)
        assert wait_until(lambda: device(ctl)["free"] == base, 10), (device(ctl), base)
        peer.sock.close()
        await other.free_buffer(obuf)


@async_test(timeout=90)
async def test_a_client_that_disconnects_with_writes_queued(tcp_cluster: Cluster) -> None:
    """16 writes queued from a connection-owned source, a registered connection-owned
    region, then the client goes: the writes it submitted run to their end (every byte
    lands at B), its region's rkey is refused afterwards (a write to it from B fails
    NOT_FOUND), A's memory comes back, and another client of A is unaffected."""
    a, b = tcp_cluster.a, tcp_cluster.b
    n, piece = 16, 256 * 1024
    src_data = pattern(n * piece, 31)
    ctl = RawConn.to(a)
    ctl.hello()
    async with await Client.connect(b.url) as cb, await Client.connect(a.url) as ca:
        y, z = Node(b, cb), Node(a, ca)
        try:
            dst = await y.region(n * piece)            # B: where the victim's writes go
            zsrc = await z.region(MiB, seed=32)        # A: another client's source ...
            zdst = await y.region(MiB)                 # ... and its destination at B
            ysrc = await y.region(64 * 1024, seed=33)  # B: the source of a write to the victim
            base = device(ctl)["free"]
            victim = await Client.connect(a.url)
            src = await victim.alloc_buffer(n * piece, owner="connection")
            await victim.set_tensor(src.tensor(), src_data)
            smr, _ = await victim.reg_mr(src)
            own = await victim.alloc_buffer(64 * 1024, owner="connection")
            _, own_desc = await victim.reg_mr(own)
            for i in range(n):
                await victim.submit_single_write(piece, None, (smr, i * piece),
                                                 (dst.desc, i * piece))
            await victim.close()  # without waiting for a single completion
            # Every write it submitted ran to its end: B holds every byte.
            for _ in range(int(WAIT / 0.05)):
                if _sha(await y.read(dst)) == _sha(src_data):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the victim's queued writes did not all land")
            # Its region's rkey is revoked: a write to it fails at its initiator.
            done = await cb.submit_single_write(4096, None, (ysrc.mr, 0), (own_desc, 0))
            with pytest.raises(NotFound):
                await asyncio.wait_for(done, WAIT)
            with pytest.raises(NotFound):
                await ca.get_tensor(src.tensor(0, 1))
            assert wait_until(lambda: device(ctl)["free"] == base, 10), (device(ctl), base)
            # The other client of A: its write lands byte for byte, its memory as it was.
            done = await ca.submit_single_write(MiB, None, (zsrc.mr, 0), (zdst.desc, 0))
            await asyncio.wait_for(done, WAIT)
            assert _sha(await y.read(zdst)) == _sha(zsrc.data)
            assert _sha(await z.read(zsrc)) == _sha(zsrc.data)
        finally:
            await y.close()
            await z.close()


@async_test(timeout=60)
async def test_a_lease_outlives_its_connection_renewed_from_another_then_expires(
    daemon_factory: DaemonFactory,
) -> None:
    """Made and filled on one connection, which closes; joined and renewed from a second
    past several ttls; then left alone, it expires: its buffer is freed and its region's
    rkey refused."""
    d = daemon_factory(["-m", "64"])
    ctl = RawConn.to(d)
    ctl.hello()
    base = device(ctl)["free"]
    ttl = 0.6
    data = pattern(MiB, 41)
    async with await Client.connect(d.url) as c1:
        assert await c1.renew_lease("kv/req-1", ttl) is True
        buf = await c1.alloc_buffer(MiB, lease="kv/req-1")
        await c1.set_tensor(buf.tensor(), data)
        _, desc = await c1.reg_mr(buf)
    loop = asyncio.get_running_loop()
    async with await Client.connect(d.url) as c2:
        t0 = loop.time()
        while loop.time() - t0 < 3 * ttl:  # three ttls: it would have expired twice
            assert await c2.renew_lease("kv/req-1", ttl, join=True) is False  # not made
            renewed = loop.time()
            await asyncio.sleep(ttl / 3)
        assert _sha(await c2.get_tensor(buf.tensor())) == _sha(data)
        assert device(ctl)["free"] == base - charge_of(MiB)
        # Left alone: gone within its ttl (and a little).
        for _ in range(100):
            try:
                await c2.get_tensor(buf.tensor(0, 1))
            except NotFound:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the unrenewed lease did not expire")
        assert loop.time() - renewed >= ttl * 0.9
        assert d.metrics_url is not None
        m = scrape(d.metrics_url)
        assert metric(m, "transferd_leases_expired_total") == 1
        assert metric(m, "transferd_leases") == 0
        assert wait_until(lambda: device(ctl)["free"] == base, 5)
        peer = await asyncio.to_thread(HandPeer, desc.rkeys[0][0])
        peer.write_header(1, desc, 0, 4096)
        await asyncio.to_thread(peer.sock.sendall, b"\x01" * 4096)
        nack = await asyncio.to_thread(peer.recv)
        assert nack.body.get("code") == "NOT_FOUND", nack.body
        peer.sock.close()
        # The name is free again: a new lease, owning nothing.
        assert await c2.renew_lease("kv/req-1", ttl) is True
        assert metric(scrape(d.metrics_url), "transferd_leases") == 1
        assert await c2.end_lease("kv/req-1") == 0


@async_test(timeout=60)
async def test_the_lease_context_manager_renews_and_ends(daemon: DaemonProcess) -> None:
    async with await Client.connect(daemon.url) as c:
        async with c.lease("ctx-lease", ttl=0.3) as lease:
            assert lease.created
            buf = await lease.alloc_buffer(4096)
            await c.set_tensor(buf.tensor(), b"\x07" * 4096)
            await asyncio.sleep(1.0)  # three ttls: only the renewals keep it
            assert bytes(await c.get_tensor(buf.tensor())) == b"\x07" * 4096
            assert lease.error is None
        with pytest.raises(NotFound):  # ended with the block
            await c.get_tensor(buf.tensor(0, 1))
        with pytest.raises(NotFound):
            await c.end_lease("ctx-lease")


@async_test(timeout=60)
async def test_lease_and_owner_limits_exceeded_by_one(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(env={"TRANSFERD_MEMORY_MAX_LEASES": "3",
                            "TRANSFERD_MEMORY_MAX_LEASES_PER_CONNECTION": "2",
                            "TRANSFERD_MEMORY_MAX_LEASE_TTL_S": "60"})
    async with await Client.connect(d.url) as c1, await Client.connect(d.url) as c2:
        await c1.renew_lease("l1", 30)
        await c1.renew_lease("l2", 30)
        with pytest.raises(TooLarge, match="max_leases_per_connection"):
            await c1.renew_lease("l3", 30)
        await c1.renew_lease("l1", 30)  # renewing is no new lease
        await c2.renew_lease("l3", 30)
        with pytest.raises(TooLarge, match=r"\(memory\.max_leases\)"):
            await c2.renew_lease("l4", 30)
        with pytest.raises(BadRequest, match="join"):  # c1's: c2 must ask to join
            await c2.end_lease("l1")
        assert await c2.end_lease("l1", join=True) == 0
        await c2.renew_lease("l4", 30)
        # Bad requests, each refused and the connection kept.
        for bad in (0, 60.001):
            with pytest.raises(BadRequest, match="ttl"):
                await c2.renew_lease("l4", bad)
        with pytest.raises(BadRequest, match="over 128"):
            await c2.renew_lease("x" * 129, 1)
        with pytest.raises(NotFound, match="no lease"):
            await c2.alloc_buffer(4096, lease="never-made")
        with pytest.raises(BadRequest, match="one owner"):
            await c2.alloc_buffer(4096, owner="daemon", lease="l4")
        with pytest.raises(BadRequest, match="owner"):
            await c2.alloc_buffer(4096, owner="somebody")
        assert await c2.imm_count(1) >= 0  # still served
    # c1 is gone: l2 is counted against nobody; a new connection may make its own two.
    async with await Client.connect(d.url) as c3:
        await c3.end_lease("l3", join=True)
        await c3.end_lease("l4", join=True)
        await c3.renew_lease("m1", 30)
        await c3.renew_lease("m2", 30)  # l2 + m1 + m2 = 3, the daemon's cap
        with pytest.raises(TooLarge):
            await c3.renew_lease("m3", 30)


@async_test(timeout=60)
async def test_default_owner_connection_and_daemon_kept_explicitly(
    daemon_factory: DaemonFactory,
) -> None:
    """memory.default_owner = connection: a buffer nobody claimed goes with its connection;
    owner="daemon" keeps today's behaviour explicitly, and the reply says who owns it."""
    d = daemon_factory(env={"TRANSFERD_MEMORY_DEFAULT_OWNER": "connection"})
    ctl = RawConn.to(d)
    ctl.hello()
    r = ctl.request(0x02, {"device": "cpu", "size": 4096, "owner": "daemon"})
    assert r.body["owner"] == "daemon"
    kept = r.body["buffer"]
    assert "owner" not in ctl.request(0x02, {"device": "cpu", "size": 8}).body  # as before
    async with await Client.connect(d.url) as c:
        gone = await c.alloc_buffer(4096)
        stays = await c.alloc_buffer(4096, owner="daemon")
        await c.set_tensor(stays.tensor(), b"\x05" * 4096)
    async with await Client.connect(d.url) as c:
        with pytest.raises(NotFound):
            await c.get_tensor(gone.tensor(0, 1))
        assert bytes(await c.get_tensor(stays.tensor())) == b"\x05" * 4096
        await c.free_buffer(stays)
        await c.free_buffer(kept)


@async_test(timeout=30)
async def test_by_default_a_host_buffer_outlives_its_connection(daemon: DaemonProcess) -> None:
    """What a client that knows nothing of owners was promised (memory.default_owner)."""
    async with await Client.connect(daemon.url) as c:
        buf = await c.alloc_buffer(4096)
        await c.set_tensor(buf.tensor(), b"\x09" * 4096)
    async with await Client.connect(daemon.url) as c:
        assert bytes(await c.get_tensor(buf.tensor())) == b"\x09" * 4096
        await c.free_buffer(buf)


def test_lease_frames_that_lie_get_typed_errors_and_the_connection_stays(
    daemon: DaemonProcess,
) -> None:
    """A raw socket sends LEASE / END_LEASE / ALLOC_BUFFER bodies of the wrong shape: each is
    BAD_REQUEST (or NOT_FOUND), nothing is made, and the connection is served after."""
    c = RawConn.to(daemon)
    c.hello()
    bad = [
        (0x2D, {"lease": "x"}),                          # no ttl_ms
        (0x2D, {"lease": "x", "ttl_ms": -5}),
        (0x2D, {"lease": "x", "ttl_ms": 1.5}),
        (0x2D, {"lease": "x", "ttl_ms": True}),
        (0x2D, {"lease": "x", "ttl_ms": 1 << 40}),       # over a u32
        (0x2D, {"lease": b"x", "ttl_ms": 10}),           # bin, not str
        (0x2D, {"lease": ["x"], "ttl_ms": 10}),
        (0x2E, {}),
        (0x2E, {"lease": 7}),
        (0x02, {"device": "cpu", "size": 64, "lease": 7}),
        (0x02, {"device": "cpu", "size": 64, "owner": 1}),
        (0x02, {"device": "cpu", "size": 64, "owner": "lease"}),  # which lease?
    ]
    for cmd, body in bad:
        r = c.request(cmd, body)
        assert r.is_error and r.body["code"] == "BAD_REQUEST", (cmd, body, r.body)
    r = c.request(0x2E, {"lease": "never-made"})
    assert r.is_error and r.body["code"] == "NOT_FOUND", r.body
    r = c.request(0x2D, {"lease": "x", "ttl_ms": 1000})  # the connection is fine
    assert not r.is_error and r.body["created"] is True, r.body
    assert c.request(0x2E, {"lease": "x"}).body == {"buffers": 0}


def test_the_blocking_client_makes_renews_and_ends_a_lease(daemon: DaemonProcess) -> None:
    from client import SyncClient

    with SyncClient.connect(daemon.url) as sc:
        assert sc.renew_lease("sync-lease", 5.0) is True
        buf = sc.alloc_buffer(4096, lease="sync-lease")
        assert sc.renew_lease("sync-lease", 5.0) is False
        assert sc.end_lease("sync-lease") == 1
        with pytest.raises(NotFound):
            sc.get_tensor(buf.tensor(0, 1))
