"""The peer plane trusts no claim it can check, tried against live daemons as an attacker
would: a client steering a known peer's traffic to an address of its choosing, a stranger
on a rail port (with and without a cluster secret), counts in a frame, overlapping parts
of a split write, daemons with different secrets, a peer that stops mid-handshake."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from client import MrDesc, NetAddr
from tests.helpers import DaemonProcess, RawConn, async_test, metric, scrape
from tests.integration.engine_cluster import (
    HANDSHAKE_TIMEOUT_S,
    RAILS,
    SECRET,
    WAIT,
    Cluster,
    engine_env,
    fresh_imm,
    nodes,
    poll,
    secret_file,
    settle,
    start_many,
    tcp_rails,
)
from tests.integration.fake_peer import STRANGER, FakePeer, handshake_error
from transferd.domains.rails import rail_bytes
from transferd.protocol.constants import Command
from transferd.protocol.errors import BadRequest, PeerUnreachable, Unauthorized
from transferd.protocol.frames import FrameDecoder, encode_header
from transferd.protocol.peer import PeerCommand


class Trap:
    """A listener that records every byte a daemon sends it (and never answers)."""

    def __init__(self, host: str = STRANGER) -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.data = bytearray()
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def addr(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()
        return host, port

    def _run(self) -> None:
        conns: list[socket.socket] = []
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                c, _ = self.sock.accept()
                c.settimeout(0.05)
                conns.append(c)
                self.accepted += 1
            for c in conns:
                with contextlib.suppress(TimeoutError, OSError):
                    self.data += c.recv(1 << 16)
        for c in conns:
            c.close()

    def frames(self) -> list[int]:
        """The cmds of the frames received (a stream per connection, concatenated)."""
        return [f.cmd for f in FrameDecoder().feed(bytes(self.data))]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@contextlib.contextmanager
def trap() -> Iterator[Trap]:
    t = Trap()
    try:
        yield t
    finally:
        t.close()


def at(desc: MrDesc, host: str, port: int) -> MrDesc:
    """``desc`` with every rail pointed at host:port (same node id, same rkeys)."""
    return MrDesc(desc.ptr, [(NetAddr(a.node, a.group, ((host, port),)), k)
                             for a, k in desc.rkeys], desc.size)


@async_test(timeout=60)
async def test_a_client_cannot_steer_a_known_peer_elsewhere(tcp_cluster: Cluster) -> None:
    """The hijack of issue 6: a write to an MrDesc naming B's node id at the client's own
    host:port.  Once B is known it is BAD_REQUEST naming both addresses; bytes and rkeys
    never reach the client's listener; ports and hosts that are not an address are refused."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        src = await a.region(8192, seed=61)
        dst = await b.region(8192)
        imm = fresh_imm()
        await (await a.client.submit_single_write(4096, imm, (src.mr, 0),
                                                  (dst.desc, 0))).wait(WAIT)
        with trap() as t:
            forged = at(dst.desc, *t.addr)
            c = await a.client.submit_single_write(4096, imm, (src.mr, 0), (forged, 0))
            (err,) = await settle([c])
            assert isinstance(err, BadRequest), err
            real = dst.desc.rkeys[0][0].rails[0].decode()
            assert real in str(err) and f"{t.addr[0]}:{t.addr[1]}" in str(err)
            # Sends, peer groups and barriers are checked the same way.
            liar = NetAddr(forged.node[0], forged.node[1], (t.addr, t.addr))
            with pytest.raises(BadRequest, match=f"{t.addr[1]}"):
                await a.client.add_peer_group([liar])
            (err,) = await settle([await a.client.submit_send(liar, b"secret")])
            assert isinstance(err, BadRequest), err
            (err,) = await settle([await a.client.submit_barrier(None, imm, [forged])])
            assert isinstance(err, BadRequest), err
            # A's own node id at another address is refused too.
            me = await a.client.main_address()
            (err,) = await settle([await a.client.submit_send(
                NetAddr(me.node, me.group, (t.addr, t.addr)), b"x")])
            assert isinstance(err, BadRequest) and "this daemon" in str(err), err
            # An unknown node at the client's address gets a HELLO at most: no WRITE, no rkey.
            stranger = MrDesc(dst.desc.ptr, [(NetAddr(0x5EED, 0, (t.addr,)), k)
                                             for _, k in dst.desc.rkeys], dst.desc.size)
            c = await a.client.submit_single_write(4096, imm, (src.mr, 0), (stranger, 0))
            (err,) = await settle([c], timeout=HANDSHAKE_TIMEOUT_S * 5)
            assert isinstance(err, PeerUnreachable), err
            assert set(t.frames()) <= {PeerCommand.HELLO}, t.frames()
            for _, k in dst.desc.rkeys:
                assert k.to_bytes(8, "big") not in t.data and k.to_bytes(8, "little") not in t.data
        for bad in [("127.0.0.1", 0), ("127.0.0.1", 70000), ("evil.example", 80)]:
            (err,) = await settle([await a.client.submit_single_write(
                16, None, (src.mr, 0), (at(dst.desc, *bad), 0))])
            assert isinstance(err, BadRequest), (bad, err)
        assert await b.client.imm_count(imm) == 1


