"""(1) KV cache layer by layer: prefill -> decode, a watcher bump per layer.

The system of ``examples/kv_cache.py``, its very code: a prefill node (its role process
beside daemon A, on the first CPU) computes ``LAYERS`` layers, ``COMPUTE_S`` each by an
absolute schedule, and bumps a UVM watcher after each; the watcher's callback submits the
layer's ``PAGES`` pages of 16 KiB (random page indices on both sides, fresh per request) as
one paged write with the layer's immediate; the decode node (its role beside daemon B, on
the second CPU) waits with ``expect_imm_count(imm, PAGES)`` per layer.  Per layer: bump ->
usable (the decode client's completion fired), p50 and p99 over every layer of every
request; per request: its first compute -> its last layer usable (the whole request) and
the last bump -> the last layer usable (the tail).  Every request's pages are checked,
CRC-32 of each layer's pages in order on both nodes.

The floor, in the same rounds: the same pattern between two processes placed the same
way (:mod:`benchmarks.workloads_floor`): the prefill process's compute loop sends each
layer's pages as one ``sendmsg`` (header, page indices, the 64 pages from where they
lie) right at the bump; the decode process ``recvmsg_into``'s them into its pages, counts
the layer (usable) and acks.  Targets: bump -> usable p50 <= 1.5x the floor's; the whole
request <= 1.2x; no layer's write submitted after the next layer's bump.

Beside them, "transferd (daemons, armed)": the same daemons, the prefill arming each
layer's write on the watcher before the request (ARM_PAGED_WRITES): daemon A submits it
itself when the word reaches the layer's value, no round trip through the prefill role.

NIXL, where the benchmark-only venv has it (:mod:`benchmarks.workloads_peers`), in the
same rounds: a WRITE of the layer's pages posted at each bump with the layer's
notification, the decode counting a layer usable when it sees it.

Then, apart from the figure of record, a few requests on daemons run through
:mod:`benchmarks.engine_steps` (a timestamp at each step inside both daemons) say what a
layer's time is made of: bump -> watcher EVENT sent (A) -> callback (prefill) -> frame
read (A) -> worker -> on the peer socket (A) -> read (B) -> EVENT sent (B) -> usable.
"""

from __future__ import annotations

import contextlib
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .engine_common import LABELS, PeerUnavailable, peer_python
from .harness import (
    BenchResult,
    Check,
    Options,
    Pinning,
    Table,
    fmt_ratio,
    interleave,
    median,
)
from .workloads_common import (
    SECTION,
    ClientRole,
    Daemons,
    Engine,
    Placement,
    RoleProcess,
    cpu_of,
    describe_cpus,
    load_note,
    load_now,
    load_steps,
    p50,
    p99,
    peer_arms,
    placements,
    roles,
)

NAME = "workloads_kv"
TITLE = "(1) KV cache layer by layer, prefill -> decode: bump -> usable per layer, whole request"
SECTION = SECTION

LAYERS = 32
PAGES = 64
PAGE = 16 << 10
COMPUTE_S = 0.002
# The prefill node's engine settings (examples/kv_cache.py says why): its watcher polled
# at full pace always, so that the first layer of a request is seen as the others are.
ENGINE = {"watcher_idle_poll_ms": "0.05"}
TARGET_LAYER = 1.5
TARGET_REQUEST = 1.2
MODULE = "workloads_kv"
PEERS = "workloads_peers"


# -- roles: transferd (examples/kv_cache.py's nodes) -----------------------------------------


def _shape(shape: dict[str, int]) -> Any:
    from examples.kv_cache import KvShape

    return KvShape(**shape)


class TdDecode(ClientRole):
    def __init__(self, url: str, shape: dict[str, int]) -> None:
        super().__init__(url)
        self.shape = _shape(shape)

    async def setup(self) -> dict[str, Any]:
        from examples.kv_cache import Decode

        self.node = Decode(await self.connect(), self.shape)
        await self.node.setup()
        return {"desc": self.node.desc.to_bytes().hex()}

    async def expect(self, seed: int) -> None:
        from examples.kv_cache import plan_request

        self.plan = plan_request(self.shape, seed)
        await self.node.expect(self.plan)

    async def wait(self, check: bool) -> dict[str, Any]:
        usable = await self.node.wait()
        return {"usable": usable, "digests": await self.node.digests(self.plan) if check else None}


