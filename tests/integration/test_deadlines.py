"""Deadlines and CANCEL against a live daemon: every submit and expectation ends exactly once
(done, failed, TIMEOUT or CANCELLED), a client cancels its own and nobody else's.

The peer that never answers is a listening socket nobody accepts on: a write to it waits
for its link forever, so only a deadline or a CANCEL ends it before engine.peer_timeout_s.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from client import Client, MrDesc, MrHandle, NetAddr, RemoteBuffer
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, async_test, metric, scrape, wait_until
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import BadRequest, Cancelled, Timeout
from transferd.protocol.frames import Frame

MiB = 1 << 20


@pytest.fixture
def silent() -> Iterator[socket.socket]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)  # never accepted, never read: the kernel completes the connects
    yield s
    s.close()


@pytest.fixture
def engine_daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    # A short default for expectations; the peer timeout stays long (30 s), so whatever
    # ends a write sooner is the deadline or the CANCEL under test.
    return daemon_factory(env={"TRANSFERD_ENGINE_EXPECT_TIMEOUT_S": "0.5",
                               "TRANSFERD_ENGINE_MAX_EXPECT_TIMEOUT_S": "60"})


def _nowhere(silent: socket.socket, size: int) -> MrDesc:
    return MrDesc(1 << 20, [(NetAddr(0x5157, 0, (silent.getsockname(),)), 0x1234)], size)


async def _to_nowhere(c: Client, silent: socket.socket) -> tuple[RemoteBuffer, MrHandle, MrDesc]:
    """A registered MiB of ``c``'s, and a destination of its size on the silent peer."""
    buf = await c.alloc_buffer(MiB)
    mr, _ = await c.reg_mr(buf)
    return buf, mr, _nowhere(silent, MiB)


@async_test(timeout=60)
async def test_a_write_to_a_silent_peer_is_cancelled_and_its_slot_freed(
    engine_daemon: DaemonProcess, silent: socket.socket
) -> None:
    async with await Client.connect(engine_daemon.url) as c:
        buf, mr, dst = await _to_nowhere(c, silent)
        ws = [await c.submit_single_write(4096, None, (mr, 0), (dst, 0)) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in ws)
        t0 = time.monotonic()
        assert await ws[1].cancel() is True
        assert time.monotonic() - t0 < 2  # not the 30 s peer timeout
        # Ended, exactly once, with CANCELLED; the others still wait.
        assert ws[1].done()
        with pytest.raises(Cancelled, match="cancelled by the client"):
            await ws[1]
        assert not ws[0].done() and not ws[2].done()
        assert await ws[1].cancel() is False  # ended already: nothing to do
        for w in (ws[0], ws[2]):
            assert await w.cancel() is True
        # SYNCHRONIZE has nothing left to wait for.
        await asyncio.wait_for(c.synchronize(), 5)
        await c.free_buffer(buf)


@async_test(timeout=60)
async def test_a_write_whose_awaiter_gave_up_is_cancelled_on_the_daemon(
    engine_daemon: DaemonProcess, silent: socket.socket
) -> None:
    async with await Client.connect(engine_daemon.url) as c:
        buf, mr, dst = await _to_nowhere(c, silent)
        w = await c.submit_single_write(4096, None, (mr, 0), (dst, 0))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(w, 0.2)  # cancels the Completion: so the daemon's write
        # SYNCHRONIZE has nothing left to wait for: not the 30 s peer timeout.
        await asyncio.wait_for(c.synchronize(), 5)
        assert time.monotonic() - t0 < 5
        # A wait that times out is the caller's alone: the write goes on.
        w = await c.submit_single_write(4096, None, (mr, 0), (dst, 0))
        with pytest.raises(TimeoutError):
            await w.wait(0.2)
        assert not w.done() and await w.cancel() is True
        await c.free_buffer(buf)


