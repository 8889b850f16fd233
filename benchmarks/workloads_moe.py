"""(3) MoE dispatch and combine: 4 and 8 ranks, skewed routing, 1 to 64 steps in a row.

The system of ``examples/moe_dispatch.py``, its very code: each rank (its role process
beside its own daemon; rank i on CPU i mod 2) routes ``TOKENS`` tokens of 7 KiB a step to
its top-4 of 4 experts per rank with a skewed popularity from a fixed seed, dispatches
them with one ``submit_scatter`` and then a ``submit_barrier`` to every other rank, waits
for the others' barriers (``expect_imm_count``), and answers with a combine scatter and a
second barrier.  Per step and rank: dispatch (step start -> every rank's tokens in place
here) and combine (-> every answer in place here), p50 and p99 over every rank and step;
sequences of 1, 8 and 64 steps in a row, all ranks starting each sequence together, each
round running every length (in alternating order, the arms alternating too).  After them
one step at each rank count is checked token by token (CRC-32 of every slab sent,
received and combined back), on both arms.  No NIXL arm: its ranks would each be
initiator and target of one agent at once, from two threads (see workloads_peers).

The floor, in the same rounds: the same messages between processes placed the same way
(:mod:`benchmarks.workloads_floor`): each rank sends every other rank the same slab over
its own TCP connection, waits for the acks, sends each a barrier message, waits for every
other rank's barrier; the same again for the combine.  Targets: dispatch and combine p50
<= 1.5x the floor's; the step's p50 at 64 steps in a row <= 1.25x its p50 at 1 in the
same round (flat), the median over rounds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from .harness import BenchResult, Check, Options, Pinning, Table, fmt_ratio, median
from .workloads_common import (
    SECTION,
    ClientRole,
    Placement,
    RoleProcess,
    all_of,
    cpu_of,
    describe_cpus,
    load_note,
    load_now,
    p50,
    p99,
    placements,
    process_cpu_s,
    roles,
)

NAME = "workloads_moe"
TITLE = "(3) MoE dispatch + combine, 4 and 8 ranks: p50/p99 per step, 1 to 64 steps in a row"
SECTION = SECTION

RANKS = (4, 8)
TOKENS = 32
SEQUENCES = (1, 8, 64)
QUICK_SEQUENCES = (1, 16)
PLAN = 160  # steps of routing each rank draws at set-up (sequences take them in turn)
TARGET = 1.5
TARGET_FLAT = 1.25
MODULE = "workloads_moe"
TAG_D, TAG_C, TAG_D_DATA, TAG_C_DATA = 1, 2, 3, 4


def _shape(shape: dict[str, int]) -> Any:
    from examples.moe_dispatch import MoeShape

    return MoeShape(**shape)


def _times(ts: list[Any]) -> list[list[int]]:
    return [[t.start, t.scattered, t.dispatched, t.answered, t.combined] for t in ts]


async def _at(t_ns: int) -> None:
    import asyncio

    left = (t_ns - time.monotonic_ns()) / 1e9
    if left > 0:
        await asyncio.sleep(left)


# -- roles: transferd (examples/moe_dispatch.py's ranks) -------------------------------------


class TdRank(ClientRole):
    def __init__(self, url: str, shape: dict[str, int], rank: int) -> None:
        super().__init__(url)
        self.shape, self.rank = _shape(shape), rank

    async def setup(self) -> dict[str, Any]:
        from examples.moe_dispatch import MoeRank, routing

        self.node = MoeRank(await self.connect(), self.shape, self.rank)
        self.plan = routing(self.shape, PLAN)
        return {"info": (await self.node.setup()).to_wire()}

    async def join(self, infos: list[list[str]]) -> None:
        from examples.moe_dispatch import RankInfo

        await self.node.join([RankInfo.from_wire(w) for w in infos])

    async def run(self, steps: int, offset: int, start_at: int) -> dict[str, Any]:
        await _at(start_at)
        plan = [self.plan[(offset + k) % PLAN] for k in range(steps)]
        return {"times": _times(await self.node.steps(plan))}

    async def fill(self, seed: int) -> None:
        await self.node.fill(seed)

    async def digests(self, offset: int) -> dict[str, Any]:
        return await self.node.digests(self.plan[offset % PLAN])


# -- roles: the plain-socket floor -------------------------------------------------------------


class FloorRank:
    """Three regions in one buffer: send, receive, combine (``buffer`` bytes each)."""

    def __init__(self, shape: dict[str, int], rank: int) -> None:
        self.shape, self.rank = _shape(shape), rank

    def setup(self) -> dict[str, Any]:
        from examples.moe_dispatch import routing

        from .workloads_floor import FloorNode

        self.node = FloorNode(3 * self.shape.buffer)
        self.plan = routing(self.shape, PLAN)
        return {"port": self.node.port}

    def join(self, ports: list[int]) -> None:
        self.others = [r for r in range(self.shape.ranks) if r != self.rank]
        self.links = {r: self.node.link(ports[r]) for r in self.others}

    def _phase(self, sends: list[tuple[int, int, int, int]], data_tag: int, tag: int,
               incoming: int) -> tuple[int, int]:
        """Slabs out (rank, from, to, length), acks in, barriers out, others' barriers in."""
        view = self.node.buf.view
        for r, src, dst, n in sends:
            self.links[r].write(data_tag, dst, view[src:src + n])
        if sends:
            self.node.acked.wait(data_tag, len(sends))
        t = time.monotonic_ns()
        for r in self.others:
            self.links[r].barrier(tag)
        self.node.landed.wait(tag, len(self.others))
        done = time.monotonic_ns()  # when this rank goes on (as the transferd rank's await)
        if incoming:  # the slabs that landed here: counted, consumed (all in, by now)
            self.node.landed.wait(data_tag, incoming)
        return t, done

    def step(self, counts: list[list[int]]) -> list[int]:
        me, tok, slot, n = self.rank, self.shape.token_len, self.shape.slot, self.shape.buffer
        start = time.monotonic_ns()
        scattered, dispatched = self._phase(
            [(d, d * slot, n + me * slot, counts[me][d] * tok) for d in self.others
             if counts[me][d]], TAG_D_DATA, TAG_D, sum(counts[s][me] > 0 for s in self.others))
        answered, combined = self._phase(
            [(s, n + s * slot, 2 * n + me * slot, counts[s][me] * tok) for s in self.others
             if counts[s][me]], TAG_C_DATA, TAG_C, sum(counts[me][d] > 0 for d in self.others))
        self.node.acked.wait(TAG_D, len(self.others))
        self.node.acked.wait(TAG_C, len(self.others))
        return [start, scattered, dispatched, answered, combined]

    def run(self, steps: int, offset: int, start_at: int) -> dict[str, Any]:
        left = (start_at - time.monotonic_ns()) / 1e9
        if left > 0:
            time.sleep(left)
        return {"times": [self.step(self.plan[(offset + k) % PLAN]) for k in range(steps)]}

    def fill(self, seed: int) -> None:
        from examples.moe_dispatch import token_data

        n = self.shape.buffer
        view = self.node.buf.view
        view[:n] = token_data(seed, self.rank, self.shape)
        view[n:3 * n] = bytes(2 * n)

    def digests(self, offset: int) -> dict[str, Any]:
        import zlib

        counts = self.plan[offset % PLAN]
        tok, slot, me, n = self.shape.token_len, self.shape.slot, self.rank, self.shape.buffer
        v = self.node.buf.view
        r = range(self.shape.ranks)
        return {
            "sent": [zlib.crc32(v[d * slot:d * slot + counts[me][d] * tok]) for d in r],
            "received": [zlib.crc32(v[n + s * slot:n + s * slot + counts[s][me] * tok])
                         for s in r],
            "combined": [zlib.crc32(v[2 * n + d * slot:2 * n + d * slot + counts[me][d] * tok])
                         for d in r],
        }


