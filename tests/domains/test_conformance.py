"""The Domain conformance suite: what every Domain must do, run over every registered one.

Two "engines" in this process (a region table, an ImmCounter, host buffers, the
engine's port over them and one DomainGroup each, with two rails), wired through the
Domain under test on one event loop: tcp over loopback sockets, chaos around tcp and
around the in-process Domain of :mod:`tests.domains.inproc` (defined only there: adding
a Domain touches nothing else), and verbs, skipped with the reason (pyverbs missing, no
device, no soft-RoCE) where there is no RDMA device with an ACTIVE port.  Data is
checked by checksum, counters by the counting rules.

Each group runs on a worker of :mod:`transferd.workers`: the test's own loop (a
``LoopWorker``, as the engine's host groups by default) for every Domain, and for tcp
also a ``ThreadWorker`` of its own (``tcp@thread``), the calls and completions crossing
threads as they do in a daemon with ``engine.worker = "thread"``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
from collections.abc import Callable
from typing import Any

import pytest

from tests.domains import inproc
from tests.rdma.devices import rdma_devices
from transferd.domains import registry
from transferd.domains.base import DomainOptions
from transferd.domains.group import DomainGroup
from transferd.engine.immcounter import ImmCounter
from transferd.engine.plan import plan_barrier, plan_paged, plan_single
from transferd.engine.port import EnginePort
from transferd.engine.reads import plan_paged_reads, plan_single_read
from transferd.engine.regions import Region, RegionTable
from transferd.memory import Buffer
from transferd.parts import ReadPart, SendPart, Transfer, WritePart
from transferd.protocol.errors import (
    BadRequest,
    NotFound,
    OutOfBounds,
    PeerUnreachable,
    TransferdError,
)
from transferd.protocol.values import MrDesc, NetAddr, Pages
from transferd.workers import LoopWorker, ThreadWorker, Worker

inproc.register()
RDMA_DEVICES, RDMA_WHY = rdma_devices()
SECRET = b"conformance suite secret"
WAIT = 10.0
RAILS = 2
_hosts = itertools.count(20)
_ids = itertools.count(1)


def _specs() -> list[Any]:
    """Every registered Domain (a wrapper around tcp), and chaos around inproc too; verbs
    skipped, with the reason, where there is no RDMA device."""
    out: list[Any] = []
    for name in registry.names():
        if registry.is_wrapper(name):
            out += [f"{name}:tcp", f"{name}:inproc"]
        elif name == "verbs" and RDMA_WHY is not None:
            out.append(pytest.param(name, marks=pytest.mark.skip(reason=f"verbs: {RDMA_WHY}")))
        else:
            out.append(name)
    # The same Domain on a worker thread of its own (the thread-pinned worker).
    out.append("tcp@thread")
    return out


def _settings() -> dict[str, dict[str, Any]]:
    """Each Domain's own settings: verbs runs every rail on the device found (or named
    by TRANSFERD_RDMA_DEVICES, one per rail, the first one repeated if fewer)."""
    if not RDMA_DEVICES:
        return {}
    devs = (RDMA_DEVICES * RAILS)[:RAILS]
    return {"verbs": {"devices": devs, "port": 1, "gid_index": -1}}


class Node:
    """One engine's worth of state in this process, its group bound with ``spec``."""

    def __init__(self, spec: str, loop: asyncio.AbstractEventLoop, seed: int) -> None:
        self.regions = RegionTable()
        self.counter = ImmCounter()
        self.messages: list[tuple[tuple[int, int], bytes]] = []
        # Each message's trace id as the receiving Domain gave it (None: none carried).
        self.traces: list[bytes | None] = []
        self.buffers: list[Buffer] = []
        self.node = random.Random(seed).randrange(1, 1 << 63)
        self.loop = loop
        domain, _, kind = spec.partition("@")
        self.worker: Worker = (ThreadWorker(f"conformance-{seed}") if kind == "thread"
                               else LoopWorker(f"conformance-{seed}", loop))
        self.worker.start()
        base = next(_hosts)

        def make() -> DomainGroup:
            assert self.worker.loop is not None
            port = EnginePort(self.regions, self.counter, self._deliver, lambda _s: None)
            g = DomainGroup(
                0, self.node, self.worker.loop, port, timeout_s=WAIT, domain=domain,
                options=DomainOptions(seed=seed, max_delay_s=0.002, settings=_settings()),
                secret=SECRET, handshake_timeout_s=2.0)
            g.bind([f"127.0.{base}.{r + 1}" for r in range(RAILS)])
            return g

        self.group = self.worker.run_sync(make)
        self._ops = itertools.count(1)
        self.closed = False

    def _deliver(self, peer: tuple[int, int], msg: bytes, ack: Any, source: Any,
                 trace: bytes | None = None, op: int = 0) -> None:
        self.messages.append((peer, msg))
        self.traces.append(trace)
        ack(None)

    def region(self, size: int, seed: int | None = None, access: str = "w"
               ) -> tuple[Region, MrDesc, memoryview]:
        buf = Buffer.host(next(_ids), size)
        self.buffers.append(buf)
        view = buf.view(0, size)
        if seed is not None:
            view[:] = random.Random(seed).randbytes(size)
        region = self.regions.register(buf, RAILS, access)
        rkeys = self.group.register(region)
        desc = MrDesc(region.ptr, [(self.group.rail_address(i), k)
                                   for i, k in enumerate(rkeys)], size)
        return region, desc, view

    def revoke(self, region: Region) -> None:
        self.regions.deregister(region.id)
        self.group.deregister(region)

    async def run(self, parts: list[WritePart | SendPart | ReadPart]) -> TransferdError | None:
        """Execute planned parts; the transfer's error (None: every part acknowledged)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[TransferdError | None] = loop.create_future()

        def settle(err: TransferdError | None) -> None:
            if not fut.done():
                fut.set_result(err)

        def done(err: TransferdError | None) -> None:  # on the worker's loop
            loop.call_soon_threadsafe(settle, err)

        op = parts[0].op if parts else next(self._ops)
        self.worker.call(self.group.execute, Transfer(op, len(parts), 0, done), parts)
        return await asyncio.wait_for(fut, WAIT)

    def op(self) -> int:
        return next(self._ops)

    def close_group(self) -> None:
        """Close the group's Domains, on its worker's loop."""
        self.worker.run_sync(self.group.close)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_group()
        self.worker.stop()
        for b in self.buffers:
            b.release()


def digest(b: bytes | memoryview) -> str:
    return hashlib.sha256(bytes(b)).hexdigest()


@pytest.fixture(params=_specs())
def spec(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def _pair(spec: str) -> tuple[Node, Node]:
    loop = asyncio.get_running_loop()
    return Node(spec, loop, 1), Node(spec, loop, 2)


def conformance(fn: Callable[[Node, Node], Any]) -> Callable[[str], None]:
    """A case run over ``spec``: two nodes made, closed after, on a fresh loop."""
    def test(spec: str) -> None:
        async def main() -> None:
            a, b = await _pair(spec)
            try:
                await fn(a, b)
            finally:
                a.close()
                b.close()
                await asyncio.sleep(0.01)

        asyncio.run(asyncio.wait_for(main(), 60))

    # (not functools.wraps: pytest would read the case's (a, b) as fixtures)
    test.__name__, test.__doc__ = fn.__name__, fn.__doc__
    return test


# -- the cases ------------------------------------------------------------------------------


@conformance
async def test_bind_gives_an_address_the_domain_reads_back(a: Node, b: Node) -> None:
    addr = a.group.address
    assert len(addr.rails) == RAILS and all(isinstance(r, bytes) and r for r in addr.rails)
    assert len(set(addr.rails)) == RAILS
    for d, raw in zip(a.group.domains, addr.rails, strict=True):
        d.check_address(raw)
    with pytest.raises(BadRequest):
        a.group.domains[0].check_address(b"\xff not an address of any kind")
    assert NetAddr.from_bytes(addr.to_bytes()) == addr


@conformance
async def test_single_writes_land_and_count_once(a: Node, b: Node) -> None:
    _, _, src_view = a.region(4 << 20, seed=3)
    _, desc, dst_view = b.region(4 << 20)
    imm = 7
    for length, off in [(100, 4096), (3 << 20, 65536)]:  # whole, and split over rails
        op = a.op()
        parts: list[WritePart | SendPart] = list(
            plan_single(op, length, imm, src_view[:length], desc, off, RAILS))
        assert await a.run(parts) is None
        assert digest(dst_view[off:off + length]) == digest(src_view[:length])
    assert b.counter.value(imm) == 2


@conformance
async def test_paged_writes_land_and_count_per_page(a: Node, b: Node) -> None:
    page, n = 4096, 300
    _, _, src_view = a.region(page * 512, seed=4)
    _, desc, dst_view = b.region(page * 512)
    rng = random.Random(5)
    s_idx, d_idx = rng.sample(range(512), n), rng.sample(range(512), n)
    views = [src_view[i * page:(i + 1) * page] for i in s_idx]
    op = a.op()
    parts: list[WritePart | SendPart] = list(
        plan_paged(op, page, 9, views, desc, Pages(d_idx, page), RAILS))
    assert await a.run(parts) is None
    for s, d in zip(s_idx, d_idx, strict=True):
        assert digest(dst_view[d * page:(d + 1) * page]) == digest(src_view[s * page:(s + 1) *
                                                                                page])
    assert b.counter.value(9) == n


@conformance
async def test_barrier_counts_one(a: Node, b: Node) -> None:
    _, desc, _ = b.region(4096)
    op = a.op()
    assert await a.run(list(plan_barrier(op, 11, [desc], RAILS))) is None
    assert b.counter.value(11) == 1


def _needs_reads(a: Node) -> None:
    """A Domain that says it serves no READs is skipped, with why (every Domain here
    serves them; verbs runs them where it has a device)."""
    if not a.group.capabilities.reads:
        pytest.skip(f"{a.group.domain} does not serve one-sided READ")


@conformance
async def test_single_reads_land_whole(a: Node, b: Node) -> None:
    _needs_reads(a)
    """A peer region's bytes into ours, whole and split over the rails; nothing counted."""
    _, desc, src_view = b.region(4 << 20, seed=21, access="r")
    _, _, dst_view = a.region(4 << 20)
    for length, dst_off, src_off in [(100, 4096, 7), (3 << 20, 1, 65536)]:
        parts: list[WritePart | SendPart | ReadPart] = list(plan_single_read(
            a.op(), length, dst_view[dst_off:dst_off + length], desc, src_off, RAILS))
        assert await a.run(parts) is None
        assert digest(dst_view[dst_off:dst_off + length]) == digest(
            src_view[src_off:src_off + length])
    assert not b.counter.value(0) and not a.counter.value(0)


