"""A cancelled await cancels its operation, attacked on live daemons and inproc.

client/engine.py and client/inproc.py: an awaiter cancelled (wait_for, a TaskGroup)
cancels its operation where it runs, a registration given up before its reply too;
``Completion.wait(timeout)`` does not.  No count is lost without a word, none taken
twice, nothing left in the client's tables, no traceback or unretrieved exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import warnings
from typing import Any

from client import Client, SyncClient
from tests.helpers import async_test
from tests.integration.engine_cluster import (
    WAIT,
    Cluster,
    fresh_imm,
    inproc_settings,
    nodes,
    poll,
)
from transferd.protocol.errors import BadRequest, TransferdError

from . import engine_cluster

tcp_cluster = engine_cluster.tcp_cluster
clusters = engine_cluster.clusters



def _no_leaks(caught: list[warnings.WarningMessage], loop_errors: list[dict[str, Any]]) -> None:
    gc.collect()
    bad = [str(w.message) for w in caught
           if "never retrieved" in str(w.message) or "was never awaited" in str(w.message)]
    assert not bad, bad
    assert not loop_errors, loop_errors


@contextlib.contextmanager
def _watched() -> Any:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _l, ctx: errors.append(ctx))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield caught, errors
            gc.collect()
        finally:
            loop.set_exception_handler(old)
    _no_leaks(caught, errors)


async def _nothing_waiting(c: Client) -> None:
    """The client's table of Completions waiting for an EVENT empties (within 5 s)."""
    waiting = c._events.waiting
    for _ in range(500):
        if not waiting:
            break
        await asyncio.sleep(0.01)
    assert not waiting, len(waiting)


