"""Verified READs (RX_CRC) of whole large regions, asked by a hand-made peer.

The responder takes the CRC32C of a verified READ's answer before its first byte goes
(the checksum travels in the READ_DATA's header).  A peer may ask for any length its
rkey's region holds, and that checksum was taken on the link's loop, which for the
default loop worker is the daemon's own: a READ of a whole 4 GiB region held it
0.17 s (more where the CRC32C is slower), and a peer dialling a link per READ (closing
each without taking the answer) could keep it held.  Now an answer of more than
CRC_INLINE_MAX (16 MiB) has its checksum taken on a thread while the link reads no
further (as a READ of device memory waits for staging): other clients are served
meanwhile, and the checksum sent is the bytes'.
"""

from __future__ import annotations

import socket
import threading
import time

from tests.conftest import DaemonFactory
from tests.helpers import RawConn, pattern
from tests.integration.engine_cluster import SECRET, engine_env, secret_file
from tests.integration.fake_peer import FakePeer
from transferd.engine.port import CRC_INLINE_MAX
from transferd.protocol.constants import Command
from transferd.protocol.crc import crc_of
from transferd.protocol.peer_ext import parse_ext
from transferd.protocol.peer_wire import READ_DATA, READ_DATA_HEAD, encode_read
from transferd.protocol.values import MrDesc

MiB = 1 << 20
BIG = 4000 * MiB  # untouched (zero pages): no memory of the box's taken


def region(c: RawConn, size: int, data: bytes | None = None, device: str | None = None
            ) -> MrDesc:
    body: dict[str, object] = {"size": size}
    if device is not None:
        body["device"] = device
    reply = c.request(Command.ALLOC_BUFFER, body)
    assert not reply.is_error, reply.body
    buf = reply.body["buffer"]
    if data is not None:
        assert not c.request(Command.SET_TENSOR, {"tensor": [buf, 0, len(data)]}, data).is_error
    return MrDesc.from_wire(c.request(Command.REG_MR, {"buffer": buf, "access": "r"})
                            .body["desc"])


def exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(min(n - len(out), 1 << 20))
        if not got:
            raise ConnectionError("closed")
        out += got
    return bytes(out)


def test_a_long_verified_read_is_checksummed_off_the_loop(daemon_factory: DaemonFactory
                                                          ) -> None:
    env = engine_env(["127.0.0.1"], "tcp", secret_file=secret_file())
    b = daemon_factory(env={**env, "TRANSFERD_MEMORY_HOST_LIMIT_MIB": "4200"})
    c = RawConn.to(b, timeout=30)
    c.hello()
    # The checksum sent is the bytes': a 40 MiB answer (past CRC_INLINE_MAX), read whole.
    n = 40 * MiB
    assert n > CRC_INLINE_MAX
    data = pattern(n, seed=9)
    small = region(c, n, data)
    (addr, rkey), = small.rkeys
    with FakePeer(addr, 0, SECRET) as p:
        p.handshake()
        p.conn.sock.sendall(encode_read(1, 0, rkey, [small.ptr], [n], crc=True))
        head = exact(p.conn.sock, READ_DATA_HEAD.size)
        cmd, status, mlen, part, op, plen = READ_DATA_HEAD.unpack(head)
        assert (cmd, status, op, part, plen) == (READ_DATA, 0, 1, 0, n), (cmd, status, plen)
        want, _ = parse_ext(exact(p.conn.sock, mlen), 0, mlen, "READ_DATA")
        got = exact(p.conn.sock, n)
        assert got == data and want == crc_of([data])
    # Links that each ask for the whole of a 4000 MiB region, verified, and go: another
    # client's round trips meanwhile.
    big = region(c, BIG)
    (addr, rkey), = big.rkeys
    probe = RawConn.to(b, timeout=30)
    probe.hello()
    worst, stop = [0.0], threading.Event()

    def probing() -> None:
        while not stop.is_set():
            t = time.monotonic()
            probe.request(Command.GET_DEVICES, {})
            worst[0] = max(worst[0], time.monotonic() - t)
            time.sleep(0.005)

    peers = []
    for _ in range(8):
        p = FakePeer(addr, 0, SECRET)
        p.handshake()
        peers.append(p)
    th = threading.Thread(target=probing, daemon=True)
    th.start()
    time.sleep(0.1)
    for k, p in enumerate(peers):
        p.conn.sock.sendall(encode_read(100 + k, 0, rkey, [big.ptr], [BIG], crc=True))
    for p in peers:  # each answer's header comes once its checksum is taken
        head = exact(p.conn.sock, READ_DATA_HEAD.size)
        assert READ_DATA_HEAD.unpack(head)[1] == 0
        p.close()
    time.sleep(0.1)
    stop.set()
    th.join(10)
    # (Before: 1.28 s with six such READs; the CRC32C of all eight takes about 1.4 s.)
    assert worst[0] < 0.5, f"another client waited {worst[0]:.2f} s"
    assert not c.request(Command.GET_DEVICES, {}).is_error
    assert "Traceback" not in b.stderr, b.output()