@conformance
async def test_paged_reads_land_page_by_page(a: Node, b: Node) -> None:
    _needs_reads(a)
    page, n = 4096, 300
    _, desc, src_view = b.region(page * 512, seed=22, access="rw")
    _, _, dst_view = a.region(page * 512)
    rng = random.Random(23)
    s_idx, d_idx = rng.sample(range(512), n), rng.sample(range(512), n)
    into = [dst_view[i * page:(i + 1) * page] for i in d_idx]
    parts: list[WritePart | SendPart | ReadPart] = list(
        plan_paged_reads(a.op(), page, into, desc, Pages(s_idx, page), RAILS))
    assert await a.run(parts) is None
    for s, d in zip(s_idx, d_idx, strict=True):
        assert digest(dst_view[d * page:(d + 1) * page]) == digest(
            src_view[s * page:(s + 1) * page])


@conformance
async def test_read_refusals_leave_memory_untouched(a: Node, b: Node) -> None:
    _needs_reads(a)
    """A write-only region reads as a forged rkey does (NOT_FOUND); past the end is
    OUT_OF_BOUNDS; a revoked region NOT_FOUND; the reader's memory untouched by all."""
    _, wdesc, _ = b.region(8192, seed=24)
    rregion, rdesc, _ = b.region(8192, seed=25, access="r")
    _, _, dst_view = a.region(8192, seed=26)
    before = digest(dst_view)
    forged = MrDesc(rdesc.ptr, [(ad, k ^ 0x5A5A) for ad, k in rdesc.rkeys], rdesc.size)
    unsized = MrDesc(rdesc.ptr, rdesc.rkeys, 0)
    errors = []
    for d, off, kind in [(wdesc, 0, NotFound), (forged, 0, NotFound),
                         (unsized, 8192 - 100, OutOfBounds)]:
        err = await a.run(list(plan_single_read(a.op(), 200, dst_view[:200], d, off, RAILS)))
        assert isinstance(err, kind), (kind, err)
        errors.append(err)
    assert errors[0].message == errors[1].message
    b.revoke(rregion)
    err = await a.run(list(plan_single_read(a.op(), 200, dst_view[:200], rdesc, 0, RAILS)))
    assert isinstance(err, NotFound)
    assert digest(dst_view) == before