ROLES = {"td-rank": TdRank, "floor-rank": FloorRank}


# -- the benchmark ---------------------------------------------------------------------------


class Arm:
    """Every rank's role; ``pids``: every process of the arm (daemons too), whose CPU
    time each sequence adds to ``cpu_s`` (by sequence length, with ``steps`` run)."""

    def __init__(self, label: str, ranks: list[RoleProcess], pids: list[int]) -> None:
        self.label, self.ranks, self.pids = label, ranks, pids
        self.cpu_s: dict[int, float] = {}
        self.steps: dict[int, int] = {}

    def sequence(self, steps: int, offset: int) -> list[list[int]]:
        """``steps`` steps in a row on every rank, starting together; every rank's times."""
        cpu0 = sum(process_cpu_s(p) for p in self.pids)
        start_at = time.monotonic_ns() + 30_000_000  # every rank has the command by then
        got = all_of(self.ranks, op="run", steps=steps, offset=offset, start_at=start_at,
                     timeout=300)
        self.cpu_s[steps] = self.cpu_s.get(steps, 0.0) + sum(
            process_cpu_s(p) for p in self.pids) - cpu0
        self.steps[steps] = self.steps.get(steps, 0) + steps
        return [t for g in got for t in g["times"]]

    def cpu_ms_per_step(self, steps: int) -> float:
        return 1e3 * self.cpu_s[steps] / self.steps[steps]

    def check(self, seed: int, offset: int) -> None:
        from examples.moe_dispatch import check_step

        all_of(self.ranks, op="fill", seed=seed)
        self.sequence(1, offset)
        bad = check_step(all_of(self.ranks, op="digests", offset=offset))
        if bad:
            raise AssertionError(f"{self.label}, {len(self.ranks)} ranks: {bad[:3]}")