def _stranger_attempts(addr: NetAddr, secret: bytes | None, rkey: int, ptr: int) -> None:
    """Everything a stranger without the credentials tries on rail 0; each must fail."""
    rail0 = tcp_rails(addr)[0]
    # Frames of the established plane, with no handshake: closed.
    for cmd, body, payload in [
        (PeerCommand.SEND, {"op": 1, "part": 0}, b"hello from nobody"),
        (PeerCommand.WRITE, {"op": 1, "part": 0, "rkey": rkey, "addrs": [ptr], "lens": [4],
                             "imm": 1}, b"evil"),
        (PeerCommand.WRITE, {"op": 1, "part": 0, "rkey": rkey, "addrs": [], "lens": []}, b""),
    ]:
        with RawConn(*rail0) as conn:
            conn.send(cmd, body, payload)
            assert conn.closed_by_peer()
    # A header announcing a body over the pre-handshake cap: closed from the header.
    with RawConn(*rail0) as conn:
        conn.send_raw(encode_header(PeerCommand.HELLO, 0, 0, 64 * 1024, 0))
        assert conn.closed_by_peer()
    # A handshake it cannot finish: without the secret (or, with none configured,
    # claiming an address it does not listen at, here the real A's).
    claim = None if secret is not None else (rail_bytes(*RAILS_A0), rail_bytes(*RAILS_A1))
    with FakePeer(addr, 0, None, claim=claim, timeout=1.5) as p:
        err = handshake_error(p)
        assert err is not None
        with contextlib.suppress(OSError):
            if secret is None:
                # It never saw the token: what it can do is guess.
                p.conn.send(PeerCommand.AUTH, {"token": bytes(32)})
            p.conn.send(PeerCommand.SEND, {"op": 2, "part": 0}, b"after a failed handshake")
        assert p.conn.closed_by_peer()
    if secret is not None:
        with FakePeer(addr, 0, b"a guess") as p:
            err = handshake_error(p)
            assert isinstance(err, Unauthorized) and "did not prove" in str(err), err


# A's rails (127.0.0.2 and .3) at ports no daemon listens on in the no-secret test.
RAILS_A0 = ("127.0.0.2", 9)
RAILS_A1 = ("127.0.0.3", 9)


