"""A responder that lies about a READ, against a live daemon: a hand-made peer (its own
listeners, the real handshake with the cluster secret, then raw fixed headers) answers
the daemon's READ with bytes for a read nobody made, with more bytes than were asked,
or with an ACK.  The daemon cuts that link before any byte lands (the reader's region
is unchanged), fails the read, and goes on serving everyone else."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from client import MrDesc, NetAddr
from tests.helpers import DaemonProcess, async_test, digest, metric, scrape, wait_until
from tests.integration.engine_cluster import (
    RAILS,
    SECRET,
    WAIT,
    Node,
    Region,
    engine_env,
    nodes,
    secret_file,
    start_many,
)
from tests.integration.test_engine_reads import region
from tests.peerlink import HostMemory, drain, feed
from transferd.domains.rails import rail_bytes
from transferd.protocol.crc import crc_of
from transferd.protocol.errors import PeerUnreachable, Timeout
from transferd.protocol.peer_ext import encode_ext
from transferd.protocol.peer_handshake import PeerIdentity
from transferd.protocol.peer_inbound import InboundLink
from transferd.protocol.peer_landing import Landing
from transferd.protocol.peer_wire import (
    READ,
    READ_HEAD,
    RX_EXT,
    encode_ack,
    encode_read,
    encode_read_data,
)

HOST = "127.0.0.1"
MiB = 1 << 20


class LyingResponder:
    """A peer node with two rails (listeners on HOST) that authenticates for real and
    then answers every READ with ``lie`` instead of its bytes."""

    def __init__(self, lie: str) -> None:
        self.lie = lie
        self.listeners = []
        for _ in range(2):
            s = socket.socket()
            s.bind((HOST, 0))
            s.listen(8)
            s.settimeout(0.2)
            self.listeners.append(s)
        addrs = tuple(rail_bytes(*s.getsockname()) for s in self.listeners)
        self.me = PeerIdentity(secrets.randbits(62) + 1, 0, addrs)
        self.reads_seen = 0
        # Each READ's flags and extension block (RX_CRC, RX_EXT: issue 20).
        self.flags_seen: list[int] = []
        self.ext_seen: list[bytes] = []
        self.cut = 0  # connections the daemon closed after a lie
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, args=(r,), daemon=True)
                         for r in range(2)]
        for t in self._threads:
            t.start()

    def desc(self, size: int) -> MrDesc:
        return MrDesc(0x10000, [(NetAddr(self.me.node, 0, (a,)), 0x1234 + r)
                                for r, a in enumerate(self.me.addrs)], size)

    def _serve(self, rail: int) -> None:
        lst = self.listeners[rail]
        while not self._stop.is_set():
            try:
                sock, _ = lst.accept()
            except (TimeoutError, OSError):
                continue
            with sock:
                sock.settimeout(5)
                with contextlib.suppress(OSError):
                    self._one(sock, rail)

    def _one(self, sock: socket.socket, rail: int) -> None:
        if self.lie == "silent":
            sock.settimeout(0.2)
        core = InboundLink(self.me, rail, SECRET, time.monotonic(),
                           landing=Landing(HostMemory(2), 2), timeout=5, max_message=1024)
        while not core.authenticated:  # the real handshake, through the sans-IO core
            sock.sendall(drain(core))
            data = sock.recv(65536)
            if not data:
                return
            feed(core, data, time.monotonic())
        sock.sendall(drain(core))
        if self.lie == "deaf":
            # Reads nothing from here on, the link kept open: what the daemon sends
            # stays in its own output once the socket buffers are full.
            self.reads_seen += 1
            self._stop.wait()
            return
        # From here on, raw fixed headers: take the READ, answer with the lie.
        head = self._exact(sock, 32)
        cmd, flags, npages, part, op, _, total = READ_HEAD.unpack(head)
        assert cmd == READ
        ext = int.from_bytes(self._exact(sock, 8)[:4], "little") if flags & RX_EXT else 0
        self._exact(sock, 16 * npages)
        self.flags_seen.append(flags)
        if ext:
            self.ext_seen.append(self._exact(sock, ext))
        self.reads_seen += 1
        if self.lie == "silent":
            # Takes the READ, answers nothing, keeps the link open (a hung peer).
            while not self._stop.is_set():
                try:
                    if not sock.recv(65536):
                        return
                except TimeoutError:
                    continue
            return
        if self.lie == "unasked":
            sock.sendall(encode_read_data(op + 1000, part, total) + b"\xAA" * total)
        elif self.lie == "unreachable":
            # A refusal as its answer whose code says PEER_UNREACHABLE: the peer's word,
            # answered on a live link, not a link of the reader's that failed.
            sock.sendall(encode_read_data(op, part, 0, PeerUnreachable(
                "no route from here, says the peer")))
        elif self.lie == "wrong_crc":
            # Bytes with a checksum that is not theirs (issue 20: a verified read).
            body = b"\xAA" * total
            sock.sendall(encode_read_data(op, part, total, None,
                                          encode_ext(crc_of([body]) ^ 1, None)) + body)
        elif self.lie == "no_crc":
            # Bytes without the checksum the READ asked for.
            sock.sendall(encode_read_data(op, part, total) + b"\xAA" * total)
        elif self.lie == "more":
            sock.sendall(encode_read_data(op, part, total + 4096) + b"\xAA" * (total + 4096))
        else:
            sock.sendall(encode_ack(op, part))
        # The daemon cuts the link: the connection ends (reset or close).
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass
        self.cut += 1

    @staticmethod
    def _exact(sock: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            try:
                data = sock.recv(n - len(buf))
            except TimeoutError:
                continue
            if not data:
                raise ConnectionError("closed")
            buf += data
        return buf

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(2)
        for s in self.listeners:
            s.close()


@pytest.fixture
def daemons() -> Iterator[list[DaemonProcess]]:
    ds = start_many([{"env": engine_env(RAILS[n], secret_file=secret_file())} for n in "ab"])
    yield ds
    for d in ds:
        d.stop()
    for d in ds:
        assert "Traceback" not in d.stderr, d.output()


@pytest.mark.parametrize("lie", ["unasked", "more", "ack"])
@async_test(timeout=60)
async def test_a_lying_responder_is_cut_off_and_nothing_lands(
    daemons: list[DaemonProcess], lie: str
) -> None:
    a_d, b_d = daemons
    liar = LyingResponder(lie)
    try:
        async with nodes(a_d, b_d) as (a, b):
            dst = await region(a, 64 * 1024, seed=31)
            r = await a.client.submit_single_read(4096, (dst.mr, 0), (liar.desc(64 * 1024), 0))
            with pytest.raises(PeerUnreachable):
                await r.wait(WAIT)
            assert liar.reads_seen >= 1
            assert digest(await a.read(dst)) == digest(bytes(dst.data))  # untouched
            # The daemon serves on: a real read from B lands whole.
            src = await region(b, 64 * 1024, seed=32, access="r")
            r = await a.client.submit_single_read(64 * 1024, (dst.mr, 0), (src.desc, 0))
            await r.wait(WAIT)
            assert digest(await a.read(dst)) == digest(bytes(src.data))
            await asyncio.sleep(0.2)
            assert liar.cut == liar.reads_seen  # every lying link was cut
            assert "peer link broken" in a_d.stderr
    finally:
        liar.close()


@async_test(timeout=60)
async def test_a_peer_that_answers_peer_unreachable_fails_the_read_without_a_failover(
    daemons: list[DaemonProcess]
) -> None:
    """Only a link of ours that fails is re-sent on another rail (domains/failover.py);
    any answer from the peer is the transfer's, PEER_UNREACHABLE's code included: the
    read fails with the peer's message, is not asked again on the peer's other rail,
    and no rail of it is marked down."""
    a_d, _ = daemons
    liar = LyingResponder("unreachable")
    try:
        async with nodes(a_d) as (a,):
            dst = await region(a, 64 * 1024, seed=33)
            r = await a.client.submit_single_read(4096, (dst.mr, 0), (liar.desc(64 * 1024), 0))
            with pytest.raises(PeerUnreachable, match="says the peer"):
                await r.wait(WAIT)
            await asyncio.sleep(0.3)
            assert liar.reads_seen == 1  # not re-read on the other rail
            assert "re-sent on rail" not in a_d.stderr
            assert digest(await a.read(dst)) == digest(bytes(dst.data))  # untouched
    finally:
        liar.close()


@async_test(timeout=60)
async def test_a_reader_that_never_takes_its_answers_holds_back_only_itself(
    own: list[DaemonProcess]
) -> None:
    """A hand-made peer dials B, authenticates, asks for 64 x 64 MiB of a readable
    region and reads nothing back.  B answers from the region's own pages (no copies),
    stops reading that link past its watermark, serves everyone else meanwhile, and a
    DEREG_MR of the region cuts the link (a reset) after engine.peer_timeout_s instead of
    waiting for the reader forever."""
    from tests.integration.fake_peer import FakePeer

    (b_d,) = own
    async with nodes(b_d) as (b,):
        src = await region(b, 64 * MiB, seed=51, access="r")
        (addr, rkey), = src.desc.rkeys
        with FakePeer(addr, 0, SECRET) as p:
            p.handshake()
            p.conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            frames = b"".join(encode_read(k, 0, rkey, [src.desc.ptr], [64 * MiB])
                              for k in range(64))
            p.conn.sock.sendall(frames)  # 64 x 48 bytes; 4 GiB asked, nothing taken
            await asyncio.sleep(0.5)
            rss = _rss(b_d)
            # B goes on: another client's buffers, a SET and a GET, while the READs wait.
            other = await b.client.alloc_buffer(MiB)
            await b.client.set_tensor(other.tensor(), b"\x33" * MiB)
            assert bytes(await b.client.get_tensor(other.tensor())) == b"\x33" * MiB
            assert _rss(b_d) - rss < 16 * MiB  # the answers are views, not copies
            t0 = time.monotonic()
            await asyncio.wait_for(b.client.dereg_mr(src.mr), WAIT)
            took = time.monotonic() - t0
            assert 0.5 < took < 8.0, took  # patience (2 s), then the link is cut
            p.conn.sock.settimeout(5)
            got = 0
            with contextlib.suppress(OSError):
                while chunk := p.conn.sock.recv(1 << 20):
                    got += len(chunk)  # until B's cut arrives
            # A cut, not a goodbye: what B's kernel still held of the deregistered
            # region's pages is dropped, not handed over at the reader's pace.
            assert got < 8 * MiB, got
        assert "Traceback" not in b_d.stderr


@async_test(timeout=60)
async def test_a_read_a_responder_never_answers_lets_its_memory_go_when_it_times_out(
    silent: list[DaemonProcess]
) -> None:
    """A peer takes A's READ and never answers, its link kept open (a hung peer: not
    one A's bytes wait for, so not closed as stalled).  The read fails TIMEOUT; the
    buffer it was to land in, freed, was held as long as that link lived (the link
    kept views of it for an answer that never came).  Now its memory goes at once,
    and a late answer could land nowhere."""
    (a_d,) = silent
    liar = LyingResponder("silent")
    try:
        async with nodes(a_d) as (a,):
            dst = await region(a, 8 * MiB, seed=41)
            r = await a.client.submit_single_read(8 * MiB, (dst.mr, 0),
                                                  (liar.desc(8 * MiB), 0))
            with pytest.raises(Timeout):
                await r.wait(WAIT)
            assert liar.reads_seen >= 1
            await _free_at_once(a, a_d, dst)
            # A serves on: a buffer of the same size, written and read back.
            again = await region(a, 8 * MiB, seed=42)
            assert digest(await a.read(again)) == digest(bytes(again.data))
    finally:
        liar.close()
    assert "Traceback" not in a_d.stderr


@pytest.mark.parametrize("ends", ["client-timeout", "peer-timeout"])
@async_test(timeout=90)
async def test_a_write_to_a_peer_that_reads_nothing_lets_its_source_go_when_it_ends(
    silent_pair: list[DaemonProcess], ends: str
) -> None:
    """A peer takes the handshake and then reads nothing: A's 64 MiB write fills the
    socket buffers and the rest waits in A's output, as views of the source.  The write
    ends (the client's own timeout: a cancel; or engine.peer_timeout_s): its parts are
    dropped at once (the half-sent one cuts the link), so the source is deregistered and
    freed with nothing of it lingering, and A goes on serving a write to B, whole."""
    a_d, b_d = silent_pair
    deaf = LyingResponder("deaf")
    try:
        async with nodes(a_d, b_d) as (a, b):
            src = await region(a, 64 * MiB, seed=61)
            w = await a.client.submit_single_write(
                64 * MiB, None, (src.mr, 0), (deaf.desc(64 * MiB), 0),
                **({"timeout": 0.3} if ends == "client-timeout" else {}))
            with pytest.raises(Timeout):
                await w.wait(WAIT)
            assert deaf.reads_seen >= 1
            await _free_at_once(a, a_d, src)
            # A serves on: a write to B lands whole.
            again = await region(a, 8 * MiB, seed=62)
            dst = await region(b, 8 * MiB, seed=63)
            w = await a.client.submit_single_write(8 * MiB, None, (again.mr, 0),
                                                   (dst.desc, 0))
            await w.wait(WAIT)
            assert digest(await b.read(dst)) == digest(bytes(again.data))
    finally:
        deaf.close()
    assert "Traceback" not in a_d.stderr


@pytest.fixture
def silent_pair() -> Iterator[list[DaemonProcess]]:
    """A (a deadline of 1 s for what it sends to peers), and B."""
    ds = start_many([{"env": engine_env(RAILS["a"], secret_file=secret_file(),
                                        peer_timeout_s=1)},
                     {"env": engine_env(RAILS["b"], secret_file=secret_file())}])
    yield ds
    for d in ds:
        d.stop()


async def _free_at_once(node: Node, d: DaemonProcess, r: Region) -> None:
    """Deregister and free ``r``'s buffer: nothing of it lingers within 5 s."""
    await node.client.dereg_mr(r.mr)
    node.buffers.remove(r.buf)
    await node.client.free_buffer(r.buf)
    assert await asyncio.to_thread(wait_until, lambda: _lingering(d) == 0, 5), _lingering(d)


def _lingering(d: DaemonProcess) -> float:
    assert d.metrics_url is not None
    return metric(scrape(d.metrics_url), "transferd_buffer_lingering_bytes", device="cpu")


@pytest.fixture
def silent() -> Iterator[list[DaemonProcess]]:
    ds = start_many([{"env": engine_env(RAILS["a"], secret_file=secret_file(),
                                        peer_timeout_s=1)}])
    yield ds
    for d in ds:
        d.stop()


def _rss(d: DaemonProcess) -> int:
    assert d.proc is not None
    with open(f"/proc/{d.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.fixture
def own() -> Iterator[list[DaemonProcess]]:
    ds = start_many([{"env": engine_env(RAILS["c"][:1], secret_file=secret_file(),
                                        peer_timeout_s=2)}])
    yield ds
    for d in ds:
        d.stop()