@contextlib.contextmanager
def _td_arm(where: Placement, shape: dict[str, int], pins: list[Pinning]) -> Iterator[Arm]:
    """transferd on ``where``: a role per rank (``pins[i]``), joined."""
    with where.engines(pins) as engines, \
            roles([(MODULE, "td-rank", {"url": e.url, "shape": shape, "rank": i}, p)
                   for i, (e, p) in enumerate(zip(engines, pins, strict=True))],
                  env=where.role_env) as td:
        all_of(td, op="join", infos=[r.ready["info"] for r in td])
        # (An inproc engine has no pid of its own: its role's counts it.)
        yield Arm(where.arm, td, [r.pid for r in td] + [e.pid for e in engines if e.pid])


@contextlib.contextmanager
def arms_of(wheres: Sequence[Placement], shape: dict[str, int], pins: list[Pinning]
            ) -> Iterator[list[Arm]]:
    """A transferd arm on each of ``wheres`` and the floor, a role per rank each."""
    with contextlib.ExitStack() as stack, \
            roles([(MODULE, "floor-rank", {"shape": shape, "rank": i}, p)
                   for i, p in enumerate(pins)]) as fl:
        arms = [stack.enter_context(_td_arm(w, shape, pins)) for w in wheres]
        all_of(fl, op="join", ports=[r.ready["port"] for r in fl])
        yield [*arms, Arm("plain sockets", fl, [r.pid for r in fl])]


def _us(times: list[list[int]], a: int, b: int) -> list[float]:
    return [(t[b] - t[a]) / 1e3 for t in times]


def run(opts: Options, placement: Placement | None = None,
        wheres: Sequence[Placement] | None = None) -> BenchResult:
    """``placement``: transferd on that one only; ``wheres``: an arm on each."""
    res = BenchResult(NAME, TITLE, SECTION)
    load0 = load_now()
    wheres = list(wheres) if wheres else [placement] if placement else placements(rails=1)
    seqs = opts.pick(SEQUENCES, QUICK_SEQUENCES)
    # Each round runs every sequence length (the order reversed every other round), so
    # that the machine's load drifting over a run weighs on every length alike.
    rounds = opts.pick(2, 1)
    repeats = {1: opts.pick(12, 4), 8: 2, 16: 1, 64: 1}
    samples: dict[tuple[str, int, int], list[list[int]]] = {}
    by_round: dict[tuple[str, int, int, int], list[list[int]]] = {}
    cpu: dict[tuple[str, int, int], float] = {}  # CPU ms per step, every process of the arm
    offset = 0
    pins = [cpu_of(opts, i) for i in range(max(RANKS))]
    for ranks in RANKS:
        with arms_of(wheres, {"ranks": ranks, "tokens": TOKENS}, pins[:ranks]) as arms:
            for arm in arms:  # warm: every link open, every page touched
                arm.sequence(4, offset)
            offset += 4
            for r in range(rounds):
                for seq in seqs if r % 2 == 0 else tuple(reversed(seqs)):
                    for k in range(repeats[seq]):
                        for arm in arms if k % 2 == 0 else list(reversed(arms)):
                            got = arm.sequence(seq, offset)
                            samples.setdefault((arm.label, ranks, seq), []).extend(got)
                            by_round.setdefault((arm.label, ranks, seq, r), []).extend(got)
                        offset += seq
                    opts.log(f"{ranks} ranks, round {r}, {seq} in a row: step p50 " + ", ".join(
                        f"{w.arm} {p50(_us(by_round[(w.arm, ranks, seq, r)], 0, 4)):,.0f} us"
                        for w in wheres))
            for arm in arms:
                for seq in seqs:
                    cpu[(arm.label, ranks, seq)] = arm.cpu_ms_per_step(seq)
                arm.check(seed=ranks, offset=offset)
            offset += 1
    _report(res, samples, by_round, rounds, seqs, cpu)
    res.notes.append("placement: " + "; ".join(f"{w.arm} on {w.label}" for w in wheres)
                     + "; rank i (its daemon or inproc engine and its role; "
                     f"the floor's rank process) on CPU i mod {len({str(p.server) for p in pins})}"
                     f" ({describe_cpus(pins[:2], ['rank 0', 'rank 1'])})")
    res.notes.append(load_note(load0, load_now()))
    return res


