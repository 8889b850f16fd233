#!/usr/bin/env python3
"""Disaggregated prefill and decode: a request's KV cache moved layer by layer.

The first of the TransferEngine article's three systems.  A prefill node computes a
request's ``layers`` layers one after another; each layer's keys and values sit in
``pages`` pages of the node's paged KV cache, at page indices its allocator handed out
(random here, on both sides: a cache that has served requests is fragmented).  After
each layer the model bumps a UVM watcher (on a GPU a kernel stores the number of layers
done into the mapped word, ``UvmWatcher.device_pointer()``; here a host store stands in
for it), and the watcher's callback submits that layer's pages to the decode node as one
paged write carrying the layer's immediate while the next layers compute.  The decode
node waits with ``expect_imm_count(layer's immediate, pages)`` per layer: a layer is
usable as soon as its own pages are in place, whatever order they landed in.

With ``--armed`` the prefill node arms each layer's paged write on the watcher before
the request (``arm_paged_writes(watcher, value, ...)``, ARM_PAGED_WRITES): its daemon
submits a layer's write itself when the word reaches that layer's value, with no round
trip through this process (the article's watcher that triggers the transfer).

Run it from the checkout (it starts two daemons, on loopback)::

    python3 examples/kv_cache.py [--layers 32] [--pages 64] [--page-kib 16]
                                 [--compute-ms 2] [--requests 3] [--rails 1] [--armed]

It prints, per request, the time from each layer's bump to its pages being usable on
the decode node (median and worst), and the request's end, and checks every page of
every layer (CRC-32 of the pages in order, prefill against decode).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout's packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client import Client, Completion, MrDesc, Pages

# The prefill node's engine settings.  Its watcher is on the critical path of every
# layer, and requests come with quiet spells between them: by default a quiet watcher is
# polled every 10 ms, so a request's first layers would be seen up to 10 ms late (and
# merged into one change); polled at full pace always (the article's dedicated polling
# thread), the first bump of a request is seen within ~50 us, at about a tenth of a core
# while the watcher exists (docs/configuration.md, engine.watcher_idle_poll_ms).
PREFILL_ENGINE = {"watcher_idle_poll_ms": "0.05"}

# The layers' immediates: IMM_BASE + layer (one counter per layer, reused request after
# request: expect_imm_count consumes what it waited for).
IMM_BASE = 0x4B560000
FILL_CHUNK = 8 << 20


@dataclass(frozen=True)
class KvShape:
    """One request's KV cache: ``layers`` x ``pages`` pages of ``page_len`` bytes, in a
    cache (on each node) of ``pool`` times as many pages."""

    layers: int = 32
    pages: int = 64
    page_len: int = 16 << 10
    pool: int = 2

    @property
    def pool_pages(self) -> int:
        return self.layers * self.pages * self.pool

    @property
    def pool_bytes(self) -> int:
        return self.pool_pages * self.page_len

    @property
    def layer_bytes(self) -> int:
        return self.pages * self.page_len


@dataclass(frozen=True)
class RequestPlan:
    """Where one request's pages are: per layer, indices in the prefill and decode caches."""

    src: list[list[int]]
    dst: list[list[int]]
    imm_base: int = IMM_BASE


def plan_request(shape: KvShape, seed: int, imm_base: int = IMM_BASE) -> RequestPlan:
    """Random, distinct pages on each side (the same for a seed)."""
    rng = random.Random(seed)
    n = shape.layers * shape.pages

    def per_layer(idx: list[int]) -> list[list[int]]:
        return [idx[i * shape.pages:(i + 1) * shape.pages] for i in range(shape.layers)]

    return RequestPlan(per_layer(rng.sample(range(shape.pool_pages), n)),
                       per_layer(rng.sample(range(shape.pool_pages), n)), imm_base)


def layer_digests(cache: bytes | bytearray | memoryview, pages: Sequence[Sequence[int]],
                  page_len: int) -> list[int]:
    """CRC-32 of each layer's pages, in the layer's order."""
    view = memoryview(cache)
    out = []
    for idx in pages:
        crc = 0
        for i in idx:
            crc = zlib.crc32(view[i * page_len:(i + 1) * page_len], crc)
        out.append(crc)
    return out


@dataclass
class LayerTimes:
    """CLOCK_MONOTONIC nanoseconds of each layer's steps (one list entry per layer)."""

    bump: list[int] = field(default_factory=list)       # the model stored into the word
    event: list[int] = field(default_factory=list)      # the watcher's callback ran here
    issued: list[int] = field(default_factory=list)     # the paged write handed to the engine
    submitted: list[int] = field(default_factory=list)  # the submit returned (over a
    # daemon: its frame was sent; in process: the engine has put the pages on the wire)
    acked: list[int] = field(default_factory=list)      # the initiator's completion
    start: int = 0                                      # the request's first compute
    # Armed (Prefill(armed=True)): when arming the request's layers began.  The daemon
    # issues each write itself, unseen here: ``issued`` and ``submitted`` stay 0.
    armed: int = 0