class TdPrefill(ClientRole):
    def __init__(self, url: str, shape: dict[str, int], desc: str, armed: bool = False) -> None:
        super().__init__(url)
        self.shape, self.desc_hex, self.armed = _shape(shape), desc, armed

    async def setup(self) -> None:
        from client import MrDesc
        from examples.kv_cache import Prefill

        self.node = Prefill(await self.connect(), self.shape, armed=self.armed)
        await self.node.setup()
        self.desc = MrDesc.from_bytes(bytes.fromhex(self.desc_hex))

    async def request(self, seed: int, compute_s: float, check: bool) -> dict[str, Any]:
        from examples.kv_cache import layer_digests, plan_request

        plan = plan_request(self.shape, seed)
        data = await self.node.compute_kv(seed) if check else None
        t = await self.node.run(plan, self.desc, compute_s)
        digests = layer_digests(data, plan.src, self.shape.page_len) if data else None
        return {**asdict(t), "digests": digests}


# -- roles: the plain-socket floor -------------------------------------------------------------


class FloorDecode:
    def __init__(self, shape: dict[str, int]) -> None:
        self.shape = _shape(shape)

    def setup(self) -> dict[str, Any]:
        from .workloads_floor import FloorNode

        self.node = FloorNode(self.shape.pool_bytes)
        return {"port": self.node.port}

    def expect(self, seed: int) -> None:
        from examples.kv_cache import plan_request

        self.plan = plan_request(self.shape, seed)

    def wait(self, check: bool) -> dict[str, Any]:
        from examples.kv_cache import layer_digests

        usable = [self.node.landed.wait(self.plan.imm_base + layer, 1)
                  for layer in range(self.shape.layers)]
        digests = (layer_digests(self.node.buf.view, self.plan.dst, self.shape.page_len)
                   if check else None)
        return {"usable": usable, "digests": digests}


class FloorPrefill:
    def __init__(self, shape: dict[str, int], port: int) -> None:
        self.shape, self.port = _shape(shape), port

    def setup(self) -> None:
        from .workloads_floor import FloorNode

        self.node = FloorNode(self.shape.pool_bytes)
        self.link = self.node.link(self.port)

    def request(self, seed: int, compute_s: float, check: bool) -> dict[str, Any]:
        from examples.kv_cache import layer_digests, plan_request

        plan = plan_request(self.shape, seed)
        view, page = self.node.buf.view, self.shape.page_len
        if check:
            view[: self.shape.pool_bytes] = random.Random(seed).randbytes(self.shape.pool_bytes)
        bump = []
        start = time.monotonic_ns()
        for layer in range(self.shape.layers):
            left = (start + round((layer + 1) * compute_s * 1e9) - time.monotonic_ns()) / 1e9
            if left > 0:
                time.sleep(left)
            bump.append(time.monotonic_ns())
            self.link.pages(plan.imm_base + layer, page, plan.dst[layer],
                            [view[i * page:(i + 1) * page] for i in plan.src[layer]])
        acked = [self.node.acked.wait(plan.imm_base + layer, 1)
                 for layer in range(self.shape.layers)]
        digests = layer_digests(view, plan.src, page) if check else None
        return {"start": start, "bump": bump, "event": bump, "issued": bump, "submitted": bump,
                "acked": acked,
                "digests": digests}


ROLES = {"td-decode": TdDecode, "td-prefill": TdPrefill,
         "floor-decode": FloorDecode, "floor-prefill": FloorPrefill}


# -- the benchmark ---------------------------------------------------------------------------


class Arm:
    """One system (transferd on a placement, or the floor): a prefill role and a decode role."""

    def __init__(self, label: str, prefill: RoleProcess, decode: RoleProcess) -> None:
        self.label, self.prefill, self.decode = label, prefill, decode

    def request(self, seed: int, compute_s: float, check: bool = True) -> dict[str, Any]:
        self.decode.cmd(op="expect", seed=seed)
        # Both commands out, then the decode's answer first: this process sleeps on the
        # decode's pipe until every layer is usable.  (Reading the prefill's first woke it
        # when the last layer was acknowledged, on the decode side's CPU, just as that
        # layer's completion was on its way to the decode client: the tail paid for it.)
        self.prefill.send(op="request", seed=seed, compute_s=compute_s, check=check)
        self.decode.send(op="wait", check=check)
        try:
            d = self.decode.recv()
        except PeerUnavailable:
            self.prefill.recv(timeout=5.0)  # its error first, when it failed first
            raise
        p = self.prefill.recv()
        if check and p["digests"] != d["digests"]:
            bad = [i for i, (x, y) in enumerate(zip(p["digests"], d["digests"], strict=True))
                   if x != y]
            raise AssertionError(f"{self.label}: request {seed}: layers {bad} differ on the "
                                 "decode node")
        layers = len(p["bump"])
        # Armed: the daemon issues each write, unseen by the roles (no "issued" stamps):
        # whether one waited for a later layer is not measured here.
        seen = any(p["issued"])
        return {
            "layer_ms": [(d["usable"][i] - p["bump"][i]) / 1e6 for i in range(layers)],
            "request_ms": (max(d["usable"]) - p["start"]) / 1e6,
            "tail_ms": (max(d["usable"]) - p["bump"][-1]) / 1e6,
            # A write handed to the engine after the next layer's bump waited for that
            # layer's compute.  (Its submit returning after it is not: in process, the
            # engine puts a layer's pages on the wire within the call.)
            "late": late_layers(p, "issued") if seen else None,
            "late_returned": late_layers(p, "submitted") if seen else None,
            "prefill": p, "usable": d["usable"],
        }


