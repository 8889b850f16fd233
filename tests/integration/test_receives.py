"""Peer messages at the receiver, attacked: a client that posts receives and stops
reading, messages nobody posted for, a sending link that dies, receive pools by the
thousand.  Two daemons of their own (A sends, B receives: ``-m 32``, so what waits at B
is charged against 32 MiB), real sockets, checksums on what arrives."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from client import Client, NetAddr
from tests.helpers import DaemonProcess, RawConn, async_test, digest, metric, rss, scrape
from tests.integration.engine_cluster import (
    HANDSHAKE_TIMEOUT_S,
    SECRET,
    WAIT,
    MiB,
    engine_env,
    secret_file,
    settle,
    start_many,
)
from tests.integration.fake_peer import FakePeer, data_frame
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import Cancelled, NotFound, OutOfMemory, OverLimit
from transferd.protocol.frames import FrameDecoder
from transferd.protocol.peer import PeerCommand

RECV_WAIT_S = 4.0
LIMIT_MIB = 32
POOLS_TOTAL = 100


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    common = {"secret_file": secret_file(), "handshake_timeout_s": HANDSHAKE_TIMEOUT_S,
              "recv_wait_s": RECV_WAIT_S, "max_recv_pools_total": POOLS_TOTAL}
    a, b = start_many([
        {"env": engine_env(["127.0.0.20"], **common)},
        {"env": engine_env(["127.0.0.22"], **common), "args": ["-m", str(LIMIT_MIB)]},
    ])
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()
    for d in (a, b):
        assert "Traceback" not in d.stderr and " ERROR " not in d.stderr, d.output()


def stalled_reader(d: DaemonProcess, length: int = MiB, count: int = 1000,
                   trace: bool | None = None) -> RawConn:
    """A client of ``d`` that posts receives and then reads nothing (a small receive
    buffer, so the kernel holds little for it)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.settimeout(WAIT)
    sock.connect(d.host_port)
    conn = RawConn.__new__(RawConn)
    conn.sock, conn.decoder, conn.frames, conn.seq = sock, FrameDecoder(), [], 0
    conn.hello()
    body: dict[str, object] = {"len": length, "count": count}
    if trace is not None:
        body["trace"] = trace
    r = conn.request(Command.SUBMIT_RECVS, body)
    assert not r.is_error, r.body
    return conn


def read_messages(conn: RawConn, want: int, timeout: float = WAIT) -> list[bytes]:
    """The payloads of the next ``want`` message EVENTs (bounded in time)."""
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        f = conn.recv()
        assert f.cmd == Command.SUBMIT_RECVS and f.flags & Flag.EVENT, f
        got.append(bytes(f.payload or b""))
    return got


def message(i: int, size: int = MiB) -> bytes:
    return i.to_bytes(4, "big") * (size // 4)


async def pending_at_most(ws: list, n: int, timeout: float = WAIT) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while sum(not w.done() for w in ws) > n:
        assert loop.time() < deadline, [w for w in ws if not w.done()]
        await asyncio.sleep(0.05)


def waiting_bytes(d: DaemonProcess) -> float:
    return metric(scrape(d.metrics_url or ""), "transferd_engine_messages_waiting_bytes")


class Peak:
    """The highest RSS of a daemon, sampled every 10 ms while in use."""

    def __init__(self, d: DaemonProcess) -> None:
        self.d, self.base, self.peak = d, rss(d), 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss(self.d) - self.base)

    def __enter__(self) -> Peak:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)