@async_test(timeout=60)
async def test_cancelled_expectations_take_no_count(tcp_cluster: Cluster) -> None:
    """Expectations whose awaiters time out (wait_for) take nothing: the count goes to
    the next one; ``wait(timeout)`` leaves it armed; two awaiters of one Completion,
    one cancelled, cancel it for both (the other sees CancelledError or a result)."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        with _watched():
            imm = fresh_imm()
            # A burst of abandoned awaits: each cancels its expectation.
            for i in range(1000):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(b.client.expect_imm_count(imm, 1),
                                           0.0002 * (i % 8))
            # Each one's CANCEL ended it: nothing of them is kept (bounded memory).
            await _nothing_waiting(b.client)
            # wait(timeout) does not cancel.
            c = await b.client.expect_imm_count(imm, 1, wait=False)
            try:
                await c.wait(0.05)
                raise AssertionError("no count yet, but it ended")
            except TimeoutError:
                pass  # (the wait's, not the expectation's)
            assert not c.done()
            src = await a.region(4096, seed=3)
            dst = await b.region(4096)
            await (await a.client.submit_single_write(4096, imm, (src.mr, 0),
                                                      (dst.desc, 0))).wait(WAIT)
            await c.wait(WAIT)  # the one left armed took it
            assert await b.client.imm_count(imm) == 0
            assert await b.read(dst) == bytes(src.data)

            # Two awaiters of one Completion, one cancelled.
            c2 = await b.client.expect_imm_count(imm, 1, wait=False)
            t1 = asyncio.ensure_future(_await(c2))
            t2 = asyncio.ensure_future(_await(c2))
            await asyncio.sleep(0.01)
            t1.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t1
            await asyncio.wait_for(asyncio.gather(t2, return_exceptions=True), 5)
            await (await a.client.submit_single_write(4096, imm, (src.mr, 0),
                                                      (dst.desc, 0))).wait(WAIT)
            # Cancelled: the count was not taken by it.
            assert await poll(lambda: b.client.imm_count(imm), 1) == 1
            assert await b.client.main_address() == await b.client.main_address()


async def _await(c: Any) -> Any:
    return await c


@async_test(timeout=60)
async def test_cancel_while_the_connection_closes(tcp_cluster: Cluster) -> None:
    """Awaiters cancelled while their client closes, or after it closed: no traceback,
    no hang, no exception never retrieved."""
    cl = tcp_cluster
    with _watched():
        for round_ in range(20):
            c = await Client.connect(cl.b.url, timeout=WAIT)
            imm = fresh_imm()
            comps = [await c.expect_imm_count(imm, 1, wait=False) for _ in range(5)]
            tasks = [asyncio.ensure_future(_await(x)) for x in comps]
            tasks.append(asyncio.ensure_future(c.expect_imm_count(imm, 1)))
            await asyncio.sleep(0)
            closing = asyncio.ensure_future(c.close())
            if round_ % 2:
                await asyncio.sleep(0)
            for t in tasks:
                t.cancel()
            await asyncio.wait_for(closing, 5)
            got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
            # Each saw its cancel (or the close's ConnectionLost), never a RuntimeError
            # of a CANCEL written after the close's write_eof.
            odd = [g for g in got
                   if not isinstance(g, asyncio.CancelledError | TransferdError)]
            assert not odd, (round_, odd)
            # After the close: awaiting and cancelling again.
            late = asyncio.ensure_future(_await(comps[0]))
            await asyncio.sleep(0)
            late.cancel()
            (g,) = await asyncio.wait_for(asyncio.gather(late, return_exceptions=True), 5)
            assert isinstance(g, asyncio.CancelledError | TransferdError), g
    async with nodes(cl.b) as (b,):
        assert await b.client.imm_count(fresh_imm()) == 0


@async_test(timeout=60)
async def test_an_expectation_met_as_its_awaiter_is_cancelled(tcp_cluster: Cluster) -> None:
    """The write meets an expectation at about the moment its awaiter gives up: its
    count is either given to it or left for the next expectation, never lost or
    counted twice."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        src = await a.region(64, seed=8)
        dst = await b.region(64)
        with _watched(), _client_warnings() as said:
            for i in range(40):
                imm = fresh_imm()
                w = asyncio.ensure_future(a.client.submit_single_write(
                    64, imm, (src.mr, 0), (dst.desc, 0)))
                got = False
                try:
                    await asyncio.wait_for(b.client.expect_imm_count(imm, 1),
                                           0.0005 * (i % 10))
                    got = True
                except TimeoutError:
                    pass
                await (await w).wait(WAIT)
                await asyncio.sleep(0.02)
                left = await b.client.imm_count(imm)
                if got:
                    assert left == 0, i
                elif left == 0:  # taken as it was cancelled: a warning says so
                    assert any("cancelled" in m for m in said), (i, said)
                else:
                    # Not taken: left to be counted, and a next expectation takes it.
                    assert left == 1, (i, left)
                    await asyncio.wait_for(b.client.expect_imm_count(imm, 1), 5)
                    assert await b.client.imm_count(imm) == 0


@async_test(timeout=60)
async def test_inproc_cancelled_expectations_take_no_count(tcp_cluster: Cluster) -> None:
    """The inproc client: a cancelled awaiter cancels its expectation in the engine."""
    cl = tcp_cluster
    c = await Client.connect("inproc://", overrides=inproc_settings(cl.b), timeout=WAIT)
    try:
        with _watched():
            imm = fresh_imm()
            for _ in range(300):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(c.expect_imm_count(imm, 1), 0.0005)
            comp = await c.expect_imm_count(imm, 1, wait=False)
            with contextlib.suppress(Exception):
                await comp.wait(0.02)
            assert not comp.done()
            t = asyncio.ensure_future(_await(comp))
            await asyncio.sleep(0)
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
            assert await c.imm_count(imm) == 0
    finally:
        await asyncio.wait_for(c.close(), 10)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _client_warnings() -> Any:
    h = _Records()
    lg = logging.getLogger("transferd.client")
    lg.addHandler(h)
    try:
        yield h.messages
    finally:
        lg.removeHandler(h)


async def _count_one(a: Any, b: Any, imm: int) -> None:
    """One write of ``imm`` from A to B, landed (B's count is 1 more)."""
    src = await a.region(64, seed=4)
    dst = await b.region(64)
    await (await a.client.submit_single_write(64, imm, (src.mr, 0), (dst.desc, 0))).wait(WAIT)