@pytest.mark.parametrize("with_secret", [True, False], ids=["secret", "no-secret"])
@async_test(timeout=90)
async def test_a_stranger_on_a_rail_cannot_deliver_or_count(
        with_secret: bool, tcp_cluster: Cluster) -> None:
    if with_secret:
        b_daemon: DaemonProcess = tcp_cluster.b
        own: list[DaemonProcess] = []
    else:
        own = start_many([{"env": engine_env(RAILS["b"], handshake_timeout_s=1)}])
        b_daemon = own[0]
    try:
        async with nodes(b_daemon) as (b,):
            addr = await b.client.main_address()
            dst = await b.region(4096)
            imm = fresh_imm()
            got: list[bytes] = []
            b.client.submit_recvs(1024, 4, got.append)
            await b.client.synchronize()
            await asyncio.to_thread(_stranger_attempts, addr, SECRET if with_secret else None,
                                    dst.desc.rkeys[0][1], dst.desc.ptr)
            await asyncio.sleep(0.2)
            assert got == [] and await b.client.imm_count(imm) == 0
            assert await b.client.imm_count(1) == 0
            assert await b.read(dst) == bytes(4096)
            if not with_secret:
                # A peer that does listen where it claims gets through (nothing proves
                # more without a secret), under its own id (its addresses'): claiming a
                # known one, or any other, is refused.
                me = await b.client.main_address()
                for claimed in (me.node, 0xBEE):
                    with FakePeer(addr, 0, None, node=claimed) as p:
                        assert handshake_error(p) is not None
                        assert p.conn.closed_by_peer()
                with FakePeer(addr, 0, None) as p:
                    p.handshake()
                    p.send(PeerCommand.SEND, {"op": 1, "part": 0, "from": [1, 2]}, b"hi")
                    assert p.recv().body.get("ok") is True
                assert await poll(lambda: _len(got), 1) == 1 and got == [b"hi"]
    finally:
        for d in own:
            d.stop()


async def _len(xs: list[bytes]) -> int:
    return len(xs)


@async_test(timeout=60)
async def test_counts_come_from_what_landed(tcp_cluster: Cluster) -> None:
    """-100 and 1000 in a frame move nothing; pages placed do; a split write counts once,
    when its parts covered it, and a part overlapping another is refused."""
    cl = tcp_cluster
    async with nodes(cl.b) as (b,):
        addr = await b.client.main_address()
        dst = await b.region(64 * 1024)
        imm = fresh_imm()
        k0 = dst.desc.rkeys[0][1]
        p = dst.desc.ptr

        def attack() -> None:
            with FakePeer(addr, 0, SECRET) as peer:
                peer.handshake()
                for op, count in [(1, -100), (2, 1000)]:
                    ack = peer.write(k0, [p], [4], b"abcd", op=op, imm=imm, count=count,
                                     parts=1)
                    assert ack.body.get("ok") is True, ack.body
                # Three pages: three, whatever "count" says.
                ack = peer.write(k0, [p, p + 4096, p + 8192], [4, 4, 4], b"x" * 12, op=3,
                                 imm=imm, count=1)
                assert ack.body.get("ok") is True
                # A split write of 8 KiB in two parts, with an overlapping liar between.
                span = [p + 16384, 8192]
                ack = peer.write(k0, [p + 16384], [4096], b"a" * 4096, op=4, imm=imm, span=span)
                assert ack.body.get("ok") is True
                ack = peer.write(k0, [p + 16384 + 4000], [4096], b"b" * 4096, op=4, imm=imm,
                                 span=span)
                assert ack.body.get("code") == "BAD_REQUEST" and "overlaps" in ack.body["message"]
                ack = peer.write(k0, [p + 16384 + 4096], [4096], b"c" * 4096, op=4, imm=imm,
                                 span=[p + 16384, 8193])
                assert ack.body.get("code") == "BAD_REQUEST", ack.body  # another span
                ack = peer.write(k0, [p + 16384 + 4096], [4097], b"c" * 4097, op=4, imm=imm,
                                 span=span)
                assert ack.body.get("code") == "BAD_REQUEST", ack.body  # one byte past it
                ack = peer.write(k0, [p + 16384 + 4096], [4096], b"c" * 4096, op=4, imm=imm,
                                 span=span)
                assert ack.body.get("ok") is True

        await asyncio.to_thread(attack)
        # 1 + 1 + 3 + 1 (the split write, once).
        assert await poll(lambda: b.client.imm_count(imm), 6) == 6
        await asyncio.sleep(0.1)
        assert await b.client.imm_count(imm) == 6
        got = await b.read(dst, 16384, 8192)
        assert got == b"a" * 4096 + b"c" * 4096


