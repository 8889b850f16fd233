"""SIGTERM during load: the drain (server.drain_s, transferd/daemon.py, rpc_server/drain.py).

Real daemons A and B (subprocesses, their engines linked over loopback).  Clients of A
load it with engine writes into B and with SETs; A gets SIGTERM mid-load.  Every write
A reported done is checked, by checksum, on B (the receiving daemon, still running);
the rest failed with a typed error; nothing hangs; A exits 0 within its drain time plus
slack.  With B stopped (SIGSTOP) the drain time runs out: A refuses new connections and
requests meanwhile, fails the stuck writes with TIMEOUT, and still exits 0 in time.
"""

from __future__ import annotations

import asyncio
import configparser
import contextlib
import hashlib
import signal
import socket
import time
from pathlib import Path
from typing import Any

from client import Client, Completion, TransferdError
from tests.helpers import REPO, DaemonProcess, RawConn, async_test
from tests.integration.engine_cluster import WAIT, fresh_imm, start_many, stopped
from transferd.config_sections import ServerConfig
from transferd.protocol.constants import Command
from transferd.protocol.errors import Cancelled, ConnectionLost, Timeout

MiB = 1 << 20
SLOT = 1 * MiB
SLOTS = 48  # per writer: 48 MiB each, ~0.1-1 s of writes in flight at the signal
WRITERS = 3
# The engine's close (at most 5 s) and the last replies (at most 1 s) come after drain_s.
SLACK = 8.0


def _pair(drain_s: float) -> tuple[DaemonProcess, DaemonProcess]:
    env_a = {"TRANSFERD_SERVER_DRAIN_S": str(drain_s),
             "TRANSFERD_ENGINE_HOST_RAILS": "127.0.0.50"}
    env_b = {"TRANSFERD_ENGINE_HOST_RAILS": "127.0.0.51"}
    a, b = start_many([{"env": env_a}, {"env": env_b}])
    return a, b