def shape_args(layers: int, pages: int, page_len: int = PAGE) -> dict[str, int]:
    return {"layers": layers, "pages": pages, "page_len": page_len}


@dataclass
class ArmedOn:
    """``base``'s engines, the prefill arming each layer's write on its watcher
    (ARM_PAGED_WRITES) instead of submitting it from the watcher's callback."""

    base: Placement
    name: str = "transferd (daemons, armed)"

    @property
    def label(self) -> str:
        return self.base.label

    @property
    def arm(self) -> str:
        return self.name

    @property
    def role_env(self) -> dict[str, str]:
        return self.base.role_env

    def engines(self, pins: Sequence[Pinning]
                ) -> contextlib.AbstractContextManager[list[Engine]]:
        return self.base.engines(pins)


def _td_roles(where: Placement, engines: list[Engine], shape: dict[str, int],
              pins: list[Pinning]) -> tuple[contextlib.ExitStack, RoleProcess, RoleProcess]:
    """The transferd nodes on ``engines`` (prefill's, decode's), entered as a stack."""
    stack = contextlib.ExitStack()
    env = where.role_env
    (decode,) = stack.enter_context(roles([(MODULE, "td-decode", {"url": engines[1].url,
                                                                  "shape": shape}, pins[1])],
                                          env=env))
    (prefill,) = stack.enter_context(roles([(MODULE, "td-prefill", {
        "url": engines[0].url, "shape": shape, "desc": decode.ready["desc"],
        "armed": isinstance(where, ArmedOn)}, pins[0])], env=env))
    return stack, prefill, decode


# Steps of a layer, in path order: (label, process, tag, the step it follows).  A daemon's
# step is the first event of its tag after the step it follows.
STEPS = [
    ("prefill: watcher callback ran", "prefill", "event", None),
    ("prefill: PAGED_WRITES frame sent", "prefill", "submitted", None),
    ("A: the frame read", "A", "read", "prefill: watcher callback ran"),
    ("A: on the worker (parsed, planned)", "A", "execute", "A: the frame read"),
    ("B: the WRITE's first bytes readable", "B", "peer_read", "A: on the worker (parsed, planned)"),
    ("A: the pages on the peer socket", "A", "sent", "A: on the worker (parsed, planned)"),
    ("B: landed, ACK sent", "B", "sent", "B: the WRITE's first bytes readable"),
    ("B: EVENT sent to decode", "B", "event", "B: the WRITE's first bytes readable"),
    ("decode: usable", "decode", "usable", None),
]


def _breakdown(reqs: list[dict[str, Any]], ev_a: list[tuple[str, int]],
               ev_b: list[tuple[str, int]]) -> dict[str, list[float]]:
    """Each step's time since the layer's bump (us), per layer of every request."""
    out: dict[str, list[float]] = {label: [] for label, *_ in STEPS}
    for r in reqs:
        p = r["prefill"]
        for layer, bump in enumerate(p["bump"]):
            row: dict[str, int] = {}
            for label, proc, tag, after in STEPS:
                if proc == "prefill":
                    row[label] = p[tag][layer]
                elif proc == "decode":
                    row[label] = r["usable"][layer]
                else:
                    since = row.get(after or "", 0)
                    evs = ev_a if proc == "A" else ev_b
                    t = next((v for k, v in evs if k == tag and v >= since), 0)
                    if since and t:
                        row[label] = t
            if len(row) == len(STEPS):
                for label, v in row.items():
                    out[label].append((v - bump) / 1e3)
    return out