@async_test(timeout=90)
async def test_daemons_with_different_secrets_cannot_link() -> None:
    """Each way, and against a daemon without one: the initiator's client gets a clear
    error, the receiver's memory and counters are untouched."""
    x, y, z = start_many([
        {"env": engine_env(RAILS["a"], secret_file=secret_file(b"one"),
                           handshake_timeout_s=HANDSHAKE_TIMEOUT_S)},
        {"env": engine_env(RAILS["b"], secret_file=secret_file(b"two"),
                           handshake_timeout_s=HANDSHAKE_TIMEOUT_S)},
        {"env": engine_env(RAILS["c"], handshake_timeout_s=HANDSHAKE_TIMEOUT_S)},
    ])
    try:
        async with nodes(x, y, z) as (nx, ny, nz):
            imm = fresh_imm()
            regions = {id(n): (await n.region(4096, seed=i), await n.region(4096))
                       for i, n in enumerate((nx, ny, nz))}
            for src, dst, words in [(nx, ny, "did not prove the cluster secret"),
                                    (ny, nx, "did not prove the cluster secret"),
                                    (nx, nz, "has no cluster secret"),
                                    (nz, nx, "requires the cluster secret")]:
                c = await src.client.submit_single_write(
                    4096, imm, (regions[id(src)][0].mr, 0), (regions[id(dst)][1].desc, 0))
                (err,) = await settle([c])
                assert isinstance(err, PeerUnreachable) and words in str(err), (words, err)
            for n in (nx, ny, nz):
                assert await n.client.imm_count(imm) == 0
                assert await n.read(regions[id(n)][1]) == bytes(4096)
    finally:
        for d in (x, y, z):
            d.stop()


@async_test(timeout=60)
async def test_a_peer_that_stops_mid_handshake(tcp_cluster: Cluster) -> None:
    """A listener that takes the HELLO and never answers: the write fails once the
    handshake timeout passes, with a message that says so; a stranger that connects and
    stays silent is closed by then."""
    cl = tcp_cluster
    async with nodes(cl.a) as (a,):
        src = await a.region(4096, seed=71)
        with trap() as t:
            desc = MrDesc(0x1000, [(NetAddr(0x51E, 0, (t.addr,)), 1),
                                   (NetAddr(0x51E, 0, (t.addr,)), 2)], 4096)
            start = time.monotonic()
            (err,) = await settle([await a.client.submit_single_write(
                4096, None, (src.mr, 0), (desc, 0))])
            took = time.monotonic() - start
            assert isinstance(err, PeerUnreachable) and "not finished" in str(err), err
            assert took < HANDSHAKE_TIMEOUT_S + 3, took
            assert set(t.frames()) == {PeerCommand.HELLO}, t.frames()
        addr = await a.client.main_address()

        def silent() -> float:
            with RawConn(*tcp_rails(addr)[0]) as conn:
                t0 = time.monotonic()
                assert conn.closed_by_peer(HANDSHAKE_TIMEOUT_S + 5)
                return time.monotonic() - t0

        assert await asyncio.to_thread(silent) < HANDSHAKE_TIMEOUT_S + 3