@conformance
async def test_bounds_and_rkey_refusals_leave_memory_untouched(a: Node, b: Node) -> None:
    _, _, src_view = a.region(8192, seed=6)
    _, desc, dst_view = b.region(8192, seed=7)
    before = digest(dst_view)
    unsized = MrDesc(desc.ptr, desc.rkeys, 0)  # the initiator cannot check: the receiver must
    forged = MrDesc(desc.ptr, [(ad, k ^ 0x5A5A) for ad, k in desc.rkeys], desc.size)
    for d, off, length, kind in [(unsized, 8192 - 100, 200, OutOfBounds),
                                 (MrDesc(desc.ptr - 4096, desc.rkeys, 0), 0, 100, OutOfBounds),
                                 (forged, 0, 100, NotFound)]:
        op = a.op()
        err = await a.run(list(plan_single(op, length, 13, src_view[:length], d, off, RAILS)))
        assert isinstance(err, kind), (kind, err)
    assert digest(dst_view) == before and b.counter.value(13) == 0


@conformance
async def test_register_and_revoke(a: Node, b: Node) -> None:
    _, _, src_view = a.region(4096, seed=8)
    region, desc, dst_view = b.region(4096)
    op = a.op()
    assert await a.run(list(plan_single(op, 4096, 15, src_view, desc, 0, RAILS))) is None
    assert bytes(dst_view) == bytes(src_view)
    dst_view[:] = bytes(4096)
    b.revoke(region)
    op = a.op()
    err = await a.run(list(plan_single(op, 4096, 15, src_view, desc, 0, RAILS)))
    assert isinstance(err, NotFound), err
    assert bytes(dst_view) == bytes(4096) and b.counter.value(15) == 1