# UCX sends a message over its rendezvous threshold with a handshake of its own: each of a
# layer's 64 pages, over tcp here (30-90 ms a layer measured, against 0.8 ms with it off).
# A NIXL user moving pages this size would set it so, as this arm does.
NIXL_KV_ENV = {"UCX_RNDV_THRESH": "inf"}


@contextlib.contextmanager
def _nixl_arm(shape: dict[str, int], pins: list[Pinning]) -> Iterator[Arm]:
    python = peer_python("nixl")
    with roles([(PEERS, "nixl-decode", {"shape": shape}, pins[1])], python=python,
               env=NIXL_KV_ENV) as (d,), \
            roles([(PEERS, "nixl-prefill", {"shape": shape, "meta": d.ready["meta"],
                                            "addr": d.ready["addr"]}, pins[0])],
                  python=python, env=NIXL_KV_ENV) as (p,):
        yield Arm(LABELS["nixl"], p, d)


PEER_ARMS = {"nixl": _nixl_arm}


@contextlib.contextmanager
def arms_of(wheres: Sequence[Placement], shape: dict[str, int], pins: list[Pinning],
            peers: Sequence[str] = ()) -> Iterator[tuple[list[Arm], dict[str, str]]]:
    """A transferd arm on each of ``wheres`` (named by its ``arm``), the floor, and each of
    ``peers`` that starts (the others map to the reason), each a prefill and a decode role."""
    with contextlib.ExitStack() as stack:
        arms = []
        for where in wheres:
            engines = stack.enter_context(where.engines(pins))
            td, prefill, decode = _td_roles(where, engines, shape, pins)
            stack.enter_context(td)
            arms.append(Arm(where.arm, prefill, decode))
        with roles([(MODULE, "floor-decode", {"shape": shape}, pins[1])]) as (fd,), \
                roles([(MODULE, "floor-prefill", {"shape": shape, "port": fd.ready["port"]},
                        pins[0])]) as (fp,), contextlib.ExitStack() as more:
            arms.append(Arm("plain sockets", fp, fd))
            found, missing = peer_arms(more, peers, lambda kind: PEER_ARMS[kind](shape, pins))
            arms += found
            yield arms, missing


def run(opts: Options, placement: Placement | None = None,
        wheres: Sequence[Placement] | None = None) -> BenchResult:
    """``placement``: transferd on that one only; ``wheres``: an arm on each (both
    placements with other engine settings, say, for a before/after in one run)."""
    res = BenchResult(NAME, TITLE, SECTION)
    load0 = load_now()
    if not wheres and not placement:
        found = placements(rails=1, engine=ENGINE)
        wheres = [*found, ArmedOn(Daemons(rails=1, engine=ENGINE))]
    wheres = list(wheres) if wheres else [placement] if placement else []
    layers, pages = LAYERS, PAGES
    shape = shape_args(layers, pages)
    rounds, per_round = opts.pick(5, 2), opts.pick(4, 3)
    pins = [cpu_of(opts, 0), cpu_of(opts, 1)]
    seeds = iter(range(1, 1 << 30))
    samples: dict[str, list[list[dict[str, Any]]]] = {}
    with arms_of(wheres, shape, pins, peers=tuple(PEER_ARMS)) as (arms, missing):
        for arm in arms:  # warm: links open, pages touched
            arm.request(next(seeds), COMPUTE_S)
            samples[arm.label] = []
        for r, arm in interleave(arms, rounds):
            got = [arm.request(next(seeds), COMPUTE_S) for _ in range(per_round)]
            samples[arm.label].append(got)
            opts.log(f"round {r} {arm.label}: bump -> usable p50 "
                     f"{p50([x for g in got for x in g['layer_ms']]):.2f} ms")
    steps: dict[str, list[float]] = {}
    if any(isinstance(w, Daemons) for w in wheres) and not opts.quick:  # two more daemons
        steps = _steps_pass(opts, shape, pins)
    _report(res, samples, steps, rounds, per_round, layers, pages)
    for kind, why in missing.items():
        res.notes.append(f"{LABELS[kind]}: not available: {why}")
    res.notes.append("placement: " + "; ".join(f"{w.arm} on {w.label}" for w in wheres) + "; "
                     + describe_cpus(pins, ["prefill side (daemon A or the inproc engine, the "
                                            "prefill role; the floor's prefill process)",
                                            "decode side (daemon B or the inproc engine, the "
                                            "decode role; the floor's decode process)"]))
    res.notes.append(load_note(load0, load_now()))
    return res