def test_a_replayed_handshake_is_refused(tcp_cluster: Cluster) -> None:
    """Record a good peer's frames and play them again on a new link: its AUTH answers
    a challenge the daemon does not ask twice."""
    cl = tcp_cluster

    async def main_address() -> NetAddr:
        async with nodes(cl.b) as (b,):
            return await b.client.main_address()

    addr = asyncio.run(main_address())
    with FakePeer(addr, 0, SECRET) as good:
        sent: list[bytes] = []
        real = good.conn.send_raw

        def record(data: bytes) -> None:
            sent.append(data)
            real(data)

        good.conn.send_raw = record  # type: ignore[method-assign]
        good.handshake()
    with RawConn(*tcp_rails(addr)[0]) as again:
        again.send_raw(sent[0])
        reply = again.recv()
        assert not reply.is_error and reply.body["challenge"]
        again.send_raw(sent[1])
        refused = again.recv()
        assert refused.is_error and refused.body["code"] == "UNAUTHORIZED", refused.body
        assert again.closed_by_peer()


def test_handshakes_in_progress_are_capped(tcp_cluster: Cluster) -> None:
    """Silent strangers on a rail hold at most MAX_PER_SOURCE slots from one source: the
    next one from it takes its oldest's slot (that one is closed), and the newcomer is
    served; once they are gone a new link is taken as before."""
    from transferd.domains.strangers import MAX_PER_SOURCE

    cl = tcp_cluster

    async def main_address() -> NetAddr:
        async with nodes(cl.c) as (c,):
            return await c.client.main_address()

    addr = asyncio.run(main_address())
    rail = tcp_rails(addr)[1]
    silent = []
    try:
        for _ in range(MAX_PER_SOURCE):
            silent.append(RawConn(*rail))
            time.sleep(0.01)  # each accepted before the next comes (age order)
        time.sleep(0.2)
        assert not any(c.closed_by_peer(0.01) for c in silent)
        with RawConn(*rail) as one_more:
            assert silent[0].closed_by_peer(1.0)  # the oldest gave way
            assert not one_more.closed_by_peer(0.3)
            assert not any(c.closed_by_peer(0.01) for c in silent[1:])
    finally:
        for c in silent:
            c.close()
    time.sleep(0.3)
    with RawConn(*rail) as again:
        assert not again.closed_by_peer(0.5)


@async_test(timeout=60)
async def test_silent_strangers_on_a_rail_do_not_stop_a_real_peers_link() -> None:
    """#16.5: 64 silent sockets on a rail held every handshake slot, even with
    engine.secret_file: a real peer's first write then failed PEER_UNREACHABLE.  Now a
    source holds at most its share (the per-source cap, the oldest giving way), each for
    at most the handshake timeout, and the real peer's link is made at once."""
    secret = secret_file()
    own = start_many([{"env": engine_env(RAILS[n], secret_file=secret,
                                         handshake_timeout_s=HANDSHAKE_TIMEOUT_S)}
                      for n in ("a", "c")])
    try:
        await _first_link_through_strangers(*own)
    finally:
        for d in own:
            d.stop()


async def _first_link_through_strangers(a_d: DaemonProcess, c_d: DaemonProcess) -> None:
    async with nodes(a_d, c_d) as (a, c):
        addr_c = await c.client.main_address()
        dst = await c.region(4096)
        src = await a.region(4096, seed=93)
        # The stranger on every rail of C, 64 sockets each, from its own address.
        silent = []
        for host, port in tcp_rails(addr_c):
            for _ in range(64):
                sock = socket.socket()
                sock.bind((STRANGER, 0))
                sock.connect((host, port))
                silent.append(sock)
        try:
            await asyncio.sleep(0.2)
            w = await a.client.submit_single_write(4096, None, (src.mr, 0), (dst.desc, 0))
            await w.wait(WAIT)
            assert await c.read(dst) == bytes(src.data)
        finally:
            for sock in silent:
                sock.close()