@async_test(timeout=60)
async def test_met_as_its_awaiter_is_cancelled_is_never_lost_silently(
        tcp_cluster: Cluster) -> None:
    """The expectation's EVENT resolves it, and in the same loop turn (before the
    awaiting task ran) that task is cancelled: its count was consumed and the task saw
    only CancelledError.  It was lost without a word; now a warning says so."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        imm = fresh_imm()
        c = await b.client.expect_imm_count(imm, 1, wait=False)
        holder: list[asyncio.Task[Any]] = []
        # (Called before the task's own wake-up: the cancel lands on a done future.)
        c.add_done_callback(lambda _: holder[0].cancel())
        holder.append(asyncio.ensure_future(_await(c)))
        await asyncio.sleep(0)
        with _client_warnings() as said:
            await _count_one(a, b, imm)
            res = await asyncio.gather(holder[0], return_exceptions=True)
            assert isinstance(res[0], asyncio.CancelledError), res
            await asyncio.sleep(0.05)
            left = await b.client.imm_count(imm)
        assert left == 1 or any("cancelled" in m for m in said), (left, said)


@async_test(timeout=60)
async def test_a_registration_cancelled_before_its_reply_loses_no_count_silently(
        tcp_cluster: Cluster) -> None:
    """The count is there when the expectation registers: it fires at once on the
    daemon, and the task registering it is cancelled before the reply came.  The
    count was consumed and nothing said so (its EVENT found no Completion); now it is
    left, or a warning says it was taken."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        for _ in range(5):
            imm = fresh_imm()
            await _count_one(a, b, imm)
            assert await poll(lambda i=imm: b.client.imm_count(i), 1) == 1
            with _client_warnings() as said:
                t = asyncio.ensure_future(b.client.expect_imm_count(imm, 1))
                await asyncio.sleep(0)  # (its request is sent)
                t.cancel()
                (res,) = await asyncio.gather(t, return_exceptions=True)
                await asyncio.sleep(0.1)
                left = await b.client.imm_count(imm)
                await b.client.main_address()  # (the connection is sound)
            if not isinstance(res, BaseException):
                assert left == 0  # (it was not cancelled in time: it has the count)
                continue
            assert left == 1 or any("cancelled" in m for m in said), (left, said, res)


@async_test(timeout=60)
async def test_a_refused_registration_cancelled_before_its_reply_is_forgotten(
        tcp_cluster: Cluster) -> None:
    """Refused (a deadline over engine.max_expect_timeout_s) and given up before the
    refusal came: no EVENT will ever come for it, so its CANCEL's NOT_FOUND lets it go
    (it stayed in the client's table until the connection closed, one per such call)."""
    async with nodes(tcp_cluster.b) as (b,):
        for _ in range(50):
            t = asyncio.ensure_future(b.client.expect_imm_count(fresh_imm(), 1, timeout=1e9))
            await asyncio.sleep(0)  # (its request is sent)
            t.cancel()
            (res,) = await asyncio.gather(t, return_exceptions=True)
            assert isinstance(res, asyncio.CancelledError | BadRequest), res
        await b.client.main_address()  # (after the CANCELs' replies: the same connection)
        await _nothing_waiting(b.client)