def _sha(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


async def _outcome(c: Completion) -> BaseException | None:
    try:
        await c.wait(WAIT)
    except TimeoutError:
        raise AssertionError(f"{c!r} never completed (neither done nor failed)") from None
    except TransferdError as exc:
        return exc
    return None


def _exit_within(d: DaemonProcess, t0: float, limit: float) -> float:
    assert d.proc is not None
    rc = d.proc.wait(limit + 5)
    took = time.monotonic() - t0
    assert rc == 0, f"exit {rc}\n{d.output()}"
    assert took <= limit, f"exited after {took:.1f} s, more than {limit:.1f} s"
    return took


@async_test(timeout=90)
async def test_sigterm_under_load_finishes_what_it_reported_done() -> None:
    drain_s = 10.0
    a, b = _pair(drain_s)
    try:
        writers = [await Client.connect(a.url, timeout=WAIT) for _ in range(WRITERS)]
        setter = await Client.connect(a.url, timeout=WAIT)
        owner = await Client.connect(b.url, timeout=WAIT)
        plan = []
        for i, w in enumerate(writers):
            src = await w.alloc_buffer(SLOT * SLOTS)
            data = bytes([i + 1]) * 7 + bytes(range(249))
            data = (data * (SLOT * SLOTS // len(data) + 1))[:SLOT * SLOTS]
            await w.set_tensor(src.tensor(), data)
            smr, _ = await w.reg_mr(src)
            dst = await owner.alloc_buffer(SLOT * SLOTS)
            await owner.buffer_clear(dst, 0)
            _, desc = await owner.reg_mr(dst)
            plan.append((w, smr, dst, desc, data, fresh_imm()))
        sbuf = await setter.alloc_buffer(SLOT)

        async def sets() -> list[BaseException | None]:
            out: list[BaseException | None] = []
            for k in range(10_000):  # bounded; ends at the first refusal
                try:
                    data = bytes([k % 251]) * SLOT
                    await asyncio.wait_for(setter.set_tensor(sbuf.tensor(), data), WAIT)
                    out.append(None)
                except TransferdError as exc:
                    out.append(exc)
                    return out
            return out

        set_task = asyncio.ensure_future(sets())
        completions: list[list[Completion]] = []
        for w, smr, _dst, desc, _data, imm in plan:
            completions.append([await w.submit_single_write(SLOT, imm, (smr, k * SLOT),
                                                            (desc, k * SLOT))
                                for k in range(SLOTS)])
        # Mid-load: some writes done, most still in flight.
        for _ in range(2000):
            if any(c.done() for cs in completions for c in cs):
                break
            await asyncio.sleep(0.001)
        assert a.proc is not None
        t0 = time.monotonic()
        a.proc.send_signal(signal.SIGTERM)
        done_at_signal = sum(c.done() for cs in completions for c in cs)

        outcomes = [[await _outcome(c) for c in cs] for cs in completions]
        set_outcomes = await asyncio.wait_for(set_task, WAIT)
        _exit_within(a, t0, drain_s + SLACK)

        ok = sum(o is None for os_ in outcomes for o in os_)
        total = sum(len(cs) for cs in completions)
        # The drain let in-flight writes finish instead of dropping them (unless every
        # write had ended before the signal was sent: a host this fast leaves nothing in
        # flight to judge that by; the rest below still holds).
        assert ok > done_at_signal or done_at_signal == total, (ok, done_at_signal, total)
        for os_ in outcomes:
            for o in os_:
                # B is healthy: what did not finish was refused (never run), not lost.
                assert o is None or type(o) is Cancelled, repr(o)
        # Every write reported done landed, byte for byte, on B; its immediate counted.
        for (_w, _smr, dst, _desc, data, imm), os_ in zip(plan, outcomes, strict=True):
            for k, o in enumerate(os_):
                if o is None:
                    got = await owner.get_tensor(dst.tensor(k * SLOT, SLOT))
                    assert _sha(got) == _sha(data[k * SLOT:(k + 1) * SLOT]), f"slot {k}"
            assert await owner.imm_count(imm) >= sum(o is None for o in os_)
        # SETs: each reported done or refused, the last one refused or cut by the close.
        assert set_outcomes and all(o is None or isinstance(o, Cancelled | ConnectionLost)
                                    for o in set_outcomes), set_outcomes
        assert "drained in" in a.stderr or "drain time ran out" in a.stderr, a.stderr
        assert "Traceback" not in a.stderr
        await owner.close()
    finally:
        a.stop()
        b.stop()


async def _linked(a: DaemonProcess, b: DaemonProcess) -> tuple[Any, ...]:
    """A client of A with a source region, B's destination, and links up before B stops."""
    c = await Client.connect(a.url, timeout=WAIT)
    owner = await Client.connect(b.url, timeout=WAIT)
    src = await c.alloc_buffer(SLOT)
    smr, _ = await c.reg_mr(src)
    dst = await owner.alloc_buffer(SLOT)
    _, desc = await owner.reg_mr(dst)
    imm = fresh_imm()
    assert await _outcome(await c.submit_single_write(SLOT, imm, (smr, 0), (desc, 0))) is None
    return c, owner, src, smr, desc, imm


@async_test(timeout=60)
async def test_drain_time_runs_out_typed_failures_exit_zero() -> None:
    drain_s = 2.0
    a, b = _pair(drain_s)
    try:
        c, owner, src, smr, desc, imm = await _linked(a, b)
        # A client that asked for 20 MiB and reads nothing: the close cannot flush its
        # replies, and must not wait for it past its 1 s.
        slow = RawConn.to(a)
        slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.hello()
        for _ in range(20):
            slow.send(Command.GET_TENSOR, {"tensor": [src.id, 0, SLOT]})
        with stopped(b):
            stuck = [await c.submit_single_write(SLOT, imm, (smr, 0), (desc, 0))
                     for _ in range(4)]
            await asyncio.sleep(0.2)
            assert a.proc is not None
            t0 = time.monotonic()
            a.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            # Draining: no new connection, no new request (refused, nothing done).
            try:
                await Client.connect(a.url, timeout=2)
                raise AssertionError("a connection was accepted while draining")
            except (OSError, TransferdError, TimeoutError):
                pass
            try:
                await asyncio.wait_for(c.get_tensor(src.tensor(0, 16)), WAIT)
                raise AssertionError("a request was served while draining")
            except Cancelled as exc:
                assert "stopping" in exc.message
            outcomes = [await _outcome(w) for w in stuck]
            took = _exit_within(a, t0, drain_s + SLACK)
        assert took >= drain_s - 0.2, f"exited after {took:.2f} s, before its drain time"
        for o in outcomes:
            # Failed through the completion EVENT (not the connection's end): typed.
            assert isinstance(o, TransferdError) and not isinstance(o, ConnectionLost), repr(o)
        assert any(isinstance(o, Timeout) and "outcome unknown" in o.message
                   for o in outcomes), outcomes
        assert "drain time ran out" in a.stderr, a.stderr
        assert "1 connections did not read their last replies: aborted" in a.stderr, a.stderr
        slow.close()
        with contextlib.suppress(Exception):
            await owner.close()
    finally:
        a.stop()
        b.stop()


@async_test(timeout=60)
async def test_a_second_signal_ends_the_drain_early() -> None:
    drain_s = 60.0
    a, b = _pair(drain_s)
    try:
        c, owner, _src, smr, desc, imm = await _linked(a, b)
        with stopped(b):
            stuck = await c.submit_single_write(SLOT, imm, (smr, 0), (desc, 0))
            await asyncio.sleep(0.2)
            assert a.proc is not None
            t0 = time.monotonic()
            a.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            assert a.alive(), "the first signal must drain, not stop at once"
            a.proc.send_signal(signal.SIGTERM)
            outcome = await _outcome(stuck)
            _exit_within(a, t0, SLACK)  # far below the 60 s drain time
        assert isinstance(outcome, Timeout), repr(outcome)
        assert "second stop signal" in a.stderr, a.stderr
        with contextlib.suppress(Exception):
            await owner.close()
    finally:
        a.stop()
        b.stop()


def test_systemd_stop_timeout_covers_the_drain() -> None:
    """deploy/transferd.service gives the drain its time: TimeoutStopSec >= drain_s + 10."""
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string(Path(REPO, "deploy", "transferd.service").read_text())
    stop = unit["Service"]["TimeoutStopSec"]
    seconds = float(stop.removesuffix("s"))
    assert seconds >= ServerConfig().drain_s + 10, (stop, ServerConfig().drain_s)