@async_test(timeout=60)
async def test_a_write_past_its_own_deadline_is_timeout(
    engine_daemon: DaemonProcess, silent: socket.socket
) -> None:
    async with await Client.connect(engine_daemon.url) as c:
        buf, mr, dst = await _to_nowhere(c, silent)
        t0 = time.monotonic()
        w = await c.submit_single_write(4096, None, (mr, 0), (dst, 0), timeout=0.3)
        with pytest.raises(Timeout, match="outcome is unknown"):
            await asyncio.wait_for(w, 10)
        assert 0.25 <= time.monotonic() - t0 < 5
        assert await w.cancel() is False
        # Over the longest deadline (engine.peer_timeout_s, 30 s), and malformed ones.
        for bad in (31.0, 0.0):
            w = await c.submit_single_write(8, None, (mr, 0), (dst, 0), timeout=bad)
            with pytest.raises(BadRequest, match="timeout_ms"):
                await asyncio.wait_for(w, 5)
        with pytest.raises(BadRequest, match="timeout_ms"):
            await c.conn.request(Command.BARRIER, {"imm": 1, "dsts": [dst.to_wire()],
                                                  "timeout_ms": True})
        await c.free_buffer(buf)


@async_test(timeout=60)
async def test_expectations_time_out_and_are_cancelled_consuming_nothing(
    engine_daemon: DaemonProcess,
) -> None:
    imm = 0x7E57
    async with await Client.connect(engine_daemon.url) as c:
        t0 = time.monotonic()
        e = await c.expect_imm_count(imm, 1, wait=False)  # the daemon's default: 0.5 s
        with pytest.raises(Timeout):
            await asyncio.wait_for(e, 10)
        assert 0.4 <= time.monotonic() - t0 < 5
        fired: list[int] = []
        e = await c.expect_imm_count(imm, 1, lambda: fired.append(1), timeout=30)
        assert await e.cancel() is True
        with pytest.raises(Cancelled):
            await e
        assert fired == []  # the callback runs only for a count reached
        with pytest.raises(BadRequest, match=r"engine\.max_expect_timeout_s"):
            await c.expect_imm_count(imm, 1, wait=False, timeout=61)
        # Nothing was consumed by either: a count of 0 fires at once, and the counter is 0.
        assert await c.imm_count(imm) == 0
        done = await c.expect_imm_count(imm, 0, wait=False)
        await asyncio.wait_for(done, 5)
        assert await done.cancel() is False


@async_test(timeout=60)
async def test_another_connections_seq_cannot_be_cancelled(engine_daemon: DaemonProcess) -> None:
    """CANCEL names a seq of its own connection: the same number on another connection is
    NOT_FOUND there, and the first connection's expectation goes on waiting."""
    victim = RawConn.to(engine_daemon)
    victim.hello()
    victim.send(Command.EXPECT_IMM_COUNT, {"imm": 0x7E58, "count": 1, "timeout_ms": 20000},
                seq=77)
    assert not victim.recv().is_error  # registered
    attacker = RawConn.to(engine_daemon)
    attacker.hello()
    r = attacker.request(Command.CANCEL, {"seq": 77})
    assert r.is_error and r.body["code"] == "NOT_FOUND", r.body
    for bad in ({}, {"seq": -1}, {"seq": "77"}, {"seq": 1 << 33}):
        r = attacker.request(Command.CANCEL, bad)
        assert r.is_error and r.body["code"] == "BAD_REQUEST", (bad, r.body)
    # Still waiting: its own CANCEL ends it, EVENT first, then the reply.
    victim.send(Command.CANCEL, {"seq": 77}, seq=78)
    ev = victim.recv()
    assert ev.seq == 77 and ev.flags & Flag.EVENT and ev.flags & Flag.ERROR, ev
    assert ev.body["code"] == "CANCELLED", ev.body
    rep = victim.recv()
    assert rep.seq == 78 and rep.body == {"seq": 77, "cancelled": True}, rep.body
    r = victim.request(Command.CANCEL, {"seq": 77})  # ended: nothing pending by that seq
    assert r.is_error and r.body["code"] == "NOT_FOUND", r.body
    assert not victim.request(Command.STATS).is_error  # both connections still served
    assert not attacker.request(Command.STATS).is_error