def _steps_pass(opts: Options, shape: dict[str, int], pins: list[Pinning]
                ) -> dict[str, list[float]]:
    n = 4
    with tempfile.TemporaryDirectory(prefix="td-kv-steps-") as tmp:
        placement = Daemons(rails=1, steps_dir=Path(tmp), engine=ENGINE)
        reqs = []
        with placement.engines(pins) as engines:
            stack, prefill, decode = _td_roles(placement, engines, shape, pins)
            with stack:
                arm = Arm("transferd (steps)", prefill, decode)
                arm.request(1 << 30, COMPUTE_S, check=False)
                reqs = [arm.request((1 << 30) + k + 1, COMPUTE_S, check=False)
                        for k in range(n)]
        return _breakdown(reqs, load_steps(placement.steps_file(0)),
                          load_steps(placement.steps_file(1)))


def _since(rs: list[dict[str, Any]], key: str) -> list[float]:
    """``key``'s time since each layer's bump (us), every layer of ``rs``."""
    out = []
    for r in rs:
        p = r["prefill"]
        ts = r["usable"] if key == "usable" else p[key]
        out += [(t - b) / 1e3 for b, t in zip(p["bump"], ts, strict=True)]
    return out


def _by_layer(rs: list[dict[str, Any]], key: str) -> list[float]:
    """``key``'s time since the bump (us), the median over ``rs`` of each layer."""
    n = len(rs[0]["prefill"]["bump"]) if rs else 0
    per = [_since([r], key) for r in rs]
    return [median([p[i] for p in per]) for i in range(n)]


def late_layers(p: dict[str, Any], key: str) -> int:
    """Layers of a request (the prefill's timestamps ``p``) whose ``key`` step came after
    the next layer's bump: their write waited for a later layer's compute."""
    return sum(p[key][i] > p["bump"][i + 1] for i in range(len(p["bump"]) - 1))


def _seen_steps(rs: list[dict[str, Any]]) -> list[str]:
    """The steps the roles stamped (an armed prefill stamps no issue: its daemon issues)."""
    return [k for k in ("event", "issued", "submitted", "usable", "acked")
            if k == "usable" or all(any(r["prefill"][k]) for r in rs)]


def _after_next(r: dict[str, Any], key: str) -> int:
    return late_layers(r["prefill"], key)


def _late_cell(rs: list[dict[str, Any]]) -> str:
    if any(r["late"] is None for r in rs):
        return "- (daemon issues)"
    return str(sum(r["late"] for r in rs))


