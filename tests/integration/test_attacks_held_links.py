"""Links that read nothing while a READ waits for its memory side, whose peer hangs up.

A verified READ (RX_CRC) of more than CRC_INLINE_MAX of host memory has its checksum
taken on the engine port's one thread, and a READ of device memory waits for its
staging copy; meanwhile the link reads no further frame (answers stay in order, and a
peer's frames stay in the kernel: back-pressure).  Reading nothing, it did not see its
peer hang up: a peer holding the secret that asked 4000 MiB verified READs on eight
links and went left eight checksums queued, each taken for nobody, and an honest
peer's long verified READ queued behind them waited for all of them.  Now a link held
so watches its socket for the peer's FIN or reset (EPOLLRDHUP, without taking its
frames): the link closes, a checksum not begun is dropped (its placement let go once),
one begun ends and is thrown away; a device READ's staging goes back once its copy
ended, while the link is already gone.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, pattern, wait_until
from tests.integration.engine_cluster import SECRET, engine_env, secret_file
from tests.integration.fake_peer import FakePeer
from tests.integration.test_attacks_read_checksum import exact, region
from transferd.engine.port import CRC_INLINE_MAX
from transferd.protocol.constants import Command
from transferd.protocol.crc import crc_of
from transferd.protocol.peer_ext import parse_ext
from transferd.protocol.peer_wire import READ_DATA, READ_DATA_HEAD, encode_read

MiB = 1 << 20
BIG = 4000 * MiB  # untouched (zero pages): no memory of the box's taken
LINKS = 16
CLOSE_WAIT = "08"


def _head(sock: socket.socket, op: int, n: int) -> int:
    """A READ_DATA's header for ``op``, of ``n`` bytes and with a checksum: its length."""
    cmd, status, mlen, part, got_op, plen = READ_DATA_HEAD.unpack(
        exact(sock, READ_DATA_HEAD.size))
    assert (cmd, status, got_op, part, plen) == (READ_DATA, 0, op, 0, n), (cmd, status, plen)
    return mlen


def _hang_up(p: FakePeer, reset: bool) -> None:
    if reset:  # (a reset, not a FIN: what a killed peer's kernel may send)
        p.conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    p.close()


def _held_by_daemon(pairs: list[tuple[tuple[str, int], tuple[str, int]]]) -> int:
    """How many of these (daemon end, peer end) connections the daemon has not closed
    since their peer did (CLOSE_WAIT)."""
    def hexaddr(h: str) -> tuple[str, int]:
        ip, port = h.split(":")
        return ".".join(str(b) for b in bytes.fromhex(ip)[::-1]), int(port, 16)

    want, held = set(pairs), 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[3] == CLOSE_WAIT and (hexaddr(fields[1]), hexaddr(fields[2])) in want:
                held += 1
    return held


def _ends(p: FakePeer) -> tuple[tuple[str, int], tuple[str, int]]:
    s = p.conn.sock
    return s.getpeername()[:2], s.getsockname()[:2]