def _bad_request(f: Frame, seq: int) -> None:
    assert f.seq == seq and f.flags == int(Flag.REPLY | Flag.ERROR), f
    assert f.body["code"] == "BAD_REQUEST", f.body
    assert f"seq {seq} is already in flight on this connection" in f.body["message"], f.body


def test_a_seq_still_in_flight_is_refused_to_a_second_request(
    engine_daemon: DaemonProcess, silent: socket.socket
) -> None:
    """A submit, an expectation, an arm or a WATCH under the seq of an operation still
    pending on that connection: BAD_REQUEST, and nothing of it starts (before, it was
    taken, its EVENT carried the first's seq, and CANCEL could end only the first).  The
    first goes on, its CANCEL ends it; the seq is free again once it has ended; another
    connection is served throughout."""
    c = RawConn.to(engine_daemon)
    c.hello()
    buf = c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 4 * 4096}).body
    reg = c.request(Command.REG_MR, {"buffer": buf["buffer"], "access": "rw"}).body
    mr, desc = reg["mr"], reg["desc"]
    watcher = c.request(Command.ALLOC_UVM_WATCHER, {}).body["watcher"]
    imm = 0x7E5A
    # A write held by a peer that never answers: pending under seq 300.
    c.send(Command.SINGLE_WRITE, {"len": 16, "src": [mr, 0],
                                  "dst": [_nowhere(silent, MiB).to_wire(), 0]}, seq=300)
    assert c.recv().flags == int(Flag.REPLY)
    again = [
        (Command.SINGLE_WRITE, {"len": 16, "imm": imm, "src": [mr, 0], "dst": [desc, 4096]}),
        (Command.PAGED_WRITES, {"page_len": 16, "imm": imm, "src": [mr, [[0], 4096, 0]],
                                "dst": [desc, [[1], 4096, 0]]}),
        (Command.EXPECT_IMM_COUNT, {"imm": imm, "count": 0}),
        (Command.ARM_PAGED_WRITES, {"watcher": watcher, "value": 0, "page_len": 16,
                                    "imm": imm, "src": [mr, [[0], 4096, 0]],
                                    "dst": [desc, [[1], 4096, 0]]}),
        (Command.WATCH, {"prefix": "seq300/"}),
    ]
    for cmd, body in again:
        c.send(cmd, body, seq=300)
        _bad_request(c.recv(), 300)
    # One-way too: the refusal is its EVENT|ERROR, nothing else.
    c.send(*again[0], seq=300, flags=Flag.NO_REPLY)
    f = c.recv()
    assert f.seq == 300 and f.flags == int(Flag.EVENT | Flag.ERROR), f
    assert "already in flight" in f.body["message"], f.body
    # None of them went: the immediate was never counted, the arm never fired.
    assert c.request(Command.IMM_COUNT, {"imm": imm}).body["value"] == 0
    other = RawConn.to(engine_daemon)
    other.hello()
    assert not other.request(Command.STATS).is_error
    # The first write still waits; its CANCEL ends it (the write's EVENT, then the reply).
    c.send(Command.CANCEL, {"seq": 300}, seq=301)
    ev = c.recv()
    assert ev.seq == 300 and ev.flags == int(Flag.EVENT | Flag.ERROR), ev
    assert ev.cmd == Command.SINGLE_WRITE and ev.body["code"] == "CANCELLED", ev.body
    assert c.recv().body == {"seq": 300, "cancelled": True}
    # Ended: seq 300 names a new operation again, which lands and counts.
    c.send(*again[0], seq=300)
    assert c.recv().flags == int(Flag.REPLY)
    ev = c.recv()
    assert ev.seq == 300 and ev.flags == int(Flag.EVENT) and ev.body == {"ok": True}, ev
    assert c.request(Command.IMM_COUNT, {"imm": imm}).body["value"] == 1
    assert not other.request(Command.STATS).is_error
    c.close()
    other.close()