@async_test(timeout=60)
async def test_an_expectation_with_a_callback_whose_awaiter_times_out(
        tcp_cluster: Cluster) -> None:
    """expect_imm_count with a callback, then wait_for on its Completion: the cancel
    of its future ran the done callback, whose ``done.exception()`` raised
    CancelledError in the loop ("Exception in callback"); now the callback is not run
    and nothing is reported, and the count is left for the next expectation."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        fired: list[int] = []
        imm = fresh_imm()
        with _watched():
            for i in range(3):
                c = await b.client.expect_imm_count(imm, 1, lambda i=i: fired.append(i))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(c, 0.01)
            await asyncio.sleep(0.05)
        await _count_one(a, b, imm)
        assert await poll(lambda: b.client.imm_count(imm), 1) == 1
        assert fired == []


@async_test(timeout=60)
async def test_sync_client_timeouts_leave_the_expectation_armed(tcp_cluster: Cluster) -> None:
    """SyncClient.wait(c, timeout) times out and leaves ``c`` armed (it takes the next
    count); a thread blocked in an expectation while another closes the client gets
    an error, not a hang, and the daemon serves on."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        imm, imm2 = fresh_imm(), fresh_imm()

        s, c = await asyncio.to_thread(lambda: _armed_open(cl.b.url, imm))
        try:
            await _count_one(a, b, imm)
            await asyncio.to_thread(s.wait, c, WAIT)
            assert await b.client.imm_count(imm) == 0
            blocked: list[Any] = []

            def block() -> None:
                try:
                    s.expect_imm_count(imm2, 1)
                    blocked.append("fired")
                except BaseException as exc:  # (what it ended with)
                    blocked.append(exc)

            th = threading.Thread(target=block, daemon=True)
            th.start()
            await asyncio.sleep(0.2)
            await asyncio.to_thread(s.close)
            await asyncio.to_thread(th.join, 10)
            assert not th.is_alive()
            assert len(blocked) == 1 and isinstance(blocked[0], TransferdError), blocked
        finally:
            await asyncio.to_thread(s.close)
        await _count_one(a, b, imm2)
        assert await poll(lambda: b.client.imm_count(imm2), 1) == 1


def _armed_open(url: str, imm: int) -> tuple[Any, Any]:
    s = SyncClient.connect(url)
    c = s.expect_imm_count(imm, 1, wait=False)
    try:
        s.wait(c, 0.05)
        raise AssertionError("no count yet, but it ended")
    except TimeoutError:
        pass
    assert not c.done()
    return s, c


@async_test(timeout=60)
async def test_inproc_expectation_with_a_callback_whose_awaiter_times_out(
        tcp_cluster: Cluster) -> None:
    """The inproc client's expect_imm_count with a callback, its Completion awaited in
    wait_for: the cancelled future's done callback must not raise in the loop."""
    cl = tcp_cluster
    c = await Client.connect("inproc://", overrides=inproc_settings(cl.b), timeout=WAIT)
    try:
        fired: list[int] = []
        imm = fresh_imm()
        with _watched():
            for i in range(3):
                comp = await c.expect_imm_count(imm, 1, lambda i=i: fired.append(i))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(comp, 0.01)
            await asyncio.sleep(0.05)
        assert fired == []
    finally:
        await asyncio.wait_for(c.close(), 10)


@async_test(timeout=60)
async def test_inproc_met_as_its_awaiter_is_cancelled_is_never_lost_silently(
        tcp_cluster: Cluster) -> None:
    """The inproc client: the engine ends an expectation done, and its awaiter is
    cancelled in that same loop turn: a warning says the count was taken."""
    cl = tcp_cluster
    c = await Client.connect("inproc://", overrides=inproc_settings(cl.b), timeout=WAIT)
    try:
        async with nodes(cl.a) as (a,):
            buf = await c.alloc_buffer(64)
            _, desc = await c.reg_mr(buf)
            src = await a.region(64, seed=9)
            imm = fresh_imm()
            comp = await c.expect_imm_count(imm, 1, wait=False)
            holder: list[asyncio.Task[Any]] = []
            comp.add_done_callback(lambda _: holder[0].cancel())
            holder.append(asyncio.ensure_future(_await(comp)))
            await asyncio.sleep(0)
            with _client_warnings() as said:
                await (await a.client.submit_single_write(64, imm, (src.mr, 0),
                                                          (desc, 0))).wait(WAIT)
                (res,) = await asyncio.gather(holder[0], return_exceptions=True)
                assert isinstance(res, asyncio.CancelledError), res
                await asyncio.sleep(0.05)
                left = await c.imm_count(imm)
            assert bytes(await c.get_tensor(buf.tensor())) == bytes(src.data)
            assert left == 1 or any("cancelled" in m for m in said), (left, said)
    finally:
        await asyncio.wait_for(c.close(), 10)


