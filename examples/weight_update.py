#!/usr/bin/env python3
"""RL weight update: a trainer writes new weights to every inference node at once.

The second of the TransferEngine article's three systems (it updates a 1T-parameter model
in 1.3 s).  The trainer holds ``size`` bytes of weights in ``shards`` shards (tensors) in
one registered region; every inference node has a region laid out the same way.  The
trainer writes every shard to every node at once, each as a single write that the engine
splits over all of its rails; writes land in any order and no node waits for another.
When every write has been acknowledged (each one in place), a barrier -- a zero-byte write
carrying an immediate, one per node -- tells each inference node that its update is
complete: it waits with ``expect_imm_count(imm, 1)``.

Run it from the checkout (it starts 1 + ``--receivers`` daemons, on loopback)::

    python3 examples/weight_update.py [--mib 256] [--shards 64] [--receivers 2] [--rails 2]

It prints the time to each node's barrier, GiB/s per node and in all, and checks every
shard on every node (CRC-32 of each shard, trainer against node).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout's packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client import Client, Completion, MrDesc, NetAddr, PeerGroup

# The barrier's immediate: one count per inference node and update.
IMM_DONE = 0x524C0001


@dataclass(frozen=True)
class WeightShape:
    """``size`` bytes of weights in ``shards`` shards of equal length."""

    size: int = 256 << 20
    shards: int = 64

    def __post_init__(self) -> None:
        if self.shards < 1 or self.size % self.shards:
            raise ValueError(f"{self.size} bytes do not make {self.shards} equal shards")

    @property
    def shard_len(self) -> int:
        return self.size // self.shards


def shard_data(seed: int, shard: int, length: int) -> bytes:
    """Shard ``shard`` of the weights of version ``seed`` (the trainer's output)."""
    return random.Random(seed * 1_000_003 + shard).randbytes(length)


@dataclass
class UpdateTimes:
    """CLOCK_MONOTONIC nanoseconds of one update at the trainer."""

    start: int = 0     # the first write submitted
    written: int = 0   # every write acknowledged by its node
    barrier: int = 0   # the barrier acknowledged by every node


class Trainer:
    """The trainer's side: its weights registered with its daemon, a group of nodes."""

    def __init__(self, client: Client, shape: WeightShape) -> None:
        self.client = client
        self.shape = shape

    async def setup(self) -> None:
        self.weights = await self.client.alloc_buffer(self.shape.size)
        self.mr, _ = await self.client.reg_mr(self.weights)

    async def compute_weights(self, seed: int) -> list[int]:
        """A new version of the weights (stand-in for a training step); each shard's CRC-32."""
        n = self.shape.shard_len
        crcs = []
        for s in range(self.shape.shards):
            data = shard_data(seed, s, n)
            await self.client.set_tensor(self.weights.tensor(s * n, n), data)
            crcs.append(zlib.crc32(data))
        return crcs

    async def group(self, nodes: Sequence[NetAddr]) -> PeerGroup:
        """The inference nodes of an update: their links opened now, ahead of it."""
        return await self.client.add_peer_group(list(nodes))

    async def update(self, group: PeerGroup, dsts: Sequence[MrDesc], imm: int = IMM_DONE,
                     timeout: float = 120.0) -> UpdateTimes:
        """Every shard to every node (``dsts``: each node's region), then the barrier."""
        n = self.shape.shard_len
        t = UpdateTimes(start=time.monotonic_ns())
        writes = []
        for s in range(self.shape.shards):  # shard by shard: every node's copy at once
            for d in dsts:
                writes.append(await self.client.submit_single_write(
                    n, None, (self.mr, s * n), (d, s * n)))
        await asyncio.wait_for(asyncio.gather(*(w.wait() for w in writes)), timeout)
        t.written = time.monotonic_ns()
        # Only now: a node that counts the barrier has every shard in place.
        await (await self.client.submit_barrier(group, imm, list(dsts))).wait(timeout)
        t.barrier = time.monotonic_ns()
        return t


class Receiver:
    """An inference node: its weights region; learns from the barrier that an update is in."""

    def __init__(self, client: Client, shape: WeightShape) -> None:
        self.client = client
        self.shape = shape
        self._done: Completion | None = None
        self.arrived = 0

    async def setup(self) -> None:
        self.weights = await self.client.alloc_buffer(self.shape.size)
        await self.client.buffer_clear(self.weights, 0)
        _, self.desc = await self.client.reg_mr(self.weights)
        self.addr = await self.client.main_address()

    async def expect(self, imm: int = IMM_DONE, timeout: float = 300.0) -> None:
        self.arrived = 0
        self._done = await self.client.expect_imm_count(imm, 1, wait=False, timeout=timeout)
        self._done.add_done_callback(self._arrived)

    def _arrived(self, _: Completion) -> None:
        self.arrived = time.monotonic_ns()

    async def wait(self, timeout: float = 120.0) -> int:
        """Until the update's barrier counted here; when (CLOCK_MONOTONIC ns)."""
        assert self._done is not None
        await self._done.wait(timeout)
        await asyncio.sleep(0)  # the done callback runs on the next turn of the loop
        return self.arrived

    async def digests(self) -> list[int]:
        n = self.shape.shard_len
        out = bytearray(n)
        crcs = []
        for s in range(self.shape.shards):
            await self.client.get_tensor(self.weights.tensor(s * n, n), out=out)
            crcs.append(zlib.crc32(out))
        return crcs


@dataclass
class UpdateResult:
    times: UpdateTimes
    arrived: list[int]  # each node's barrier, CLOCK_MONOTONIC ns
    size: int
    ok: bool

    @property
    def seconds(self) -> float:
        """From the first write to the last node's barrier."""
        return (max(self.arrived) - self.times.start) / 1e9

    @property
    def per_node_gib_s(self) -> list[float]:
        return [self.size / ((a - self.times.start) / 1e9) / (1 << 30) for a in self.arrived]

    @property
    def total_gib_s(self) -> float:
        return self.size * len(self.arrived) / self.seconds / (1 << 30)


async def one_update(trainer: Trainer, group: PeerGroup, nodes: Sequence[Receiver], seed: int
                     ) -> UpdateResult:
    want = await trainer.compute_weights(seed)
    for r in nodes:
        await r.expect()
    times = await trainer.update(group, [r.desc for r in nodes])
    arrived = [await r.wait() for r in nodes]
    ok = all([await r.digests() == want for r in nodes])
    return UpdateResult(times, arrived, trainer.shape.size, ok)


async def run(urls: Sequence[str], shape: WeightShape, updates: int) -> list[UpdateResult]:
    """``urls``: the trainer's engine, then each inference node's."""
    clients = [await Client.connect(u) for u in urls]
    try:
        trainer = Trainer(clients[0], shape)
        await trainer.setup()
        nodes = [Receiver(c, shape) for c in clients[1:]]
        for r in nodes:
            await r.setup()
        group = await trainer.group([r.addr for r in nodes])
        return [await one_update(trainer, group, nodes, seed) for seed in range(1, updates + 1)]
    finally:
        for c in clients:
            await c.close()


def main() -> None:
    from examples.local_daemons import local_daemons

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="size of the weights, MiB")
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--receivers", type=int, default=2, help="inference nodes")
    ap.add_argument("--rails", type=int, default=2, help="rails (NICs) per node, 1 to 4")
    ap.add_argument("--updates", type=int, default=2)
    args = ap.parse_args()
    shape = WeightShape(args.mib << 20, args.shards)
    with local_daemons(1 + args.receivers, rails=args.rails) as urls:
        results = asyncio.run(run(urls, shape, args.updates))
    for i, r in enumerate(results):
        per = ", ".join(f"{g:.2f}" for g in r.per_node_gib_s)
        print(f"update {i + 1}: {args.mib} MiB in {shape.shards} shards to {args.receivers} "
              f"node(s) over {args.rails} rail(s): last barrier after {r.seconds * 1e3:.0f} ms; "
              f"GiB/s per node {per}, in all {r.total_gib_s:.2f}; shards "
              f"{'all match' if r.ok else 'MISMATCH'}")
    sys.exit(0 if all(r.ok for r in results) else 1)


if __name__ == "__main__":
    main()