def test_the_pre_handshake_body_cap_exactly(tcp_cluster: Cluster) -> None:
    """A HELLO body of exactly 4096 bytes is read (and answered: it is no HELLO); one of
    4097 is refused from its header, the link closed without a reply."""
    from transferd.protocol.peer_handshake import MAX_HANDSHAKE_BODY

    async def main_address() -> NetAddr:
        async with nodes(tcp_cluster.b) as (b,):
            return await b.client.main_address()

    addr = asyncio.run(main_address())

    def body_of(size: int) -> bytes:
        import msgpack

        # fixmap(1) + "pad" (4 bytes) + a bin16 header (3 bytes) + the padding
        raw = bytes(msgpack.packb({"pad": b"x" * (size - 8)}))
        assert len(raw) == size
        return raw

    for size, answered in [(MAX_HANDSHAKE_BODY, True), (MAX_HANDSHAKE_BODY + 1, False)]:
        with RawConn(*tcp_rails(addr)[0]) as conn:
            body = body_of(size)
            conn.send_raw(encode_header(PeerCommand.HELLO, 0, 0, len(body), 0) + body)
            if answered:
                reply = conn.recv()
                assert reply.is_error and reply.body["code"] == "BAD_FRAME", reply.body
            assert conn.closed_by_peer()
            assert bool(conn.frames) is False


def test_strangers_on_a_rail_cost_the_daemon_almost_nothing(tcp_cluster: Cluster) -> None:
    """300 strangers each announcing a 16 MiB body before any handshake (a rail once
    allocated it from the header), then 64 that stay silent: the daemon's RSS moves by
    a few MiB at most, and its clients are served throughout."""
    from tests.helpers import rss

    cl = tcp_cluster

    async def main_address() -> NetAddr:
        async with nodes(cl.c) as (c,):
            return await c.client.main_address()

    addr = asyncio.run(main_address())
    rail = tcp_rails(addr)[0]
    base = rss(cl.c)
    huge = encode_header(PeerCommand.HELLO, 0, 0, 16 << 20, 0)
    for _ in range(300):
        with RawConn(*rail) as conn:
            conn.send_raw(huge)
            assert conn.closed_by_peer(5)
    silent = [RawConn(*rail) for _ in range(64)]
    try:
        time.sleep(0.3)
        grown = rss(cl.c) - base
        print(f"rail strangers: RSS grew by {grown / (1 << 20):.2f} MiB")
        assert grown < 8 << 20, f"RSS grew by {grown / (1 << 20):.1f} MiB"
        assert asyncio.run(main_address()) == addr  # a client is still served
    finally:
        for c in silent:
            c.close()


@async_test(timeout=60)
async def test_without_a_secret_nobody_takes_another_daemons_node_id() -> None:
    """#16.7: without a cluster secret a stranger claimed daemon C's node id before C
    linked to B; its messages then showed C as ``from``, and C's own link was refused.
    Now a node id is its rails' addresses: the stranger's claim is refused, C links, and
    B's receive says the message came from C."""
    b_d, c_d = start_many([{"env": engine_env(RAILS["b"], handshake_timeout_s=2)},
                           {"env": engine_env(RAILS["c"], handshake_timeout_s=2)}])
    try:
        async with nodes(b_d, c_d) as (b, c):
            addr_b, addr_c = await b.client.main_address(), await c.client.main_address()
            recv = RawConn.to(b_d, timeout=WAIT)
            recv.hello()
            assert not recv.request(Command.SUBMIT_RECVS, {"len": 64, "count": 4}).is_error

            def stranger() -> Exception | None:
                # Listening where it claims (the probe reaches it), under C's id.
                with FakePeer(addr_b, 0, None, node=addr_c.node) as p:
                    return handshake_error(p)

            err = await asyncio.to_thread(stranger)
            assert isinstance(err, Unauthorized) and "addresses" in str(err), err
            await (await c.client.submit_send(addr_b, b"from c")).wait(WAIT)
            event = await asyncio.to_thread(recv.recv)
            assert event.body["from"] == [addr_c.node, addr_c.group], event.body
            assert bytes(event.payload or b"") == b"from c"
            recv.close()
    finally:
        b_d.stop()
        c_d.stop()