@conformance
async def test_many_writes_in_any_order(a: Node, b: Node) -> None:
    """Disjoint writes in flight at once (chaos reorders and splits them): every byte
    right, the counter exactly the number of writes."""
    n, size = 64, 16 * 1024
    _, _, src_view = a.region(n * size, seed=9)
    _, desc, dst_view = b.region(n * size)
    jobs = []
    for i in range(n):
        op = a.op()
        jobs.append(a.run(list(plan_single(op, size, 17, src_view[i * size:(i + 1) * size],
                                           desc, (n - 1 - i) * size, RAILS))))
    assert await asyncio.gather(*jobs) == [None] * n
    for i in range(n):
        j = n - 1 - i
        assert digest(dst_view[j * size:(j + 1) * size]) == digest(
            src_view[i * size:(i + 1) * size])
    assert b.counter.value(17) == n


@conformance
async def test_messages_carry_the_authenticated_sender(a: Node, b: Node) -> None:
    op = a.op()
    dst = b.group.rail_address(0)
    assert await a.run([SendPart(0, dst, b"hello", op)]) is None
    assert b.messages == [((a.node, 0), b"hello")]


@conformance
async def test_a_traced_message_carries_its_trace_id(
        a: Node, b: Node) -> None:
    """A SendPart with a trace id arrives whole; the Domain hands the receiver the
    sender's trace id with it (SEND TX_EXT: in the stream on tcp, in the whole RC SEND
    on verbs), and None for a message that carried none."""
    tp = bytes.fromhex("00" + "4bf92f3577b34da6a3ce929d0e0e4736" + "00f067aa0ba902b7" + "01")
    dst = b.group.rail_address(0)
    assert await a.run([SendPart(0, dst, b"traced", a.op(), trace=tp)]) is None
    assert await a.run([SendPart(0, dst, b"plain", a.op())]) is None
    assert b.messages == [((a.node, 0), b"traced"), ((a.node, 0), b"plain")]
    assert b.traces == [tp, None]


@conformance
async def test_a_dying_peer_fails_the_transfer(a: Node, b: Node) -> None:
    _, _, src_view = a.region(4096, seed=10)
    _, desc, _ = b.region(4096)
    op = a.op()
    assert await a.run(list(plan_single(op, 4096, None, src_view, desc, 0, RAILS))) is None
    b.close()
    await asyncio.sleep(0.05)
    op = a.op()
    err = await a.run(list(plan_single(op, 4096, None, src_view, desc, 0, RAILS)))
    assert isinstance(err, PeerUnreachable), err


@conformance
async def test_close_fails_what_is_outstanding_and_later_posts(a: Node, b: Node) -> None:
    _, _, src_view = a.region(1 << 20, seed=11)
    _, desc, _ = b.region(1 << 20)
    op = a.op()
    pending = asyncio.ensure_future(a.run(list(plan_single(op, 1 << 20, None, src_view, desc,
                                                           0, RAILS))))
    await asyncio.sleep(0)
    a.close_group()
    err = await pending
    assert err is None or isinstance(err, PeerUnreachable), err
    op = a.op()
    err = await a.run(list(plan_single(op, 4096, None, src_view[:4096], desc, 0, RAILS)))
    assert isinstance(err, PeerUnreachable), err


def test_every_registered_domain_is_in_the_suite() -> None:
    """A Domain registered anywhere is run here (verbs: skipped only with a reason)."""
    specs = {p if isinstance(p, str) else p.values[0] for p in _specs()}
    for name in registry.names():
        assert any(s.split(":")[0] == name for s in specs), name
    assert {"tcp", "chaos:tcp", "inproc", "verbs"} <= specs


def test_verbs_is_skipped_only_with_the_reason_there_is_no_device() -> None:
    """verbs runs this suite where a device is ACTIVE; elsewhere its skip says why."""
    verbs = [p for p in _specs() if not isinstance(p, str) and p.values[0] == "verbs"]
    if RDMA_WHY is None:
        assert verbs == [] and "verbs" in _specs()
        return
    (param,) = verbs
    (mark,) = param.marks
    assert mark.kwargs["reason"] == f"verbs: {RDMA_WHY}"
    assert any(w in RDMA_WHY for w in ("pyverbs", "no RDMA device", "TRANSFERD_RDMA_DEVICES"))
