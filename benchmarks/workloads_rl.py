"""(2) RL weight update: a trainer writes W bytes in S shards to 1, 2 and 4 inference nodes.

The system of ``examples/weight_update.py``, its very code: the trainer (its role process
beside its daemon, on the first CPU) writes every shard to every node at once, each shard a
single write split over both rails, and once every write is acknowledged a barrier to the
group; each inference node (its role beside its own daemon, all on the second CPU) waits
for the barrier with ``expect_imm_count``.  Per update: the time from the first write to
the last node's barrier, GiB/s per node (W over its own barrier's time) and in all (N x W
over the last).  Every update's shards are checked on every node (CRC-32 per shard).

The floor, in the same rounds: the same bytes and messages between processes placed the
same way (:mod:`benchmarks.workloads_floor`): the trainer process opens one TCP connection
per node and rail, sends each shard in as many parts as rails (the engine's split, part i
of shard s on rail (s + i) mod rails) from one thread per connection, every part
acknowledged, then one barrier message per node once all acks are in.  Target: transferd's
aggregate >= 0.9x the floor's, for 1, 2 and 4 nodes.

NIXL, where the benchmark-only venv has it (:mod:`benchmarks.workloads_peers`), in the
same rounds: a WRITE of every shard per node, all posted at once, each node's notification
its barrier.

What the time is made of: CPU seconds per GiB moved, each side (the daemon and its role
processes; the floor's processes), from /proc over each update.
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from .engine_common import LABELS, peer_python
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
    peer_arms,
    placements,
    process_cpu_s,
    roles,
)

NAME = "workloads_rl"
TITLE = "(2) RL weight update, trainer -> 1, 2, 4 inference nodes over 2 rails: GiB/s, last barrier"
SECTION = SECTION

RECEIVERS = (1, 2, 4)
RAILS = 2
SHARDS = 64
TARGET = 0.9
MODULE = "workloads_rl"
PEERS = "workloads_peers"
DATA_TAG, BARRIER_TAG = 1, 2
GiB = 1 << 30


def _shape(shape: dict[str, int]) -> Any:
    from examples.weight_update import WeightShape

    return WeightShape(**shape)


# -- roles: transferd (examples/weight_update.py's nodes) ------------------------------------


class TdReceiver(ClientRole):
    def __init__(self, url: str, shape: dict[str, int]) -> None:
        super().__init__(url)
        self.shape = _shape(shape)

    async def setup(self) -> dict[str, Any]:
        from examples.weight_update import Receiver

        self.node = Receiver(await self.connect(), self.shape)
        await self.node.setup()
        return {"desc": self.node.desc.to_bytes().hex(), "addr": self.node.addr.to_bytes().hex()}

    async def expect(self) -> None:
        await self.node.expect()

    async def wait(self) -> dict[str, Any]:
        return {"arrived": await self.node.wait()}

    async def digests(self) -> dict[str, Any]:
        return {"crcs": await self.node.digests()}


class TdTrainer(ClientRole):
    def __init__(self, url: str, shape: dict[str, int], descs: list[str],
                 addrs: list[str], groups: list[int]) -> None:
        super().__init__(url)
        self.shape = _shape(shape)
        self.desc_hex, self.addr_hex, self.sizes = descs, addrs, groups

    async def setup(self) -> None:
        from client import MrDesc, NetAddr
        from examples.weight_update import Trainer

        self.node = Trainer(await self.connect(), self.shape)
        await self.node.setup()
        self.descs = [MrDesc.from_bytes(bytes.fromhex(d)) for d in self.desc_hex]
        addrs = [NetAddr.from_bytes(bytes.fromhex(a)) for a in self.addr_hex]
        # A group per update size: the first n nodes (links opened now, for all).
        self.groups = {n: await self.node.group(addrs[:n]) for n in self.sizes}

    async def fill(self, seed: int) -> dict[str, Any]:
        return {"crcs": await self.node.compute_weights(seed)}

    async def update(self, n: int) -> dict[str, Any]:
        t = await self.node.update(self.groups[n], self.descs[:n])
        return {"start": t.start, "written": t.written, "barrier": t.barrier}


# -- roles: the plain-socket floor -------------------------------------------------------------


def fill_shards(view: memoryview, shape: Any, seed: int) -> list[int]:
    """The trainer's weights of version ``seed`` (examples.weight_update.shard_data) into
    ``view``; each shard's CRC-32.  (The floor's and NIXL's trainers hold their memory.)"""
    from examples.weight_update import shard_data

    n, crcs = shape.shard_len, []
    for s in range(shape.shards):
        data = shard_data(seed, s, n)
        view[s * n:(s + 1) * n] = data
        crcs.append(zlib.crc32(data))
    return crcs