@async_test(timeout=120)
async def test_a_reader_that_stops_reading_holds_its_senders_not_memory(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """200 x 1 MiB at a receive whose client reads nothing: before, B grew by ~200 MiB
    and every SEND was acknowledged.  Now only what the reader's socket took is
    acknowledged; the rest waits charged to B's 32 MiB (or is refused OUT_OF_MEMORY),
    expires with its sender told CANCELLED, and B's memory stays bounded."""
    a_d, b_d = pair
    reader = stalled_reader(b_d)
    a = await Client.connect(a_d.url, timeout=WAIT)
    ctl = RawConn.to(b_d)
    ctl.hello()
    try:
        addr_b = NetAddr.from_bytes(ctl.request(Command.MAIN_ADDRESS).body["addr"])
        total = 200
        with Peak(b_d) as peak:
            ws = [await a.submit_send(addr_b, message(i)) for i in range(total)]
            # Waiting messages are charged like buffers: B's free memory shows them.
            await asyncio.sleep(0.5)
            held = waiting_bytes(b_d)
            free = next(d for d in ctl.request(Command.GET_DEVICES).body["devices"]
                        if d["name"] == "cpu")["free"]
            assert held >= 4 * MiB, held
            assert free <= LIMIT_MIB * MiB - held, (free, held)
            # Everything but the message in the reader's transport ends: refused at
            # once or expired after engine.recv_wait_s, each sender told.
            await pending_at_most(ws, 1, RECV_WAIT_S + WAIT)
        assert peak.peak <= (LIMIT_MIB + 32) * MiB, peak.peak / MiB
        done = [(i, w.exception()) for i, w in enumerate(ws) if w.done()]
        ok = [i for i, e in done if e is None]
        failed = [e for _, e in done if e is not None]
        assert all(isinstance(e, OutOfMemory | Cancelled | OverLimit) for e in failed), failed
        assert any(isinstance(e, Cancelled) and "recv_wait_s" in e.message for e in failed)
        # Acknowledged: only what the reader's socket buffers took (a few MiB), not 200.
        print(f"200 x 1 MiB at a stalled reader: {len(ok)} acknowledged, "
              f"{sum(isinstance(e, OutOfMemory) for e in failed)} OUT_OF_MEMORY, "
              f"{sum(isinstance(e, Cancelled) for e in failed)} CANCELLED; "
              f"B's peak RSS growth {peak.peak / MiB:.1f} MiB")
        assert len(ok) <= 16, len(ok)
        m = scrape(b_d.metrics_url or "")
        assert metric(m, "transferd_engine_messages_expired_total") >= 1
        # The reader reads at last: exactly the acknowledged messages plus the one that
        # was in its transport (acknowledged now), each byte as sent.
        last = [i for i, w in enumerate(ws) if not w.done()]
        got = await asyncio.to_thread(read_messages, reader, len(ok) + len(last))
        assert await settle([ws[i] for i in last]) == [None] * len(last)
        sent = {digest(message(i)): i for i in ok + last}
        assert sorted(sent.get(digest(g), -1) for g in got) == sorted(ok + last)
        assert waiting_bytes(b_d) == 0
    finally:
        reader.close()
        ctl.close()
        await a.close()


@async_test(timeout=90)
async def test_a_waiting_message_goes_only_to_the_connection_that_posted(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """Messages waiting on a stalled receiver are never handed to a client that posts
    later; when the stalled one closes they fail at once (CANCELLED), and the later
    client gets only what is sent after."""
    a_d, b_d = pair
    r1 = stalled_reader(b_d)
    a = await Client.connect(a_d.url, timeout=WAIT)
    r2 = await Client.connect(b_d.url, timeout=WAIT)
    try:
        addr_b = await r2.main_address()
        ws = [await a.submit_send(addr_b, message(1000 + i)) for i in range(12)]
        await pending_at_most(ws, 7)  # the reader's socket took a few
        got: list[bytes] = []
        r2.submit_recvs(MiB, 8, got.append)
        await r2.imm_count(0)  # a round trip: r2's receives are posted
        await asyncio.sleep(0.3)
        # (The kernel may still take a little more for r1, acknowledging it.)
        pending = [w for w in ws if not w.done()]
        assert pending, "the reader's socket took every message"
        assert got == []
        t0 = time.monotonic()
        r1.close()
        errors = await settle(pending)
        assert time.monotonic() - t0 < RECV_WAIT_S  # told at the close, not at expiry
        assert all(isinstance(e, Cancelled) and "closed" in e.message for e in errors), errors
        await asyncio.sleep(0.2)
        assert got == []
        late = message(7)
        await (await a.submit_send(addr_b, late)).wait(WAIT)
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.02)
        assert [digest(g) for g in got] == [digest(late)]
        assert waiting_bytes(b_d) == 0
    finally:
        r1.close()
        await r2.close()
        await a.close()


@async_test(timeout=60)
async def test_each_post_of_a_connection_gets_its_own_messages(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """Two SUBMIT_RECVS on one connection, of different lengths, each with its own
    callback: a message goes to the callback of the pool it was placed in (the smallest
    length that holds it).  Before, every message went to the first post's callback."""
    a_d, b_d = pair
    a = await Client.connect(a_d.url, timeout=WAIT)
    r = await Client.connect(b_d.url, timeout=WAIT)
    try:
        addr_b = await r.main_address()
        small: list[bytes] = []
        large: list[bytes] = []
        r.submit_recvs(64, 4, small.append)
        r.submit_recvs(MiB, 4, large.append)
        await r.imm_count(0)  # a round trip: both posts are in
        msgs = [b"s" * 40, message(5, 256 * 1024), b"t" * 64, message(6, MiB)]
        for m in msgs:
            await (await a.submit_send(addr_b, m)).wait(WAIT)
        for _ in range(200):
            if len(small) + len(large) == 4:
                break
            await asyncio.sleep(0.02)
        assert [digest(g) for g in small] == [digest(msgs[0]), digest(msgs[2])]
        assert [digest(g) for g in large] == [digest(msgs[1]), digest(msgs[3])]
    finally:
        await r.close()
        await a.close()


@async_test(timeout=60)
async def test_messages_of_a_sending_link_that_dies_are_dropped(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """A peer link's messages waiting for a busy receive go when that link closes
    (their charge too), well before engine.recv_wait_s."""
    a_d, b_d = pair
    r1 = stalled_reader(b_d, count=1)  # one receive: busy once it holds a message
    a = await Client.connect(a_d.url, timeout=WAIT)
    ctl = await Client.connect(b_d.url, timeout=WAIT)
    try:
        addr_b = await ctl.main_address()
        ws = [await a.submit_send(addr_b, message(2000 + i)) for i in range(8)]
        await pending_at_most(ws, 7)
        # Every message of A's has arrived (waiting, or taken): the count holds still.
        base, since = waiting_bytes(b_d), time.monotonic()
        for _ in range(200):
            await asyncio.sleep(0.05)
            now = waiting_bytes(b_d)
            if now != base:
                base, since = now, time.monotonic()
            elif time.monotonic() - since >= 0.3:
                break
        with FakePeer(addr_b, 0, SECRET) as p:
            p.handshake()
            for op in range(1, 4):
                p.send(PeerCommand.SEND, {"op": op, "part": 0}, message(op, 512 * 1024))
            for _ in range(200):
                if waiting_bytes(b_d) >= base + 3 * 512 * 1024:
                    break
                await asyncio.sleep(0.01)
            assert waiting_bytes(b_d) >= base + 3 * 512 * 1024
        t0 = time.monotonic()
        for _ in range(200):  # the link closed: its three messages go, nothing else
            if waiting_bytes(b_d) <= base:
                break
            await asyncio.sleep(0.01)
        # Exactly A's messages are left: the link's three went, A's wait on.
        assert waiting_bytes(b_d) == base, (waiting_bytes(b_d), base)
        assert time.monotonic() - t0 < RECV_WAIT_S
    finally:
        r1.close()
        await settle(ws, RECV_WAIT_S + WAIT)
        await ctl.close()
        await a.close()


@async_test(timeout=60)
async def test_no_receive_posted_is_refused_and_never_kept(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    a_d, b_d = pair
    a = await Client.connect(a_d.url, timeout=WAIT)
    later = await Client.connect(b_d.url, timeout=WAIT)
    try:
        addr_b = await later.main_address()
        w = await a.submit_send(addr_b, b"for nobody")
        with pytest.raises(NotFound, match="no receive is posted"):
            await w.wait(WAIT)
        got: list[bytes] = []
        later.submit_recvs(64, 4, got.append)
        await later.imm_count(0)
        await asyncio.sleep(0.2)
        assert got == []
        assert waiting_bytes(b_d) == 0
    finally:
        await later.close()
        await a.close()


def test_receive_pools_are_bounded_per_connection_and_in_all(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """20,000 pipelined SUBMIT_RECVS on one connection: 64 posted, the rest TOO_LARGE,
    the daemon barely grows; a second connection gets only what is left of
    engine.max_recv_pools_total (100)."""
    _a, b = pair
    base = rss(b)
    c1 = RawConn.to(b, timeout=WAIT)
    c1.hello()
    n = 20_000
    c1.sock.sendall(b"".join(
        _frame(Command.SUBMIT_RECVS, i + 2, {"len": 64 + i, "count": 4}) for i in range(n)))
    codes: dict[str, int] = {}
    for _ in range(n):
        f = c1.recv()
        key = f.body.get("code", "ok") if f.is_error else "ok"
        codes[key] = codes.get(key, 0) + 1
    assert codes == {"ok": 64, "TOO_LARGE": n - 64}, codes
    assert rss(b) - base < 16 * MiB, (rss(b) - base) / MiB
    c2 = RawConn.to(b, timeout=WAIT)
    c2.hello()
    replies = [c2.request(Command.SUBMIT_RECVS, {"len": 64, "count": 1})
               for _ in range(POOLS_TOTAL - 64 + 1)]
    assert all(not r.is_error for r in replies[:-1])
    assert replies[-1].is_error and "max_recv_pools_total" in replies[-1].body["message"]
    c1.close()
    # c1's pools went with it: c2 may post again (once the daemon saw the close).
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        r = c2.request(Command.SUBMIT_RECVS, {"len": 64, "count": 1})
        if not r.is_error:
            break
        time.sleep(0.05)
    assert not r.is_error, r.body
    c2.close()


def _frame(cmd: int, seq: int, body: dict) -> bytes:
    from transferd.protocol.frames import encode_frame
    return encode_frame(cmd, 0, seq, body, 0)


def test_an_inbound_link_whose_acks_go_unread_stops_reading(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """A peer (the real handshake, the cluster secret) that sends 4-byte WRITEs and reads
    no ACK: before, B kept reading and queueing ACKs (45 MiB sent, +265 MiB in 6 s).
    Now B stops reading that link once 256 KiB of ACKs wait, so the sender stalls and
    B stays small; once the sender reads, every write lands and is acknowledged once."""
    _a, b = pair
    ctl = RawConn.to(b, timeout=WAIT)
    ctl.hello()
    buf = ctl.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 4096}).body["buffer"]
    mr = ctl.request(Command.REG_MR, {"buffer": buf})
    assert not mr.is_error, mr.body
    ptr, rkeys = mr.body["desc"][0], mr.body["desc"][2]
    addr_b = NetAddr.from_bytes(ctl.request(Command.MAIN_ADDRESS).body["addr"])
    imm = 0x5A5A0000 + (rss(b) & 0xFFFF)
    frame = data_frame(PeerCommand.WRITE, {"op": 1, "part": 0, "rkey": rkeys[0][1],
                                           "addrs": [ptr], "lens": [4], "imm": imm}, b"abcd")
    chunk = frame * 4096
    base = rss(b)
    with FakePeer(addr_b, 0, SECRET) as p:
        p.handshake()
        sock = p.conn.sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        sock.settimeout(1.0)
        sent, limit = 0, 45 * MiB
        stalled = False
        while sent < limit:
            try:
                n = sock.send(memoryview(chunk)[sent % len(chunk):])
            except TimeoutError:
                stalled = True  # B reads nothing more: its ACKs wait for us
                break
            sent += n
        grew = rss(b) - base
        assert stalled, f"B read all {sent / MiB:.0f} MiB without its ACKs being read"
        assert grew < 24 * MiB, grew / MiB
        # Finish the frame cut in the middle, then read: everything lands, once each.
        sock.settimeout(WAIT)
        if sent % len(frame):
            tail = len(frame) - sent % len(frame)
            reader = threading.Thread(target=_read_acks, args=(p, sent // len(frame) + 1))
            reader.start()
            sock.sendall(frame[-tail:])
            sent += tail
        else:
            reader = threading.Thread(target=_read_acks, args=(p, sent // len(frame)))
            reader.start()
        reader.join(WAIT * 3)
        assert not reader.is_alive()
        frames = sent // len(frame)
        assert _acks_seen[-1] == frames
    r = ctl.request(Command.IMM_COUNT, {"imm": imm})
    assert r.body["value"] == frames, (r.body, frames)
    ctl.close()


_acks_seen: list[int] = []


def _read_acks(p: FakePeer, want: int) -> None:
    n, bad = 0, 0
    deadline = time.monotonic() + WAIT * 3
    while n < want and time.monotonic() < deadline:
        try:
            ack = p.recv()
        except ConnectionError:
            break
        n += 1
        bad += ack.cmd != PeerCommand.ACK or ack.body.get("ok") is not True
    _acks_seen.append(n if not bad else -bad)