def _report(res: BenchResult, samples: dict[tuple[str, int, int], list[list[int]]],
            by_round: dict[tuple[str, int, int, int], list[list[int]]], rounds: int,
            seqs: tuple[int, ...], cpu: dict[tuple[str, int, int], float]) -> None:
    t = Table(f"{TOKENS} tokens of 7 KiB per rank and step, top-4 of 4 experts per rank, "
              "skewed routing (seed 2025); us, p50 / p99 over every rank and step",
              ["ranks", "in a row", "arm", "dispatch p50", "p99", "combine p50", "p99",
               "step p50", "scatter acked p50", "CPU ms/step"])
    td_arms = sorted({k[0] for k in samples if k[0].startswith("transferd")},
                     key=lambda a: (a != "transferd", a))  # the daemons' arm first
    ratios: dict[str, float] = {}  # the first arm's (the daemons' when it ran)
    flat: dict[int, float] = {}
    by_arm: dict[str, dict[str, float]] = {a: {} for a in td_arms}
    for ranks in RANKS:
        for seq in seqs:
            for label in (*td_arms, "plain sockets"):
                xs = samples[(label, ranks, seq)]
                d, c = _us(xs, 0, 2), _us(xs, 2, 4)
                t.add(str(ranks), str(seq), label, f"{p50(d):,.0f}", f"{p99(d):,.0f}",
                      f"{p50(c):,.0f}", f"{p99(c):,.0f}", f"{p50(_us(xs, 0, 4)):,.0f}",
                      f"{p50(_us(xs, 0, 1)):,.0f}", f"{cpu[(label, ranks, seq)]:.1f}")
        fl = [x for s in seqs for x in samples[("plain sockets", ranks, s)]]
        for arm in td_arms:
            on = "" if arm == "transferd" else f" ({arm.removeprefix('transferd ')})"
            td = [x for s in seqs for x in samples[(arm, ranks, s)]]
            for name, a, b in (("dispatch", 0, 2), ("combine", 2, 4)):
                by_arm[arm][f"{name} {ranks}"] = p50(_us(td, a, b)) / p50(_us(fl, a, b))
                res.checks.append(Check(f"(3) MoE {name} p50, {ranks} ranks / plain-socket "
                                        f"floor{on}", by_arm[arm][f"{name} {ranks}"], "<=",
                                        TARGET, "x"))
            by_arm[arm][f"flat {ranks}"] = median([
                p50(_us(by_round[(arm, ranks, seqs[-1], r)], 0, 4))
                / p50(_us(by_round[(arm, ranks, seqs[0], r)], 0, 4)) for r in range(rounds)])
            res.checks.append(Check(f"(3) MoE step p50, {seqs[-1]} in a row / 1, {ranks} "
                                    f"ranks{on}", by_arm[arm][f"flat {ranks}"], "<=",
                                    TARGET_FLAT, "x"))
        ratios.update({k: v for k, v in by_arm[td_arms[0]].items() if not k.startswith("flat")})
        flat[ranks] = by_arm[td_arms[0]][f"flat {ranks}"]
    res.tables.append(t)
    r = Table(f"each transferd arm / floor, p50 over every sequence; flat: the arm's step p50 "
              f"at {seqs[-1]} in a row / at 1, per round ({rounds}), then the median",
              ["ranks", "arm", "dispatch", "combine", f"step: {seqs[-1]} in a row / 1"])
    for ranks in RANKS:
        for arm in td_arms:
            r.add(str(ranks), arm, fmt_ratio(by_arm[arm][f"dispatch {ranks}"]),
                  fmt_ratio(by_arm[arm][f"combine {ranks}"]),
                  fmt_ratio(by_arm[arm][f"flat {ranks}"]))
    res.tables.append(r)
    res.notes.append("dispatch: the step's start -> every other rank's barrier counted here; "
                     "combine: -> every answer's barrier counted; scatter acked: the rank's own "
                     "dispatch scatter acknowledged by every destination; CPU ms/step: CPU "
                     "time of every process of the arm (daemons and roles; inproc: the roles; "
                     "the floor's ranks) per step, all ranks together, over 2 CPUs. One step "
                     "per rank count checked token by token on every rank (every arm).")
    res.data = {
        "tokens": TOKENS, "ratios": ratios, "flat": flat, "ratios_by_arm": by_arm,
        "cpu_ms_per_step": {f"{k[0]} {k[1]} ranks x{k[2]}": v for k, v in cpu.items()},
        "p50_us": {f"{k[0]} {k[1]} ranks x{k[2]}": {
            "dispatch": p50(_us(v, 0, 2)), "combine": p50(_us(v, 2, 4)),
            "dispatch_p99": p99(_us(v, 0, 2)), "combine_p99": p99(_us(v, 2, 4)),
            "scatter_acked": p50(_us(v, 0, 1)), "answer_acked": p50(_us(v, 2, 3))}
            for k, v in samples.items()},
        "medians_step_us": {f"{k[0]} {k[1]} x{k[2]}": median(_us(v, 0, 4))
                            for k, v in samples.items()},
    }
