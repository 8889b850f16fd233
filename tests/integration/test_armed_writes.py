"""ARM_PAGED_WRITES on live daemons: a paged write armed on a UVM watcher and fired by
daemon A itself when the watched word reaches its value (transferd/service/armed.py).

Every case checks the destination's bytes (sha256) and B's immediate count: a fired arm
lands exactly once, a dropped or refused one never touches them.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import pytest

from client import Client, Pages
from tests.helpers import DaemonProcess, RawConn, async_test
from tests.integration import engine_cluster
from tests.integration.engine_cluster import (
    RAILS,
    WAIT,
    Node,
    Region,
    engine_env,
    fresh_imm,
    nodes,
    start_many,
)
from transferd.protocol.constants import Command, ErrorCode, Flag
from transferd.protocol.errors import Cancelled, NotFound, OutOfBounds, OverLimit

tcp_cluster = engine_cluster.tcp_cluster
clusters = engine_cluster.clusters
own_daemons = engine_cluster.own_daemons

PAGE = 4096
SRC_IDX = [5, 0, 9, 2]  # out of order, with gaps
DST_IDX = [1, 7, 3, 12]
# Long enough for a watcher at its idle pace (10 ms) to have seen a bump many times.
QUIET = 0.3
# A paged write counts its immediate once per page.
N = len(SRC_IDX)


def digest(b: bytes | bytearray) -> str:
    return hashlib.sha256(b).hexdigest()


def expected(src: Region, dst: Region) -> bytes:
    want = bytearray(dst.data)
    for s, d in zip(SRC_IDX, DST_IDX, strict=True):
        want[d * PAGE : (d + 1) * PAGE] = src.data[s * PAGE : (s + 1) * PAGE]
    return bytes(want)


async def _regions(a: Node, b: Node) -> tuple[Region, Region]:
    return await a.region(16 * PAGE, seed=3), await b.region(16 * PAGE, seed=4)


async def arm(a: Node, w: Any, value: int, imm: int, src: Region, dst: Region,
              **kw: Any) -> Any:
    return await a.client.arm_paged_writes(
        w, value, PAGE, imm, (src.mr, Pages(SRC_IDX, PAGE)), (dst.desc, Pages(DST_IDX, PAGE)),
        **kw)


async def untouched(b: Node, dst: Region, imm: int) -> None:
    """Nothing of the write landed or was counted, after a pause long enough for it."""
    await asyncio.sleep(QUIET)
    assert digest(await b.read(dst)) == digest(dst.data)
    assert await b.client.imm_count(imm) == 0


@async_test(timeout=60)
async def test_an_armed_write_fires_once_at_its_value_and_lands_exactly(
        tcp_cluster: engine_cluster.Cluster) -> None:
    async with nodes(tcp_cluster.a, tcp_cluster.b) as (a, b):
        src, dst = await _regions(a, b)
        w = await a.client.alloc_uvm_watcher(lambda old, new: None)
        imm = fresh_imm()
        c = await arm(a, w, 3, imm, src, dst)
        for v in (1, 2):  # below the value: nothing moves
            w.set(v)
            await asyncio.sleep(0.05)
        await untouched(b, dst, imm)
        assert not c.done()
        w.set(3)
        await c.wait(WAIT)
        assert digest(await b.read(dst)) == digest(expected(src, dst))
        assert await b.client.imm_count(imm) == N
        # Past the value, again and again: it fired once.
        for v in (4, 5, 9):
            w.set(v)
            await asyncio.sleep(0.05)
        await asyncio.sleep(QUIET)
        assert await b.client.imm_count(imm) == N


@async_test(timeout=60)
async def test_a_word_past_the_value_fires_at_once_and_two_arms_fire_in_order(
        tcp_cluster: engine_cluster.Cluster) -> None:
    async with nodes(tcp_cluster.a, tcp_cluster.b) as (a, b):
        src, dst = await _regions(a, b)
        w = await a.client.alloc_uvm_watcher(lambda old, new: None)
        w.set(7)
        await asyncio.sleep(0.05)
        imm = fresh_imm()
        c = await arm(a, w, 5, imm, src, dst)  # the word is at 7 already
        await c.wait(WAIT)
        assert await b.client.imm_count(imm) == N
        # Armed just as the word passes the value: the arm sees it there, and the
        # watcher's delivery of that change comes after; still one fire.
        for v in range(20, 25):
            imm = fresh_imm()
            w.set(v)
            c = await arm(a, w, v, imm, src, dst)
            await c.wait(WAIT)
            await asyncio.sleep(0.05)
            assert await b.client.imm_count(imm) == N, v
        # Two arms at 8 and 10; one jump to 12 (one change) fires both, once each.
        imm2 = fresh_imm()
        cs = [await arm(a, w, v, imm2, src, dst) for v in (8, 10)]
        w.set(12)
        for x in cs:
            await x.wait(WAIT)
        assert await b.client.imm_count(imm2) == 2 * N
        assert digest(await b.read(dst)) == digest(expected(src, dst))


@async_test(timeout=60)
async def test_a_bad_arm_is_refused_when_armed_and_never_fires(
        tcp_cluster: engine_cluster.Cluster) -> None:
    async with nodes(tcp_cluster.a, tcp_cluster.b) as (a, b):
        src, dst = await _regions(a, b)
        w = await a.client.alloc_uvm_watcher(lambda old, new: None)
        imm = fresh_imm()
        p = Pages(SRC_IDX, PAGE)
        q = Pages(DST_IDX, PAGE)
        with pytest.raises(NotFound, match=r"region|mr"):  # no such source region
            await a.client.arm_paged_writes(w, 1, PAGE, imm, (type(src.mr)(99999, src.buf), p),
                                            (dst.desc, q))
        with pytest.raises(OutOfBounds):  # a source page past the region's end
            await a.client.arm_paged_writes(w, 1, PAGE, imm, (src.mr, Pages([16], PAGE)),
                                            (dst.desc, Pages([0], PAGE)))
        with pytest.raises(OutOfBounds):  # a destination page past the peer region's end
            await a.client.arm_paged_writes(w, 1, PAGE, imm, (src.mr, Pages([0], PAGE)),
                                            (dst.desc, Pages([16], PAGE)))
        with pytest.raises(NotFound, match="watcher"):  # not a watcher of this connection
            await a.client.arm_paged_writes(w.id + 100000, 1, PAGE, imm, (src.mr, p),
                                            (dst.desc, q))
        async with await Client.connect(tcp_cluster.a.url, timeout=WAIT) as other:
            with pytest.raises(NotFound, match="watcher"):  # another connection's watcher
                await other.arm_paged_writes(w.id, 1, PAGE, imm, (src.mr, p), (dst.desc, q))
        w.set(5)  # none of them was armed
        await untouched(b, dst, imm)


def _raw_setup(c: RawConn) -> tuple[int, Any, int]:
    buf = c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 8 * PAGE})
    mr = c.request(Command.REG_MR, {"buffer": buf.body["buffer"]})
    w = c.request(Command.ALLOC_UVM_WATCHER, {})
    assert w.flags == int(Flag.REPLY), w.body
    return mr.body["mr"], mr.body["desc"], w.body["watcher"]


_DROP = object()
MALFORMED = [
    ({"watcher": _DROP}, "watcher"),
    ({"watcher": "1"}, "watcher"),
    ({"value": -1}, "value"),
    ({"value": 2.5}, "value"),
    ({"value": True}, "value"),
    ({"page_len": _DROP}, "page_len"),
    ({"imm": 1 << 32}, "imm"),
    ({"src": [1]}, "src"),
    ({"dst": "x"}, "dst"),
    ({"verify": 1}, "verify"),
    ({"wid": 1}, "wid"),
    ({"timeout_ms": 0}, "timeout"),
]


@pytest.mark.parametrize("change,names", MALFORMED, ids=[repr(c) for c, _ in MALFORMED])
def test_a_malformed_arm_field_is_refused_by_name(
        daemon: DaemonProcess, change: dict[str, Any], names: str) -> None:
    with RawConn.to(daemon) as c:
        c.hello()
        mr, desc, watcher = _raw_setup(c)
        good = {"watcher": watcher, "value": 1, "page_len": PAGE, "imm": None,
                "src": [mr, [[0], PAGE, 0]], "dst": [desc, [[4], PAGE, 0]]}
        body = dict(good)
        for k, v in change.items():
            if v is _DROP:
                body.pop(k)
            else:
                body[k] = v
        f = c.request(Command.ARM_PAGED_WRITES, body)
        assert f.flags == int(Flag.REPLY | Flag.ERROR), f
        assert f.body["code"] == ErrorCode.BAD_REQUEST.value, f.body
        assert names in f.body["message"], f.body
        # The connection goes on: the good arm is taken, its reply names it.
        ok = c.request(Command.ARM_PAGED_WRITES, good)
        assert ok.flags == int(Flag.REPLY), ok.body
        assert ok.body == {"watcher": watcher, "value": 1}


@async_test(timeout=60)
async def test_a_cancelled_arm_never_lands(tcp_cluster: engine_cluster.Cluster) -> None:
    async with nodes(tcp_cluster.a, tcp_cluster.b) as (a, b):
        src, dst = await _regions(a, b)
        w = await a.client.alloc_uvm_watcher(lambda old, new: None)
        imm = fresh_imm()
        c = await arm(a, w, 2, imm, src, dst)
        assert await c.cancel() is True
        with pytest.raises(Cancelled):
            await c.wait(WAIT)
        w.set(2)
        await untouched(b, dst, imm)
        # A second cancel finds nothing; a fresh arm on the same watcher still fires.
        assert await c.cancel() is False
        c2 = await arm(a, w, 2, imm, src, dst)
        await c2.wait(WAIT)
        assert await b.client.imm_count(imm) == N


@async_test(timeout=60)
async def test_an_arm_is_dropped_with_its_connection(
        tcp_cluster: engine_cluster.Cluster) -> None:
    async with nodes(tcp_cluster.a, tcp_cluster.b) as (a, b):
        src, dst = await _regions(a, b)
        imm = fresh_imm()
        other = await Client.connect(tcp_cluster.a.url, timeout=WAIT)
        w = await other.alloc_uvm_watcher(lambda old, new: None)
        word = w.word()  # mapped here: it can still be stored into after the close
        # The source region is a's (it outlives ``other``): only the arm goes with it.
        await other.arm_paged_writes(w, 1, PAGE, imm, (src.mr, Pages(SRC_IDX, PAGE)),
                                     (dst.desc, Pages(DST_IDX, PAGE)))
        await other.close()
        await asyncio.sleep(0.1)
        word[0] = 5
        await untouched(b, dst, imm)


@async_test(timeout=60)
async def test_an_arm_is_dropped_with_its_watcher(tcp_cluster: engine_cluster.Cluster) -> None:
    async with nodes(tcp_cluster.a, tcp_cluster.b) as (a, b):
        src, dst = await _regions(a, b)
        wordbuf = await a.client.alloc_buffer(PAGE)
        w = await a.client.alloc_uvm_watcher(lambda old, new: None, buffer=wordbuf, offset=8)
        imm = fresh_imm()
        c = await arm(a, w, 1, imm, src, dst)
        await a.client.free_buffer(wordbuf)  # the watcher ends with its buffer (the sweep)
        with pytest.raises(NotFound, match=f"watcher {w.id} ended"):
            await c.wait(WAIT)
        await untouched(b, dst, imm)


@async_test(timeout=60)
async def test_a_source_region_deregistered_before_the_fire_fails_it_typed(
        tcp_cluster: engine_cluster.Cluster) -> None:
    async with nodes(tcp_cluster.a, tcp_cluster.b) as (a, b):
        src, dst = await _regions(a, b)
        w = await a.client.alloc_uvm_watcher(lambda old, new: None)
        imm = fresh_imm()
        c = await arm(a, w, 1, imm, src, dst)
        await a.client.dereg_mr(src.mr)
        w.set(1)
        with pytest.raises(NotFound):
            await c.wait(WAIT)
        await untouched(b, dst, imm)


@async_test(timeout=60)
async def test_the_bounds_exceeded_by_one_are_refused(
        own_daemons: list[DaemonProcess]) -> None:
    env = engine_env(RAILS["a"], MAX_ARMED_WRITES_PER_WATCHER=2,
                     MAX_ARMED_WRITES_PER_CONNECTION=3, MAX_ARMED_PAGES_PER_CONNECTION=14)
    own_daemons.extend(start_many([{"env": env}]))
    async with nodes(own_daemons[0]) as (a,):
        src, dst = await a.region(16 * PAGE, seed=5), await a.region(16 * PAGE)
        w1 = await a.client.alloc_uvm_watcher(lambda old, new: None)
        w2 = await a.client.alloc_uvm_watcher(lambda old, new: None)
        w3 = await a.client.alloc_uvm_watcher(lambda old, new: None)
        imm = fresh_imm()
        armed = [await arm(a, w1, 1, imm, src, dst), await arm(a, w1, 2, imm, src, dst)]
        with pytest.raises(OverLimit, match="max_armed_writes_per_watcher"):
            await arm(a, w1, 3, imm, src, dst)
        armed.append(await arm(a, w2, 1, imm, src, dst))  # 12 pages held
        with pytest.raises(OverLimit, match="max_armed_writes_per_connection"):
            await arm(a, w3, 1, imm, src, dst)
        assert await armed[2].cancel() is True  # 2 arms, 8 pages held now

        def pages(n: int) -> tuple[Any, Any]:
            return (src.mr, Pages(list(range(n)), PAGE)), (dst.desc, Pages(list(range(n)), PAGE))

        with pytest.raises(OverLimit, match="max_armed_pages_per_connection"):
            await a.client.arm_paged_writes(w3, 1, PAGE, None, *pages(7))  # 15 > 14
        last = await a.client.arm_paged_writes(w3, 1, PAGE, None, *pages(6))  # 14: the limit
        assert await last.cancel() is True
        # Fired ones leave the counts: w1's two fire (counted once each), then w1 takes
        # two more.
        w1.set(2)
        for x in armed[:2]:
            await x.wait(WAIT)
        assert await a.client.imm_count(imm) == 2 * N
        more = [await arm(a, w1, 5, imm, src, dst), await arm(a, w1, 6, imm, src, dst)]
        for x in more:
            assert await x.cancel() is True
        assert await a.client.imm_count(imm) == 2 * N


@async_test(timeout=60)
async def test_an_inproc_client_arms_on_its_node_and_the_node_fires(
        tcp_cluster: engine_cluster.Cluster) -> None:
    settings = engine_cluster.inproc_settings(tcp_cluster.a)
    async with await Client.connect("inproc://", overrides=settings, timeout=WAIT) as ip, \
            nodes(tcp_cluster.b) as (b,):
        a = Node(tcp_cluster.a, ip)
        src, dst = await _regions(a, b)
        w = await ip.alloc_uvm_watcher(lambda old, new: None)
        imm = fresh_imm()
        with pytest.raises(OutOfBounds):  # refused at the arm, as over the wire
            await ip.arm_paged_writes(w, 1, PAGE, imm, (src.mr, Pages([16], PAGE)),
                                      (dst.desc, Pages([0], PAGE)))
        c = await arm(a, w, 2, imm, src, dst)
        w.set(1)
        await untouched(b, dst, imm)
        w.set(2)
        await c.wait(WAIT)
        assert digest(await b.read(dst)) == digest(expected(src, dst))
        assert await b.client.imm_count(imm) == N
        # The word passes the value while the loop is busy: the watcher's delivery of
        # that change is queued before the arm, which also sees the word there. One
        # fire all the same.
        for v in range(10, 13):
            imm = fresh_imm()
            w.set(v)
            time.sleep(0.03)  # blocks the loop: the watcher thread queues its delivery
            c = await arm(a, w, v, imm, src, dst)
            await c.wait(WAIT)
            await asyncio.sleep(0.1)
            assert await b.client.imm_count(imm) == N, v
        await a.close()