def test_abandoned_verified_reads_do_not_delay_an_honest_one(daemon_factory: DaemonFactory
                                                             ) -> None:
    env = engine_env(["127.0.0.1"], "tcp", secret_file=secret_file())
    b = daemon_factory(env={**env, "TRANSFERD_MEMORY_HOST_LIMIT_MIB": "4200"})
    c = RawConn.to(b, timeout=30)
    c.hello()
    n = 40 * MiB  # the honest READ: past CRC_INLINE_MAX, so on the checksum thread too
    assert n > CRC_INLINE_MAX
    data = pattern(n, seed=11)
    small = region(c, n, data)
    big = region(c, BIG)
    (addr, rkey), = big.rkeys
    (_, small_rkey), = small.rkeys
    honest = FakePeer(addr, 0, SECRET)
    honest.handshake()
    peers = []
    try:
        # What one 4000 MiB checksum costs here (the second: the first touches its pages).
        for _ in range(2):
            with FakePeer(addr, 0, SECRET) as p:
                p.handshake()
                t0 = time.monotonic()
                p.conn.sock.sendall(encode_read(1, 0, rkey, [big.ptr], [BIG], crc=True))
                _head(p.conn.sock, 1, BIG)
                one = time.monotonic() - t0
        for _ in range(LINKS):
            p = FakePeer(addr, 0, SECRET)
            p.handshake()
            peers.append(p)
        ends = [_ends(p) for p in peers]
        for k, p in enumerate(peers):  # each asks a whole 4000 MiB verified READ
            p.conn.sock.sendall(encode_read(100 + k, 0, rkey, [big.ptr], [BIG], crc=True))
        # (The links are on the daemon's loop, as this connection is: by its answer the
        # loop has taken those READs in, so the honest one is queued after theirs.)
        assert not c.request(Command.GET_DEVICES, {}).is_error
        for k, p in enumerate(peers):  # and goes without its answer
            _hang_up(p, reset=bool(k % 2))
        t0 = time.monotonic()
        sock = honest.conn.sock
        sock.sendall(encode_read(7, 0, small_rkey, [small.ptr], [n], crc=True))
        mlen = _head(sock, 7, n)  # (it comes once its checksum was taken)
        took = time.monotonic() - t0
        want, _ = parse_ext(exact(sock, mlen), 0, mlen, "READ_DATA")
        assert exact(sock, n) == data and want == crc_of([data])
        # (Before: 0.67 to 0.94 s here, sixteen checksums of 4000 MiB at 0.05 s; now
        # milliseconds: at most a piece of one already begun.)
        assert took < LINKS / 2 * one, (f"the honest READ waited {took:.2f} s; one "
                                        f"checksum takes {one:.2f} s")
        # The FIN'd links' daemon ends are closed too (the reset ones left no trace).
        assert wait_until(lambda: not _held_by_daemon(ends[::2]), 5), \
            f"{_held_by_daemon(ends[::2])} links not closed"
        assert not c.request(Command.GET_DEVICES, {}).is_error
    finally:
        honest.close()
        for p in peers:
            p.close()
    assert "Traceback" not in b.stderr, b.output()


CHUNK, CHUNKS = 256 * 1024, 4


@pytest.fixture
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, str]]:
    hold = os.path.join(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()), "hold")
    env = engine_env(["127.0.0.1"], "tcp", secret_file=secret_file())
    env.update({"STANDIN_CHUNK": str(CHUNK), "STANDIN_CHUNKS": str(CHUNKS),
                "STANDIN_HOLD_FILE": hold})
    d = DaemonProcess(env=env, command=[sys.executable, "-m", "tests.standin_daemon", "-H",
                                        "127.0.0.1", "-p", "0", "--metrics-port", "-1"])
    d.start()
    try:
        d.wait_ready()
        yield d, hold
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(hold)
        d.stop()
    assert "Traceback" not in d.stderr, d.output()


def test_a_device_read_waiting_for_staging_sees_its_peer_go(
        standin: tuple[DaemonProcess, str]) -> None:
    d, hold = standin
    c = RawConn.to(d, timeout=30)
    c.hello()
    whole = CHUNK * CHUNKS  # a READ of this takes every staging chunk of the device
    data = pattern(whole, seed=5)
    dev = region(c, whole, data, device="standin:0")
    (addr, rkey), = dev.rkeys
    with FakePeer(addr, 0, SECRET) as p:
        p.handshake()
        pair = _ends(p)
        open(hold, "w").close()  # the device's stream holds: the copy to staging waits
        try:
            p.conn.sock.sendall(encode_read(1, 0, rkey, [dev.ptr], [whole]))
            p.close()
            # While the copy still waits, the link is closed (before: not until the
            # copy ended, the stream held for as long as it was).
            assert wait_until(lambda: not _held_by_daemon([pair]), 5), \
                "the link of a peer gone was held for its READ's staging"
        finally:
            os.unlink(hold)
    # Its staging went back (once) after the copy: a READ of every chunk again, verified,
    # byte-exact.
    with FakePeer(addr, 0, SECRET) as p:
        p.handshake()
        want: int | None = None
        for _ in range(20):  # (the copy's end, then its chunks back: soon after)
            p.conn.sock.sendall(encode_read(2, 0, rkey, [dev.ptr], [whole], crc=True))
            head = READ_DATA_HEAD.unpack(exact(p.conn.sock, READ_DATA_HEAD.size))
            status, mlen = head[1], head[2]
            if status == 0:
                assert head[4:] == (2, whole), head
                want, _ = parse_ext(exact(p.conn.sock, mlen), 0, mlen, "READ_DATA")
                got = exact(p.conn.sock, whole)
                break
            exact(p.conn.sock, mlen)  # (OUT_OF_MEMORY: the chunks not back yet)
            time.sleep(0.05)
        assert want is not None, "the staging of an abandoned READ never came back"
        assert got == data and want == crc_of([data])
    assert not c.request(Command.GET_DEVICES, {}).is_error