class _Tarpit:
    """A listener that accepts nothing (its backlog full of nothing): a dial hangs."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind((STRANGER, 0))
        self.sock.listen(0)
        self.addr = rail_bytes(*self.sock.getsockname())
        # Fill the backlog so that later connects hang in SYN-SENT.
        self.fill = []
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError, OSError):
                s.connect(self.sock.getsockname())
            self.fill.append(s)

    def close(self) -> None:
        for s in self.fill:
            s.close()
        self.sock.close()


@async_test(timeout=90)
async def test_without_a_secret_probe_dials_are_counted_and_bounded() -> None:
    """#16.7: HELLOs naming a tarpit made B dial a PROBE for each, none counted: 1100
    of them used 512 of 512 descriptors.  Now each probe takes a descriptor of the link
    budget while it runs, at most 64 run at once per group, and each ends with its
    handshake: B's descriptors stay bounded and a real peer links meanwhile."""
    b_d, a_d = start_many([{"env": engine_env(RAILS["b"], handshake_timeout_s=3)},
                           {"env": engine_env(RAILS["a"], handshake_timeout_s=3)}])
    tarpit = _Tarpit()
    try:
        async with nodes(b_d, a_d) as (b, a):
            addr_b = await b.client.main_address()
            base = len(os.listdir(f"/proc/{_pid(b_d)}/fd"))
            peak = [0]

            def flood() -> None:
                for i in range(300):  # HELLOs whose probes go to the tarpit, each hung up
                    with contextlib.suppress(OSError), FakePeer(
                            addr_b, 0, None, claim=(tarpit.addr,) * len(addr_b.rails)) as p:
                        p.hs.start()
                        p.conn.send_raw(p.hs.data_to_send())
                        time.sleep(0.002)  # (B reads it, dials, and the slot goes back)
                    if i % 10 == 0:
                        peak[0] = max(peak[0], len(os.listdir(f"/proc/{_pid(b_d)}/fd")) - base)
                peak[0] = max(peak[0], len(os.listdir(f"/proc/{_pid(b_d)}/fd")) - base)

            await asyncio.to_thread(flood)
            # At most 64 probes in flight (and the handshaking links, closed at once).
            assert peak[0] <= 64 + 24, peak[0]
            m = scrape(b_d.metrics_url or "")
            assert metric(m, "transferd_engine_link_budget") > 0
            # A real peer links and writes meanwhile.
            src, dst = await a.region(4096, seed=91), await b.region(4096)
            await (await a.client.submit_single_write(4096, None, (src.mr, 0),
                                                      (dst.desc, 0))).wait(WAIT)
            assert await b.read(dst) == bytes(src.data)
    finally:
        tarpit.close()
        a_d.stop()
        b_d.stop()


@async_test(timeout=90)
async def test_without_a_secret_the_peer_book_is_bounded() -> None:
    """#16.7: every stranger's handshake left a binding in the peer book, never
    forgotten (27,895 from one process in 70 s).  Now the book holds engine.max_peers,
    the least recently bound forgotten first, and an expired or forgotten peer binds
    again at its next handshake."""
    (b_d,) = start_many([{"env": engine_env(RAILS["b"], max_peers=50)}])
    try:
        async with nodes(b_d) as (b,):
            addr_b = await b.client.main_address()

            def strangers(n: int) -> int:
                ok = 0
                for _ in range(n):
                    with FakePeer(addr_b, 0, None) as p:
                        ok += handshake_error(p) is None
                return ok

            assert await asyncio.to_thread(strangers, 200) == 200
            m = scrape(b_d.metrics_url or "")
            known = metric(m, "transferd_engine_peers_known")
            assert 1 < known <= 51, known  # (B itself counts once)
    finally:
        b_d.stop()


def _pid(d: DaemonProcess) -> int:
    assert d.proc is not None
    return d.proc.pid