def _report(res: BenchResult, samples: dict[str, list[list[dict[str, Any]]]],
            steps: dict[str, list[float]], rounds: int, per_round: int, layers: int,
            pages: int) -> None:
    fl = samples["plain sockets"]
    td_arms = [a for a in samples if a.startswith("transferd")]
    main = td_arms[0]  # the daemons' arm when it ran: the figure of record

    def flat(arm: str) -> list[dict[str, Any]]:
        return [r for g in samples[arm] for r in g]

    def layer_ms(rs: list[dict[str, Any]]) -> list[float]:
        return [x for r in rs for x in r["layer_ms"]]

    def ratio(key: Any, arm: str = main) -> float:
        return median([key(a) / key(b) for a, b in zip(samples[arm], fl, strict=True)])

    def p50_of(rs: list[dict[str, Any]]) -> float:
        return p50(layer_ms(rs))

    def p99_of(rs: list[dict[str, Any]]) -> float:
        return p99(layer_ms(rs))

    def request_of(rs: list[dict[str, Any]]) -> float:
        return median([r["request_ms"] for r in rs])

    def tail_of(rs: list[dict[str, Any]]) -> float:
        return median([r["tail_ms"] for r in rs])

    r_p50, r_p99, r_req, r_tail = (ratio(f) for f in (p50_of, p99_of, request_of, tail_of))
    # Arms whose roles see when each write is issued (not the armed one: its daemon does).
    lates = {a: sum(r["late"] for rs in samples[a] for r in rs) for a in td_arms
             if all(r["late"] is not None for rs in samples[a] for r in rs)}
    late = lates.get(main)
    t = Table(f"{layers} layers x {pages} pages of {PAGE >> 10} KiB ({layers * pages * PAGE >> 20}"
              f" MiB a request), compute {COMPUTE_S * 1e3:g} ms a layer; {rounds} alternating "
              f"rounds x {per_round} requests per arm; ms (ratio per round, then the median)",
              ["arm", "bump->usable p50", "p99", "whole request", "tail", "late layers"])
    for label, rs_rounds in samples.items():
        rs = [r for g in rs_rounds for r in g]
        t.add(label, f"{p50(layer_ms(rs)):.3f}", f"{p99(layer_ms(rs)):.3f}",
              f"{median([r['request_ms'] for r in rs]):.1f}",
              f"{median([r['tail_ms'] for r in rs]):.3f}", _late_cell(rs))
    for arm in samples:
        if arm != "plain sockets":
            t.add(f"{arm} / floor", *(fmt_ratio(ratio(f, arm))
                                      for f in (p50_of, p99_of, request_of, tail_of)), "")
    res.tables.append(t)
    lt = Table("each arm's layer, from the roles' own timestamps: median us since the bump "
               "(callback: the watcher's callback ran in the prefill role; issued: the "
               "paged write handed to the engine; returned: its submit returned; usable: "
               "the decode's completion fired; acked: the prefill's completion), and the "
               "layers whose callback, issue or return came after the next bump",
               ["arm", "callback", "issued", "returned", "usable", "acked",
                "late: callback / issued / returned"])
    for label in td_arms:
        rs = [r for g in samples[label] for r in g]
        keys = _seen_steps(rs)
        lt.add(label, *(f"{median(_since(rs, k)):,.0f}" if k in keys else "-"
                        for k in ("event", "issued", "submitted", "usable", "acked")),
               " / ".join(str(sum(_after_next(r, k) for r in rs)) if k in keys else "-"
                          for k in ("event", "issued", "submitted"))
               + f" of {sum(len(r['prefill']['bump']) - 1 for r in rs)}")
    res.tables.append(lt)
    for arm in td_arms:
        on = "" if arm == "transferd" else f" ({arm.removeprefix('transferd ').strip('()')})"
        res.checks.append(Check(f"(1) KV bump -> usable p50 / plain-socket floor{on}",
                                ratio(p50_of, arm), "<=", TARGET_LAYER, "x"))
        res.checks.append(Check(f"(1) KV whole request / plain-socket floor{on}",
                                ratio(request_of, arm), "<=", TARGET_REQUEST, "x"))
        if arm in lates:
            res.checks.append(Check(f"(1) KV layers whose write waited for a later layer's "
                                    f"compute{on}", lates[arm], "<=", 0))
    if steps and steps[STEPS[-1][0]]:
        st = Table(f"where a layer's time goes: median us since the bump, over "
                   f"{len(steps[STEPS[-1][0]])} layers (daemons with engine_steps' timestamps; "
                   "not the figure of record)", ["step", "us since bump", "+us after step"])
        med = {label: median(steps[label]) for label, *_ in STEPS}
        number = {label: i + 1 for i, (label, *_) in enumerate(STEPS)}
        for i, (label, _, _, after) in enumerate(STEPS):
            ref = after or (STEPS[i - 1][0] if i else None)
            base = med[ref] if ref else 0.0
            st.add(f"{i + 1} {label}", f"{med[label]:,.0f}",
                   f"{med[label] - base:+,.0f} (after {number[ref] if ref else 'bump'})")
        res.tables.append(st)
    res.notes.append("every request's pages checked: CRC-32 of each layer's pages in order, "
                     "prefill against decode (every arm)")
    res.data = {
        "layers": layers, "pages": pages, "page": PAGE, "compute_s": COMPUTE_S,
        "ratios": {"p50": r_p50, "p99": r_p99, "request": r_req, "tail": r_tail},
        "ratios_by_arm": {arm: {n: ratio(f, arm) for n, f in (("p50", p50_of), ("p99", p99_of),
                                                               ("request", request_of),
                                                               ("tail", tail_of))}
                          for arm in samples if arm != "plain sockets"},
        "late": late, "late_by_arm": lates,
        "steps_by_arm": {a: {k: median(_since(flat(a), k)) for k in _seen_steps(flat(a))}
                         for a in td_arms},
        "steps_by_layer": {a: {k: _by_layer(flat(a), k) for k in _seen_steps(flat(a))}
                           for a in td_arms},
        "arms": {k: [[{x: r[x] for x in ("layer_ms", "request_ms", "tail_ms", "late",
                                         "late_returned")}
                      for r in g] for g in v] for k, v in samples.items()},
        "steps_us": {k: median(v) for k, v in steps.items() if v},
    }