class Prefill:
    """The prefill node: its KV cache registered with its daemon, a watcher the model bumps."""

    def __init__(self, client: Client, shape: KvShape, *, armed: bool = False) -> None:
        self.client = client
        self.shape = shape
        # Each layer's write armed on the watcher before the request, fired by the daemon
        # (ARM_PAGED_WRITES), instead of submitted by the watcher's callback here.
        self.armed = armed
        self._layers_done = 0  # the word's value: layers finished, every request together
        self._base = 0  # the word's value when the current request started
        self._request: tuple[RequestPlan, MrDesc] | None = None
        self._writes: list[asyncio.Future[None]] = []
        self.times = LayerTimes()

    async def setup(self) -> None:
        self.cache = await self.client.alloc_buffer(self.shape.pool_bytes)
        self.mr, _ = await self.client.reg_mr(self.cache)
        self.watcher = await self.client.alloc_uvm_watcher(self._on_bump)

    async def compute_kv(self, seed: int) -> bytes:
        """Stand-in for the model's output: the whole cache filled with bytes of ``seed``
        (before the request, so that computing costs the daemon nothing while it runs)."""
        data = random.Random(seed).randbytes(self.shape.pool_bytes)
        for off in range(0, len(data), FILL_CHUNK):
            chunk = memoryview(data)[off:off + FILL_CHUNK]
            await self.client.set_tensor(self.cache.tensor(off, len(chunk)), chunk)
        return data

    async def run(self, plan: RequestPlan, decode: MrDesc, compute_s: float,
                  timeout: float = 30.0) -> LayerTimes:
        """One request: layer after layer, each ``compute_s`` of "compute" (by an absolute
        schedule, so a late wake-up does not delay later layers), then the bump."""
        self._request = (plan, decode)
        self._base = self._layers_done
        self._writes = []
        t = self.times = LayerTimes()
        n = self.shape.layers
        t.event, t.issued, t.submitted, t.acked = [0] * n, [0] * n, [0] * n, [0] * n
        if self.armed:
            t.armed = time.monotonic_ns()
            await self._arm(plan, decode)
        t.start = time.monotonic_ns()
        for layer in range(n):
            await sleep_until(t.start + round((layer + 1) * compute_s * 1e9))
            t.bump.append(time.monotonic_ns())
            self._layers_done += 1
            self.watcher.set(self._layers_done)  # the kernel's store
        # Every layer's write was submitted by the watcher's callback: wait for them all.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self._writes) < n and loop.time() < deadline:
            await asyncio.sleep(0.0005)
        if len(self._writes) < n:
            raise TimeoutError(f"the watcher reported {len(self._writes)} of {n} layers")
        await asyncio.wait_for(asyncio.gather(*self._writes), max(0.0, deadline - loop.time()))
        self._request = None
        return t

    async def _arm(self, plan: RequestPlan, decode: MrDesc) -> None:
        """Arm every layer's write: layer L's when the word reaches base + L + 1."""
        page = self.shape.page_len
        for layer in range(self.shape.layers):
            done = await self.client.arm_paged_writes(
                self.watcher, self._base + layer + 1, page, plan.imm_base + layer,
                (self.mr, Pages(plan.src[layer], page)), (decode, Pages(plan.dst[layer], page)))
            self._writes.append(asyncio.ensure_future(self._acked(layer, done)))

    async def _acked(self, layer: int, done: Completion) -> None:
        await done
        self.times.acked[layer] = time.monotonic_ns()

    def _on_bump(self, old: int, new: int) -> None:
        # The word counts finished layers: one change may stand for several of them.
        now = time.monotonic_ns()
        for value in range(old, new):
            layer = value - self._base
            if 0 <= layer < len(self.times.event):
                self.times.event[layer] = now
            if not self.armed:
                self._writes.append(asyncio.ensure_future(self._send(layer)))

    async def _send(self, layer: int) -> None:
        assert self._request is not None
        plan, decode = self._request
        page = self.shape.page_len
        self.times.issued[layer] = time.monotonic_ns()
        done = await self.client.submit_paged_writes(
            page, plan.imm_base + layer, (self.mr, Pages(plan.src[layer], page)),
            (decode, Pages(plan.dst[layer], page)))
        self.times.submitted[layer] = time.monotonic_ns()
        await done
        self.times.acked[layer] = time.monotonic_ns()


