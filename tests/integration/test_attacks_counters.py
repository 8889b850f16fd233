"""Immediates' counts nobody consumes: the receiver's table of them, bounded.

A write's immediate adds to a count the receiver holds until an EXPECT_IMM_COUNT
consumes it (an expectation may come after the writes). A count at 0 goes, but one
nobody expects stays for good, and a write may name any of 2^32 immediates: a peer
(or any client of any daemon holding an rkey of a writable region here) writing 1-byte
writes with an immediate of their own each grew the receiver by about 65 bytes a write,
for good (300,000 such writes from one hand-made peer in 5 s: +19.6 MiB, never given
back). Now at most engine.max_counters counts are held: past it, a write with an
immediate that has none is refused (OUT_OF_MEMORY, before a byte lands); one whose
immediate has a count or an expectation waiting lands; consuming a count makes room.
"""

from __future__ import annotations

import itertools
import socket
import threading

from tests.conftest import DaemonFactory
from tests.helpers import RawConn
from tests.integration.engine_cluster import SECRET, engine_env, secret_file
from tests.integration.fake_peer import FakePeer, raw_write
from transferd.protocol.constants import Command
from transferd.protocol.values import MrDesc

CAP = 1000
BASE = 5_000_000  # the test's immediates: BASE + i


def _writes(p: FakePeer, desc: MrDesc, rkey: int, imms: list[int], ops: itertools.count,
            offset: int = 0, byte: bytes = b"\x01") -> list[dict]:
    """One 1-byte WRITE per immediate (pipelined, the ACKs read by a thread); their
    ACK bodies in order."""
    acks: list = []

    def read() -> None:
        for _ in imms:
            acks.append(p.recv().body)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    p.conn.send_raw(b"".join(
        raw_write({"op": next(ops), "part": 0, "rkey": rkey, "addrs": [desc.ptr + offset],
                   "lens": [1], "imm": imm}, byte) for imm in imms))
    t.join(30)
    assert not t.is_alive(), f"{len(acks)} of {len(imms)} ACKs"
    return acks


def test_counts_nobody_consumes_are_bounded(daemon_factory: DaemonFactory) -> None:
    env = engine_env(["127.0.0.1"], "tcp", secret_file=secret_file())
    b = daemon_factory(env={**env, "TRANSFERD_ENGINE_MAX_COUNTERS": str(CAP)})
    c = RawConn.to(b, timeout=30)
    c.hello()
    buf = c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 4096}).body["buffer"]
    desc = MrDesc.from_wire(c.request(Command.REG_MR, {"buffer": buf}).body["desc"])
    (addr, rkey), = desc.rkeys
    ops = itertools.count(1)
    with FakePeer(addr, 0, SECRET) as p:
        p.handshake()
        p.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The cap's worth, each with an immediate of its own: all land.
        acks = _writes(p, desc, rkey, [BASE + i for i in range(CAP)], ops)
        assert all(a.get("ok") for a in acks), [a for a in acks if not a.get("ok")][:2]
        # One more new immediate (and a thousand): refused before a byte lands.
        acks = _writes(p, desc, rkey, [BASE + CAP + i for i in range(CAP)], ops,
                       offset=100, byte=b"\x77")
        assert all(a.get("code") == "OUT_OF_MEMORY" and "engine.max_counters" in a["message"]
                   for a in acks), acks[:2]
        got = c.request(Command.GET_TENSOR, {"tensor": [buf, 100, 1]})
        assert got.payload == b"\x00", got  # nothing of the refused ones landed
        assert c.request(Command.IMM_COUNT, {"imm": BASE + CAP}).body["value"] == 0
        # A write whose immediate has a count lands and counts, at the cap.
        (a,) = _writes(p, desc, rkey, [BASE + 7], ops)
        assert a.get("ok"), a
        assert c.request(Command.IMM_COUNT, {"imm": BASE + 7}).body["value"] == 2
        # So does one an expectation waits on (its count is consumed as it lands).
        want = BASE + 10 * CAP
        seq = c.send(Command.EXPECT_IMM_COUNT, {"imm": want, "count": 1, "timeout_ms": 20_000})
        assert not c.recv().is_error  # (taken: its reply; its EVENT when it fires)
        (a,) = _writes(p, desc, rkey, [want], ops)
        assert a.get("ok"), a
        ev = c.recv()
        assert ev.is_event and ev.seq == seq and not ev.is_error, ev
        # Consuming a count makes room for one new immediate, and one only.
        seq = c.send(Command.EXPECT_IMM_COUNT, {"imm": BASE + 3, "count": 1})
        assert not c.recv().is_error
        ev = c.recv()
        assert ev.is_event and ev.seq == seq and not ev.is_error, ev
        acks = _writes(p, desc, rkey, [BASE + 20 * CAP, BASE + 20 * CAP + 1], ops)
        assert acks[0].get("ok") and acks[1].get("code") == "OUT_OF_MEMORY", acks
    # The daemon serves on.
    assert not c.request(Command.GET_DEVICES, {}).is_error
    assert b.alive()
    assert "Traceback" not in b.stderr, b.output()