@async_test(timeout=60)
async def test_a_closed_connections_pending_ops_end_and_leave_nothing(
    engine_daemon: DaemonProcess, silent: socket.socket
) -> None:
    """A client that vanishes with writes waiting on a silent peer and expectations
    registered: the expectations go with it, each write still ends at its deadline, and
    the daemon keeps serving (its slots come back)."""
    c = await Client.connect(engine_daemon.url)
    buf = await c.alloc_buffer(MiB, owner="connection")
    mr, _ = await c.reg_mr(buf)
    dst = _nowhere(silent, MiB)
    for _ in range(50):
        await c.submit_single_write(4096, None, (mr, 0), (dst, 0), timeout=0.5)
        await c.expect_imm_count(0x7E59, 1, wait=False, timeout=30)
    assert engine_daemon.metrics_url is not None
    pending = metric(scrape(engine_daemon.metrics_url), "transferd_engine_expectations_pending")
    assert pending == 50, pending
    await c.close()

    def gauges() -> tuple[float, float]:
        m = scrape(engine_daemon.metrics_url or "")
        return (metric(m, "transferd_engine_expectations_pending"),
                metric(m, "transferd_engine_transfers_in_flight"))

    # The expectations went with the connection; each write ended at its 0.5 s deadline.
    assert wait_until(lambda: gauges() == (0, 0), 10), gauges()
    ctl = RawConn.to(engine_daemon)
    ctl.hello()
    r = ctl.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 4096})
    assert not r.is_error
    assert not ctl.request(Command.FREE_BUFFER, {"buffer": r.body["buffer"]}).is_error


def test_the_blocking_client_cancels_too(engine_daemon: DaemonProcess) -> None:
    from client import SyncClient

    with SyncClient.connect(engine_daemon.url) as sc:
        e = sc.expect_imm_count(0x7E5A, 1, wait=False, timeout=30)
        assert sc.cancel(e) is True
        with pytest.raises(Cancelled):
            sc.wait(e, 5)
        assert sc.cancel(e) is False


@async_test(timeout=60)
async def test_every_kind_of_submit_has_a_deadline_and_can_be_cancelled(
    engine_daemon: DaemonProcess, silent: socket.socket
) -> None:
    from client import Pages, ScatterDst

    async with await Client.connect(engine_daemon.url) as c:
        buf, mr, dst = await _to_nowhere(c, silent)
        addr = dst.rkeys[0][0]
        kinds = {
            "single": lambda t: c.submit_single_write(64, 1, (mr, 0), (dst, 0), timeout=t),
            "paged": lambda t: c.submit_paged_writes(64, 1, (mr, Pages([0, 2], 64)),
                                                     (dst, Pages([1, 3], 64)), timeout=t),
            "scatter": lambda t: c.submit_scatter(None, 1, mr, [ScatterDst(64, 0, (dst, 0))],
                                                  timeout=t),
            "barrier": lambda t: c.submit_barrier(None, 1, [dst], timeout=t),
            "send": lambda t: c.submit_send(addr, b"hello", timeout=t),
        }
        timed = {k: await f(0.3) for k, f in kinds.items()}
        held = {k: await f(None) for k, f in kinds.items()}
        await asyncio.sleep(0.1)
        for k, w in held.items():
            assert not w.done(), k
            assert await w.cancel() is True, k
            with pytest.raises(Cancelled):
                await w
        for k, w in timed.items():
            with pytest.raises(Timeout, match="deadline"):
                await asyncio.wait_for(w, 10)
            assert w.done(), k
        await asyncio.wait_for(c.synchronize(), 5)  # nothing of them is left pending
        await c.free_buffer(buf)
