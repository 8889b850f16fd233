#!/usr/bin/env python3
"""MoE dispatch and combine: every rank sends its tokens to the ranks of their experts.

The third of the TransferEngine article's three systems.  ``ranks`` ranks each host
``experts_per_rank`` experts; at every step each rank routes its ``tokens`` tokens (7 KiB
each: a 7168-wide hidden state in 8 bits) to their top-``topk`` experts, with a skewed
popularity (a few experts take most tokens) drawn from a fixed seed, so how many tokens
go from one rank to another changes from step to step.  A token goes once to each rank
that hosts one of its experts.

- **Dispatch**: each rank writes to every other rank the slab of its tokens for that rank,
  all in one ``submit_scatter`` (one destination per rank it has tokens for: the source's
  slot in the destination's receive buffer), and once the scatter is acknowledged, a
  ``submit_barrier`` to every other rank: a rank that has counted ``ranks - 1`` barriers
  (``expect_imm_count``) has every token sent to it in place, even from ranks that had
  none for it.
- **Combine**: each rank's experts answer (here the tokens come back as they went, from
  the receive buffer: the expert's computation is not the subject) with a scatter back
  to each source's combine buffer and a second barrier.

How many tokens each rank receives from each other is known to every rank from the
routing (a real dispatcher sends the counts along; here every rank derives them from the
seed, so that no rank reads them back from its daemon).

Run it from the checkout (it starts ``--ranks`` daemons, on loopback)::

    python3 examples/moe_dispatch.py [--ranks 4] [--tokens 32] [--steps 16]

It prints the dispatch and combine latency of every step (median and worst over ranks)
and checks every token of the last step on every rank.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout's packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client import Client, MrDesc, NetAddr, PeerGroup, ScatterDst

IMM_DISPATCH = 0x4D4F0001
IMM_COMBINE = 0x4D4F0002
SEED = 2025


@dataclass(frozen=True)
class MoeShape:
    ranks: int = 8
    tokens: int = 32             # per rank and step
    experts_per_rank: int = 4
    topk: int = 4
    token_len: int = 7 << 10
    skew: float = 1.2            # expert popularity ~ 1 / (popularity rank + 1) ** skew

    @property
    def experts(self) -> int:
        return self.ranks * self.experts_per_rank

    @property
    def slot(self) -> int:
        """The room one rank has in another's buffer: all of its tokens."""
        return self.tokens * self.token_len

    @property
    def buffer(self) -> int:
        return self.ranks * self.slot


Counts = list[list[int]]  # counts[src][dst]: tokens src sends to dst in a step


