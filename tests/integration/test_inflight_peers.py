"""A peer's work at this daemon, in flight (issue 20, docs/integrity.md): a traced
SEND waiting for a busy receive is listed by the receiving daemon's `transferd
inflight` with the sender's trace id (carried in the SEND frame), logged there with it
and warned about as stalled; a READ this daemon is answering to a peer that takes
nothing is listed as answering (bytes sent of total, the reader's trace id, the peer
as owner) and warned about too; a receiving client that asks (SUBMIT_RECVS "trace")
gets each message's traceparent, and a receive longer than any message is clamped."""

from __future__ import annotations

import asyncio
import secrets
import socket

import pytest

from client import NetAddr
from tests.helpers import DaemonProcess, RawConn, async_test, wait_until
from tests.integration import engine_cluster
from tests.integration.engine_cluster import (
    RAILS,
    SECRET,
    WAIT,
    MiB,
    engine_env,
    inflight,
    nodes,
    secret_file,
    settle,
    start_many,
)
from tests.integration.fake_peer import FakePeer
from tests.integration.test_engine_reads import region
from tests.integration.test_receives import stalled_reader
from transferd.protocol import trace
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import NotFound
from transferd.protocol.frames import Frame
from transferd.protocol.peer_ext import encode_ext
from transferd.protocol.peer_handshake import SEND_EXT
from transferd.protocol.peer_wire import encode_read

own_daemons = engine_cluster.own_daemons


def traceparent() -> tuple[str, str]:
    tid = secrets.token_hex(16)
    return tid, f"00-{tid}-{secrets.token_hex(8)}-01"


@async_test(timeout=90)
async def test_a_traced_send_waiting_for_a_receive_is_listed_and_logged_at_the_receiver(
        own_daemons: list[DaemonProcess]) -> None:
    a_d, b_d = start_many([
        {"env": {"TRANSFERD_LOG_LEVEL": "debug",
                 **engine_env(RAILS[n], secret_file=secret_file(), stall_warn_s=0.4,
                              recv_wait_s=30, peer_timeout_s=60)}}
        for n in "ab"])
    own_daemons += [a_d, b_d]
    tid, tp = traceparent()
    # B's client posts one receive (asking for trace ids) and reads nothing: the first
    # messages fill its socket, the next is held in its transport, the rest wait.
    reader = stalled_reader(b_d, MiB, 1, trace=True)
    try:
        async with nodes(a_d) as (a,):
            addr = main_address(b_d)
            fill = [await a.client.submit_send(addr, bytes([i]) * MiB) for i in range(12)]
            c = await a.client.submit_send(addr, b"traced message", traceparent=tp)

            def listed() -> list[dict]:
                return [e for e in inflight(b_d) if e["trace_id"] == tid]

            assert await asyncio.to_thread(wait_until, lambda: bool(listed()), WAIT), \
                (inflight(b_d), b_d.output())
            (e,) = listed()
            assert e["kind"] == "incoming send", e
            assert e["stage"] == "waiting for a receive", e
            assert (e["done"], e["total"]) == (0, len(b"traced message")), e
            assert e["peer"] == f"{main_address(a_d).node:016x}" and e["rails"] == [0], e
            assert e["owner"] and e["op"] > 0, e
            # The message ahead of it, in the reader's transport, is listed as delivering.
            assert any(x["kind"] == "incoming send" and x["stage"] == "delivering"
                       for x in inflight(b_d))
            # B's log has the arrival with the sender's trace id, and the stall warning.
            assert tid in b_d.stderr and "arrived" in b_d.stderr, b_d.output()
            assert await asyncio.to_thread(
                wait_until, lambda: "stalled: incoming send" in b_d.stderr
                and tid in _stall_lines(b_d), WAIT), b_d.output()
            line = _stall_lines(b_d)
            assert "waiting for a receive for" in line and "14 bytes" in line, line
            # The reader reads at last: everything arrives, the traced SEND completes,
            # and B logs its delivery with the trace id; nothing is listed any more.
            got = await asyncio.to_thread(read_events, reader, 13)
            assert [bytes(f.payload or b"") for f in got][-1] == b"traced message"
            # The message EVENT carries the traceparent (asked for with "trace"); the
            # untraced ones are the body of before.
            assert got[-1].body == {"from": [e_node(a_d), 0], "len": 14, "traceparent": tp}
            assert all(set(f.body) == {"from", "len"} for f in got[:-1])
            assert await settle([c]) == [None]
            await settle(fill)
            assert await asyncio.to_thread(
                wait_until, lambda: "delivered" in b_d.stderr, WAIT), b_d.output()
            assert not listed()
    finally:
        reader.close()


def read_events(conn: RawConn, want: int) -> list[Frame]:
    got = [conn.recv() for _ in range(want)]
    assert all(f.cmd == Command.SUBMIT_RECVS and f.flags & Flag.EVENT for f in got)
    return got