class Decode:
    """The decode node: its KV cache registered; learns layer by layer what is usable."""

    def __init__(self, client: Client, shape: KvShape) -> None:
        self.client = client
        self.shape = shape
        self._waits: list[Completion] = []
        self.usable: list[int] = []

    async def setup(self) -> None:
        self.cache = await self.client.alloc_buffer(self.shape.pool_bytes)
        _, self.desc = await self.client.reg_mr(self.cache)

    async def expect(self, plan: RequestPlan, timeout: float = 60.0) -> None:
        """Register the request's layers: each fires once its ``pages`` pages landed."""
        n = self.shape.layers
        self.usable = [0] * n
        self._waits = []
        for layer in range(n):
            c = await self.client.expect_imm_count(plan.imm_base + layer, self.shape.pages,
                                                   wait=False, timeout=timeout)
            c.add_done_callback(self._usable_callback(layer))
            self._waits.append(c)

    def _usable_callback(self, layer: int) -> Callable[[Completion], None]:
        def usable(_: Completion) -> None:
            self.usable[layer] = time.monotonic_ns()

        return usable

    async def wait(self, timeout: float = 30.0) -> list[int]:
        """Until every layer is usable; when each became so (CLOCK_MONOTONIC ns)."""
        await asyncio.wait_for(asyncio.gather(*(c.wait() for c in self._waits)), timeout)
        await asyncio.sleep(0)  # the done callbacks run on the next turn of the loop
        return list(self.usable)

    async def digests(self, plan: RequestPlan) -> list[int]:
        data = await self.client.get_tensor(self.cache.tensor())
        return layer_digests(data, plan.dst, self.shape.page_len)


async def sleep_until(t_ns: int) -> None:
    left = (t_ns - time.monotonic_ns()) / 1e9
    if left > 0:
        await asyncio.sleep(left)


@dataclass
class RequestResult:
    """One request seen from both nodes: bump -> usable per layer, the request's end."""

    times: LayerTimes
    usable: list[int]
    ok: bool

    @property
    def layer_ms(self) -> list[float]:
        return [(u - b) / 1e6 for b, u in zip(self.times.bump, self.usable, strict=True)]

    @property
    def request_ms(self) -> float:
        """From the first layer's compute to the last layer usable on the decode node."""
        return (max(self.usable) - self.times.start) / 1e6

    @property
    def tail_ms(self) -> float:
        """From the last layer's bump to the last byte usable on the decode node."""
        return (max(self.usable) - self.times.bump[-1]) / 1e6


async def one_request(prefill: Prefill, decode: Decode, seed: int, compute_s: float,
                      check: bool = True) -> RequestResult:
    """One request between the two nodes, its bytes checked page by page (``check``)."""
    plan = plan_request(prefill.shape, seed)
    data = await prefill.compute_kv(seed) if check else b""
    await decode.expect(plan)
    times = await prefill.run(plan, decode.desc, compute_s)
    usable = await decode.wait()
    ok = True
    if check:
        want = layer_digests(data, plan.src, prefill.shape.page_len)
        ok = await decode.digests(plan) == want
    return RequestResult(times, usable, ok)


async def run(urls: Sequence[str], shape: KvShape, compute_s: float, requests: int,
              armed: bool = False) -> list[RequestResult]:
    """``urls``: the prefill node's engine, then the decode node's."""
    a = await Client.connect(urls[0])
    b = await Client.connect(urls[1])
    try:
        prefill, decode = Prefill(a, shape, armed=armed), Decode(b, shape)
        await prefill.setup()
        await decode.setup()
        return [await one_request(prefill, decode, seed, compute_s)
                for seed in range(1, requests + 1)]
    finally:
        await a.close()
        await b.close()


def main() -> None:
    from examples.local_daemons import local_daemons

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pages", type=int, default=64, help="pages per layer")
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument("--compute-ms", type=float, default=2.0, help="each layer's compute")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--rails", type=int, default=1, help="rails (NICs) per node, 1 to 4")
    ap.add_argument("--armed", action="store_true",
                    help="arm each layer's write on the watcher; the daemon fires it")
    args = ap.parse_args()
    shape = KvShape(args.layers, args.pages, args.page_kib << 10)
    with local_daemons(2, rails=args.rails, engine=PREFILL_ENGINE) as urls:
        results = asyncio.run(run(urls, shape, args.compute_ms / 1e3, args.requests,
                                  args.armed))
    for i, r in enumerate(results):
        ms = sorted(r.layer_ms)
        print(f"request {i + 1}: {shape.layers} layers x {shape.pages} pages of "
              f"{shape.page_len >> 10} KiB; bump -> usable median {ms[len(ms) // 2]:.2f} ms, "
              f"worst {ms[-1]:.2f} ms; last layer usable {r.tail_ms:.2f} ms after its bump, "
              f"{r.request_ms:.1f} ms after the request started; pages "
              f"{'all match' if r.ok else 'MISMATCH'}")
    sys.exit(0 if all(r.ok for r in results) else 1)


if __name__ == "__main__":
    main()