def routing(shape: MoeShape, steps: int, seed: int = SEED) -> list[Counts]:
    """Each step's token counts between ranks, the same on every rank for a seed.

    Expert popularity is fixed by the seed (a skewed model: expert i of a random order
    weighs 1 / (i + 1) ** skew); every step each token draws experts by weight until it
    has ``topk`` distinct ones, and goes once to each rank hosting one of them.
    """
    rng = random.Random(seed)
    order = rng.sample(range(shape.experts), shape.experts)
    weight = [0.0] * shape.experts
    for i, e in enumerate(order):
        weight[e] = 1.0 / (i + 1) ** shape.skew
    cum = list(itertools.accumulate(weight))
    experts = range(shape.experts)
    k = min(shape.topk, shape.experts)
    out = []
    for _ in range(steps):
        counts = [[0] * shape.ranks for _ in range(shape.ranks)]
        for src in range(shape.ranks):
            row = counts[src]
            for _ in range(shape.tokens):
                picked: set[int] = set()
                while len(picked) < k:
                    picked.update(rng.choices(experts, cum_weights=cum, k=k - len(picked)))
                for dst in {e // shape.experts_per_rank for e in picked}:
                    row[dst] += 1
        out.append(counts)
    return out


def token_data(seed: int, rank: int, shape: MoeShape) -> bytes:
    """What rank ``rank``'s send buffer holds for a checked step of ``seed``."""
    return random.Random(seed * 1_000_003 + rank).randbytes(shape.buffer)


@dataclass
class StepTimes:
    """CLOCK_MONOTONIC nanoseconds of one step at one rank."""

    start: int
    scattered: int   # this rank's dispatch scatter acknowledged (its tokens in place)
    dispatched: int  # every rank's tokens for this rank in place (its barrier counted)
    answered: int    # this rank's combine scatter acknowledged
    combined: int    # every answer to this rank's tokens in place

    @property
    def dispatch_us(self) -> float:
        return (self.dispatched - self.start) / 1e3

    @property
    def combine_us(self) -> float:
        return (self.combined - self.dispatched) / 1e3


@dataclass(frozen=True)
class RankInfo:
    """What a rank tells the others (out of band): its engine, its two landing regions."""

    addr: NetAddr
    recv: MrDesc
    comb: MrDesc

    def to_wire(self) -> list[str]:
        return [self.addr.to_bytes().hex(), self.recv.to_bytes().hex(),
                self.comb.to_bytes().hex()]

    @classmethod
    def from_wire(cls, w: Sequence[str]) -> RankInfo:
        return cls(NetAddr.from_bytes(bytes.fromhex(w[0])), MrDesc.from_bytes(bytes.fromhex(w[1])),
                   MrDesc.from_bytes(bytes.fromhex(w[2])))


class MoeRank:
    """One rank: a send buffer (a slab per destination), a receive buffer (a slot per
    source) and a combine buffer (a slot per expert rank), all registered."""

    def __init__(self, client: Client, shape: MoeShape, rank: int) -> None:
        self.client = client
        self.shape = shape
        self.rank = rank

    async def setup(self) -> RankInfo:
        c, n = self.client, self.shape.buffer
        self.send_buf, self.recv_buf, self.comb_buf = [await c.alloc_buffer(n) for _ in range(3)]
        self.send_mr, _ = await c.reg_mr(self.send_buf)
        self.recv_mr, recv = await c.reg_mr(self.recv_buf)
        _, comb = await c.reg_mr(self.comb_buf)
        self.info = RankInfo(await c.main_address(), recv, comb)
        return self.info

    async def join(self, ranks: Sequence[RankInfo]) -> PeerGroup:
        """Every rank's info (this one's included, in rank order): links opened now."""
        self.ranks = list(ranks)
        self.others = [r for r in range(self.shape.ranks) if r != self.rank]
        self.group = await self.client.add_peer_group([ranks[r].addr for r in self.others])
        return self.group

    async def step(self, counts: Counts, timeout: float = 30.0) -> StepTimes:
        """One dispatch and one combine; returns when this rank's answers are all in."""
        c, me, tok, slot = self.client, self.rank, self.shape.token_len, self.shape.slot
        peers = len(self.others)
        start = time.monotonic_ns()
        # The step's two expectations travel with the dispatch (three frames, one turn).
        dispatched, combined, scatter = await asyncio.gather(
            c.expect_imm_count(IMM_DISPATCH, peers, wait=False, timeout=timeout),
            c.expect_imm_count(IMM_COMBINE, peers, wait=False, timeout=timeout),
            c.submit_scatter(self.group, None, self.send_mr, [
                ScatterDst(counts[me][d] * tok, d * slot, (self.ranks[d].recv, me * slot))
                for d in self.others if counts[me][d]]))
        await scatter.wait(timeout)
        t_scattered = time.monotonic_ns()
        barrier = await c.submit_barrier(self.group, IMM_DISPATCH,
                                         [self.ranks[d].recv for d in self.others])
        await dispatched.wait(timeout)
        t1 = time.monotonic_ns()
        # The experts' answers: each source's tokens back to its combine buffer.
        answer = await c.submit_scatter(self.group, None, self.recv_mr, [
            ScatterDst(counts[s][me] * tok, s * slot, (self.ranks[s].comb, me * slot))
            for s in self.others if counts[s][me]])
        await answer.wait(timeout)
        t_answered = time.monotonic_ns()
        barrier2 = await c.submit_barrier(self.group, IMM_COMBINE,
                                          [self.ranks[s].comb for s in self.others])
        await combined.wait(timeout)
        t2 = time.monotonic_ns()
        await barrier.wait(timeout)
        await barrier2.wait(timeout)
        return StepTimes(start, t_scattered, t1, t_answered, t2)

    async def steps(self, plan: Sequence[Counts]) -> list[StepTimes]:
        return [await self.step(counts) for counts in plan]

    # -- checking a step ------------------------------------------------------------------

    async def fill(self, seed: int) -> None:
        """Tokens of ``seed`` in the send buffer; the landing buffers cleared."""
        await self.client.set_tensor(self.send_buf.tensor(), token_data(seed, self.rank,
                                                                        self.shape))
        await self.client.buffer_clear(self.recv_buf, 0)
        await self.client.buffer_clear(self.comb_buf, 0)

    async def digests(self, counts: Counts) -> dict[str, list[int]]:
        """CRC-32 of each slab sent, each slot received and each slot combined back."""
        tok, slot, me = self.shape.token_len, self.shape.slot, self.rank
        bufs = {k: bytes(await self.client.get_tensor(b.tensor()))
                for k, b in (("send", self.send_buf), ("recv", self.recv_buf),
                             ("comb", self.comb_buf))}
        r = range(self.shape.ranks)
        return {
            "sent": [zlib.crc32(bufs["send"][d * slot:d * slot + counts[me][d] * tok]) for d in r],
            "received": [zlib.crc32(bufs["recv"][s * slot:s * slot + counts[s][me] * tok])
                         for s in r],
            "combined": [zlib.crc32(bufs["comb"][d * slot:d * slot + counts[me][d] * tok])
                         for d in r],
        }


def check_step(digests: Sequence[dict[str, list[int]]]) -> list[str]:
    """What differs after a checked step (empty: every token in place on every rank)."""
    bad = []
    for src, d in enumerate(digests):
        for dst in range(len(digests)):
            if dst == src:
                continue
            if digests[dst]["received"][src] != d["sent"][dst]:
                bad.append(f"rank {dst} holds other tokens than rank {src} dispatched to it")
            if d["combined"][dst] != d["sent"][dst]:
                bad.append(f"rank {src}'s combine slot of rank {dst} holds other bytes")
    return bad


async def connect_ranks(urls: Sequence[str], shape: MoeShape) -> list[MoeRank]:
    return await join_ranks([await Client.connect(u) for u in urls], shape)


async def join_ranks(clients: Sequence[Client], shape: MoeShape) -> list[MoeRank]:
    """Rank i on ``clients[i]`` (any placement: a daemon's client, an inproc engine),
    every rank's regions registered and every rank joined to every other."""
    ranks = [MoeRank(c, shape, i) for i, c in enumerate(clients)]
    infos = [await r.setup() for r in ranks]
    for r in ranks:
        await r.join(infos)
    return ranks


async def run(urls: Sequence[str], shape: MoeShape, steps: int
              ) -> tuple[list[list[StepTimes]], list[str]]:
    """``steps`` steps in a row on every rank, then one checked step."""
    ranks = await connect_ranks(urls, shape)
    try:
        plan = routing(shape, steps + 1)
        times = await asyncio.gather(*(r.steps(plan[:steps]) for r in ranks))
        for r in ranks:
            await r.fill(seed=steps)
        await asyncio.gather(*(r.step(plan[steps]) for r in ranks))
        bad = check_step([await r.digests(plan[steps]) for r in ranks])
        return list(times), bad
    finally:
        for r in ranks:
            await r.client.close()


def main() -> None:
    from examples.local_daemons import local_daemons

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per rank and step")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    shape = MoeShape(ranks=args.ranks, tokens=args.tokens)
    with local_daemons(args.ranks) as urls:
        times, bad = asyncio.run(run(urls, shape, args.steps))
    for k in range(args.steps):
        d = sorted(t[k].dispatch_us for t in times)
        c = sorted(t[k].combine_us for t in times)
        print(f"step {k + 1}: dispatch median {d[len(d) // 2]:,.0f} us, worst {d[-1]:,.0f} us; "
              f"combine median {c[len(c) // 2]:,.0f} us, worst {c[-1]:,.0f} us")
    print("tokens:", "; ".join(bad) if bad else "every token in place on every rank")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