def e_node(d: DaemonProcess) -> int:
    return main_address(d).node


def main_address(d: DaemonProcess) -> NetAddr:
    """``d``'s engine address (over a raw connection of its own)."""
    ctl = RawConn.to(d)
    try:
        ctl.hello()
        return NetAddr.from_bytes(ctl.request(Command.MAIN_ADDRESS).body["addr"])
    finally:
        ctl.close()


def _stall_lines(d: DaemonProcess) -> str:
    return "\n".join(ln for ln in d.stderr.splitlines() if "stalled:" in ln)


@async_test(timeout=60)
async def test_a_read_being_answered_to_a_peer_that_takes_nothing_is_listed(
        own_daemons: list[DaemonProcess]) -> None:
    (b_d,) = start_many([{"env": engine_env(RAILS["b"], secret_file=secret_file(),
                                            stall_warn_s=0.4)}])
    own_daemons.append(b_d)
    tid, tp = traceparent()
    n = 32 * MiB
    async with nodes(b_d) as (b,):
        src = await region(b, n, seed=52, access="r")
        (_, rkey), _ = src.desc.rkeys
        with FakePeer(main_address(b_d), 0, SECRET) as p:
            await asyncio.to_thread(p.handshake)
            # (The daemon says it reads a SEND's extension block.)
            assert SEND_EXT in p.hs.peer_features
            p.conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            p.conn.sock.sendall(encode_read(3, 0, rkey, [src.desc.ptr], [n],
                                            ext=encode_ext(None, trace.parse(tp))))

            def listed() -> list[dict]:
                return [e for e in inflight(b_d) if e["trace_id"] == tid]

            assert await asyncio.to_thread(wait_until, lambda: bool(listed()), WAIT), \
                (inflight(b_d), b_d.output())
            (e,) = listed()
            assert e["kind"] == "incoming read" and e["stage"] == "answering", e
            assert e["total"] == n and 0 <= e["done"] < n, e
            assert (e["op"], e["what"], e["rails"]) == (3, "part 0", [0]), e
            assert e["peer"] == f"{p.me.node:016x}", e
            here = p.conn.sock.getsockname()
            assert e["owner"] == f"{here[0]}:{here[1]}", e
            assert await asyncio.to_thread(
                wait_until, lambda: "stalled: incoming read 3" in b_d.stderr, WAIT), \
                b_d.output()
            line = _stall_lines(b_d)
            assert "answering for" in line and tid in line and "33,554,432 bytes" in line
        # The peer is gone: nothing of it is in flight any more.
        assert await asyncio.to_thread(wait_until, lambda: not listed(), WAIT)
        assert not [e for e in inflight(b_d) if e["kind"] == "incoming read"]


@async_test(timeout=60)
async def test_a_client_that_asks_gets_the_senders_traceparent_and_any_length_is_taken(
        own_daemons: list[DaemonProcess]) -> None:
    """Client.submit_recvs(traced=True): each message with its sender's traceparent (None
    for an untraced SEND); a length past the largest message (2^64-1) is clamped, not
    refused: the receive takes the largest message there is."""
    a_d, b_d = start_many([{"env": engine_env(RAILS[n], secret_file=secret_file())}
                           for n in "ab"])
    own_daemons += [a_d, b_d]
    tid, tp = traceparent()
    async with nodes(a_d, b_d) as (a, b):
        addr = await b.client.main_address()
        # No receive posted yet: refused at once, and B's WARNING carries the trace id.
        with pytest.raises(NotFound):
            early = await a.client.submit_send(addr, b"too early", traceparent=tp)
            await early.wait(WAIT)
        assert await asyncio.to_thread(
            wait_until, lambda: "peer message refused" in b_d.stderr, WAIT), b_d.output()
        (line,) = [ln for ln in b_d.stderr.splitlines() if "peer message refused" in ln]
        assert "NOT_FOUND" in line and tid in line, line
        got: list[tuple[bytes, str | None]] = []
        b.client.submit_recvs((1 << 64) - 1, 2, lambda m, t: got.append((m, t)), traced=True)
        await b.client.synchronize()
        big = bytes(range(256)) * (MiB // 256)
        cs = [await a.client.submit_send(addr, big, traceparent=tp),
              await a.client.submit_send(addr, b"plain")]
        assert await settle(cs) == [None, None]
        assert await asyncio.to_thread(wait_until, lambda: len(got) == 2, WAIT)
        assert got == [(big, tp), (b"plain", None)]
    # ("trace" is a bool, as the other optional fields are.)
    ctl = RawConn.to(b_d)
    try:
        ctl.hello()
        r = ctl.request(Command.SUBMIT_RECVS, {"len": 64, "count": 1, "trace": "yes"})
        assert r.is_error and "'trace'" in r.body["message"], r.body
    finally:
        ctl.close()