class FloorReceiver:
    def __init__(self, shape: dict[str, int]) -> None:
        self.shape = _shape(shape)

    def setup(self) -> dict[str, Any]:
        from .workloads_floor import FloorNode

        self.node = FloorNode(self.shape.size)
        return {"port": self.node.port}

    def expect(self) -> None:
        pass

    def wait(self) -> dict[str, Any]:
        return {"arrived": self.node.landed.wait(BARRIER_TAG, 1, timeout=120)}

    def digests(self) -> dict[str, Any]:
        n, view = self.shape.shard_len, self.node.buf.view
        return {"crcs": [zlib.crc32(view[s * n:(s + 1) * n]) for s in range(self.shape.shards)]}


class FloorTrainer:
    def __init__(self, shape: dict[str, int], ports: list[int], rails: int) -> None:
        self.shape, self.ports, self.rails = _shape(shape), ports, rails

    def setup(self) -> None:
        from .workloads_floor import FloorNode

        self.node = FloorNode(self.shape.size)
        self.links = [[self.node.link(p) for _ in range(self.rails)] for p in self.ports]

    def _parts(self) -> list[list[tuple[int, int]]]:
        """Per rail, the (offset, length) of each shard's part on it (the engine's split)."""
        from transferd.parts import split_sizes

        n = self.shape.shard_len
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.rails)]
        for s in range(self.shape.shards):
            sizes = split_sizes(n, self.rails) if n >= 1 << 20 else [n]
            pos = s * n
            for i, size in enumerate(sizes):
                out[(s + i) % self.rails].append((pos, size))
                pos += size
        return out

    def fill(self, seed: int) -> dict[str, Any]:
        return {"crcs": fill_shards(self.node.buf.view, self.shape, seed)}

    def update(self, n: int) -> dict[str, Any]:
        view = self.node.buf.view
        per_rail = self._parts()
        parts = sum(len(p) for p in per_rail) * n

        def send(link: Any, mine: list[tuple[int, int]]) -> None:
            for off, size in mine:
                link.write(DATA_TAG, off, view[off:off + size])

        start = time.monotonic_ns()
        threads = [threading.Thread(target=send, args=(self.links[i][r], per_rail[r]))
                   for i in range(n) for r in range(self.rails)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.node.acked.wait(DATA_TAG, parts, timeout=120)
        written = time.monotonic_ns()
        for i in range(n):
            self.links[i][0].barrier(BARRIER_TAG)
        self.node.acked.wait(BARRIER_TAG, n, timeout=120)
        return {"start": start, "written": written, "barrier": time.monotonic_ns()}


ROLES = {"td-receiver": TdReceiver, "td-trainer": TdTrainer,
         "floor-receiver": FloorReceiver, "floor-trainer": FloorTrainer}


# -- the benchmark ---------------------------------------------------------------------------


class Arm:
    """A trainer role and its receiver roles; ``pids``: every process of each side."""

    def __init__(self, label: str, trainer: RoleProcess, receivers: list[RoleProcess],
                 size: int, pids: tuple[list[int], list[int]]) -> None:
        self.label, self.trainer, self.receivers, self.size = label, trainer, receivers, size
        self.pids = pids

    def update(self, n: int, seed: int) -> dict[str, Any]:
        nodes = self.receivers[:n]
        want = self.trainer.cmd(op="fill", seed=seed, timeout=300)["crcs"]
        all_of(nodes, op="expect")
        cpu0 = [sum(process_cpu_s(p) for p in side) for side in self.pids]
        t = self.trainer.cmd(op="update", n=n, timeout=300)
        got = all_of(nodes, op="wait", timeout=300)
        cpu = [sum(process_cpu_s(p) for p in side) - c for side, c in zip(self.pids, cpu0,
                                                                       strict=True)]
        crcs = all_of(nodes, op="digests", timeout=300)
        bad = [i for i, g in enumerate(crcs) if g["crcs"] != want]
        if bad:
            raise AssertionError(f"{self.label}: update {seed}: nodes {bad} hold other shards")
        arrived = [g["arrived"] for g in got]
        last = (max(arrived) - t["start"]) / 1e9
        return {
            "seconds": last,
            "written_s": (t["written"] - t["start"]) / 1e9,
            "per_node": [self.size / ((a - t["start"]) / 1e9) / GiB for a in arrived],
            "total": n * self.size / last / GiB,
            "cpu_per_gib": [c / (n * self.size / GiB) for c in cpu],
        }


@contextlib.contextmanager
def _nixl_arm(shape: dict[str, int], pins: list[Pinning]) -> Iterator[Arm]:
    python = peer_python("nixl")
    with roles([(PEERS, "nixl-receiver", {"shape": shape}, p) for p in pins[1:]],
               python=python) as rx, \
            roles([(PEERS, "nixl-trainer", {"shape": shape,
                                            "metas": [r.ready["meta"] for r in rx],
                                            "addrs": [r.ready["addr"] for r in rx]}, pins[0])],
                  python=python) as (tx,):
        yield Arm(LABELS["nixl"], tx, rx, shape["size"], ([tx.pid], [r.pid for r in rx]))


PEER_ARMS = {"nixl": _nixl_arm}


@contextlib.contextmanager
def _td_arm(where: Placement, shape: dict[str, int], pins: list[Pinning],
            groups: tuple[int, ...]) -> Iterator[Arm]:
    """transferd on ``where``: a trainer role (``pins[0]``) and a receiver per ``pins[1:]``."""
    env = where.role_env
    with where.engines(pins) as engines, \
            roles([(MODULE, "td-receiver", {"url": e.url, "shape": shape}, p)
                   for e, p in zip(engines[1:], pins[1:], strict=True)], env=env) as td_rx, \
            roles([(MODULE, "td-trainer", {
                "url": engines[0].url, "shape": shape,
                "descs": [r.ready["desc"] for r in td_rx],
                "addrs": [r.ready["addr"] for r in td_rx], "groups": list(groups)},
                pins[0])], env=env) as (td_tx,):
        pid = [e.pid for e in engines]  # (None in process: the role's pid counts it)
        yield Arm(where.arm, td_tx, td_rx, shape["size"],
                  ([td_tx.pid, *[p for p in pid[:1] if p]],
                   [r.pid for r in td_rx] + [p for p in pid[1:] if p]))


@contextlib.contextmanager
def arms_of(wheres: Sequence[Placement], shape: dict[str, int], pins: list[Pinning],
            groups: tuple[int, ...] = RECEIVERS, peers: Sequence[str] = ()
            ) -> Iterator[tuple[list[Arm], dict[str, str]]]:
    """A transferd arm on each of ``wheres``, the floor, and each of ``peers`` that starts
    (the others map to the reason): a trainer (``pins[0]``) and an inference node for each
    of ``pins[1:]``; an update may go to the first n of them for every n of ``groups``."""
    size = shape["size"]
    with contextlib.ExitStack() as stack, \
            roles([(MODULE, "floor-receiver", {"shape": shape}, p) for p in pins[1:]]) as fl_rx, \
            roles([(MODULE, "floor-trainer", {"shape": shape, "rails": RAILS,
                                              "ports": [r.ready["port"] for r in fl_rx]},
                    pins[0])]) as (fl_tx,), contextlib.ExitStack() as more:
        arms = [stack.enter_context(_td_arm(w, shape, pins, groups)) for w in wheres]
        arms.append(Arm("plain sockets", fl_tx, fl_rx, size,
                        ([fl_tx.pid], [r.pid for r in fl_rx])))
        found, missing = peer_arms(more, peers, lambda kind: PEER_ARMS[kind](shape, pins))
        arms += found
        yield arms, missing


def run(opts: Options, placement: Placement | None = None) -> BenchResult:
    res = BenchResult(NAME, TITLE, SECTION)
    load0 = load_now()
    wheres = [placement] if placement else placements(rails=RAILS)
    size = opts.pick(256 << 20, 64 << 20)
    shape = {"size": size, "shards": SHARDS}
    rounds = opts.pick(3, 1)
    seeds = iter(range(1, 1 << 30))
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
    pins = [cpu_of(opts, 0)] + [cpu_of(opts, 1)] * max(RECEIVERS)
    with arms_of(wheres, shape, pins, peers=tuple(PEER_ARMS)) as (arms, missing):
        for arm in arms:  # warm: every node's links open, every page touched
            arm.update(max(RECEIVERS), next(seeds))
        for r in range(rounds):
            for n in RECEIVERS:
                order = arms if (r + n) % 2 == 0 else list(reversed(arms))
                for arm in order:
                    got = arm.update(n, next(seeds))
                    samples.setdefault((arm.label, n), []).append(got)
                    opts.log(f"round {r} {arm.label} x{n}: {got['total']:.2f} GiB/s in all, "
                             f"last barrier {got['seconds'] * 1e3:.0f} ms")
    t = Table(f"{size >> 20} MiB in {SHARDS} shards of {size // SHARDS >> 20} MiB, to every node "
              f"at once over {RAILS} rails, a barrier at the end; {rounds} rounds, the arms "
              "alternating (median; ratio per round, then the median)",
              ["nodes", "arm", "last barrier ms", "GiB/s per node", "GiB/s in all",
               "all writes acked ms", "CPU s/GiB trainer side", "receiver side", "vs floor"])
    ratios: dict[int, float] = {}
    by_arm: dict[str, dict[int, float]] = {}
    labels = [arm.label for arm in arms]
    for n in RECEIVERS:
        fl = samples[("plain sockets", n)]
        for label in labels:
            if label != "plain sockets":
                by_arm.setdefault(label, {})[n] = median(
                    [a["total"] / b["total"] for a, b in zip(samples[(label, n)], fl,
                                                             strict=True)])
        ratios[n] = by_arm[labels[0]][n]  # the daemons' arm when it ran
        for label in labels:
            xs = samples[(label, n)]
            t.add(str(n), label, f"{median([x['seconds'] for x in xs]) * 1e3:.0f}",
                  f"{median([sum(x['per_node']) / n for x in xs]):.2f}",
                  f"{median([x['total'] for x in xs]):.2f}",
                  f"{median([x['written_s'] for x in xs]) * 1e3:.0f}",
                  f"{median([x['cpu_per_gib'][0] for x in xs]):.2f}",
                  f"{median([x['cpu_per_gib'][1] for x in xs]):.2f}",
                  fmt_ratio(by_arm[label][n]) if label in by_arm else "")
        for label in labels:
            if label.startswith("transferd"):
                on = "" if label == "transferd" else f" ({label.removeprefix('transferd ')})"
                res.checks.append(Check(f"(2) RL aggregate GiB/s, {n} node(s) / plain-socket "
                                        f"floor{on}", by_arm[label][n], ">=", TARGET, "x"))
    res.tables.append(t)
    for kind, why in missing.items():
        res.notes.append(f"{LABELS[kind]}: not available: {why}")
    res.notes.append("placement: " + "; ".join(f"{w.arm} on {w.label}" for w in wheres) + "; "
                     + describe_cpus(pins[:2], ["the trainer side (its daemon or inproc "
                                                "engine, its role; the floor's trainer)",
                                                "every inference node (daemons or inproc "
                                                "engines, roles; the floor's receivers)"]))
    res.notes.append("every update's shards checked on every node (CRC-32 per shard, "
                     "trainer against node, every arm); CPU s/GiB: CPU time of each side's "
                     "processes over the update, per GiB delivered in all")
    res.notes.append(load_note(load0, load_now()))
    res.data = {"size": size, "shards": SHARDS, "rails": RAILS, "ratios": ratios,
                "ratios_by_arm": by_arm,
                "samples": {f"{k[0]} x{k[1]}": v for k, v in samples.items()}}
    return res


