"""The TransferEngine article's three systems, end to end, at a small size, every byte checked.

Each runs the code of its example (``examples/kv_cache.py``, ``weight_update.py``,
``moe_dispatch.py``) on real daemons over tcp with two rails, and again with each node's
engine in this process (``inproc://``, the engines peers of each other over tcp), each on
tcp and on the chaos Domain (which delivers out of order on purpose): every page of every
layer, every shard on every node, every token of every step dispatched and combined back
is compared (CRC-32) with what its source holds.  Then the benchmark's own path
(``benchmarks.workloads_*``: each node a role process, on a daemon or holding its own
inproc engine, and the plain-socket floor beside it) at its smallest, every byte checked,
so that ``python -m benchmarks --only workloads`` stays runnable; and the floor's node on
its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from benchmarks import workloads_kv, workloads_moe, workloads_rl
from benchmarks.harness import Pinning
from benchmarks.workloads_common import Daemons, Inproc
from benchmarks.workloads_floor import DATA, HDR, FloorNode
from client import Client, Tensor
from examples import kv_cache, moe_dispatch, weight_update
from tests.helpers import REPO, DaemonProcess, async_test
from tests.integration.engine_cluster import engine_env, secret_file, start_many

RAILS = ("127.0.0.30", "127.0.0.31")


@contextlib.contextmanager
def daemons(n: int, domain: str = "tcp", rails: tuple[str, ...] = RAILS
            ) -> Iterator[list[DaemonProcess]]:
    ds = start_many([{"env": engine_env(rails, domain, chaos_seed=i + 1,
                                        secret_file=secret_file()), "metrics": False}
                     for i in range(n)])
    try:
        yield ds
    finally:
        for d in ds:
            d.stop()


# Where each node's engine runs: a daemon of its own (the node's client talks to it over
# tcp), or in this process (``inproc://``, an engine per node, peers of each other over tcp
# exactly as daemons are: the same rails, Domain, seed and cluster secret).
PLACEMENTS = ["daemons", "inproc"]


@contextlib.asynccontextmanager
async def placed(n: int, domain: str, where: str, rails: tuple[str, ...] = RAILS
                ) -> AsyncIterator[list[Client]]:
    """``n`` nodes' clients, each on an engine of its own placed as ``where`` says."""
    async with contextlib.AsyncExitStack() as stack:
        urls = ([d.url for d in stack.enter_context(daemons(n, domain, rails))]
                if where == "daemons" else ["inproc://"] * n)
        clients = []
        for i, url in enumerate(urls):
            kw: dict[str, Any] = {} if where == "daemons" else {"overrides": {
                "engine.host_rails": ",".join(rails), "engine.domain": domain,
                "engine.chaos_seed": i + 1, "engine.secret_file": secret_file()}}
            clients.append(c := await Client.connect(url, **kw))
            stack.push_async_callback(asyncio.wait_for, c.close(), 30)
        yield clients


async def flip(c: Client, t: Tensor) -> None:
    """Change the byte at ``t`` (one byte) to another value."""
    old = bytes(await c.get_tensor(t))
    await c.set_tensor(t, bytes([old[0] ^ 0xFF]))


# -- (1) the KV cache, layer by layer -----------------------------------------------------------


@pytest.mark.parametrize("where", PLACEMENTS)
@pytest.mark.parametrize("domain", ["tcp", "chaos"])
@async_test(timeout=90)
async def test_kv_cache_every_page_of_every_layer_lands_after_its_bump(domain: str,
                                                                       where: str) -> None:
    shape = kv_cache.KvShape(layers=6, pages=8, page_len=4096)
    async with placed(2, domain, where) as (a, b):
        prefill, decode = kv_cache.Prefill(a, shape), kv_cache.Decode(b, shape)
        await prefill.setup()
        await decode.setup()
        for seed in (1, 2, 3):  # fresh pages and bytes per request, the same counters
            r = await kv_cache.one_request(prefill, decode, seed, compute_s=0.002)
            assert r.ok, f"request {seed}: the decode node holds other pages"
            t = r.times
            for layer in range(shape.layers):
                # Sent only once computed (its bump), usable only after that.
                assert t.bump[layer] <= t.event[layer] <= t.submitted[layer]
                assert t.bump[layer] < r.usable[layer]
                assert t.acked[layer] > 0
        # The check reads what landed: one page of layer 3 changed on the decode node
        # shows as layer 3, and only it.
        plan = kv_cache.plan_request(shape, 3)
        good = await decode.digests(plan)
        await flip(b, decode.cache.tensor(plan.dst[3][5] * shape.page_len + 17, 1))
        changed = [i for i, (x, y) in enumerate(zip(good, await decode.digests(plan),
                                                    strict=True)) if x != y]
        assert changed == [3]


# -- (2) the RL weight update -------------------------------------------------------------------


@pytest.mark.parametrize("where", PLACEMENTS)
@pytest.mark.parametrize("domain", ["tcp", "chaos"])
@async_test(timeout=90)
async def test_weight_update_every_shard_on_every_node_before_its_barrier(domain: str,
                                                                          where: str) -> None:
    # 2 MiB shards: each single write is split over both rails.
    shape = weight_update.WeightShape(size=8 << 20, shards=4)
    async with placed(3, domain, where) as clients:
        trainer = weight_update.Trainer(clients[0], shape)
        await trainer.setup()
        nodes = [weight_update.Receiver(c, shape) for c in clients[1:]]
        for node in nodes:
            await node.setup()
        group = await trainer.group([node.addr for node in nodes])
        for seed in (1, 2):  # new weights each time, the same regions and counter
            r = await weight_update.one_update(trainer, group, nodes, seed)
            assert r.ok, "a node holds other shards than the trainer wrote"
            # The barrier goes out once every write is acknowledged, so no node
            # counts it before its shards are in place.
            assert all(a > r.times.written for a in r.arrived)
            assert r.times.written <= r.times.barrier and r.total_gib_s > 0
        # The check reads what landed: one byte of shard 2 changed on node 1 shows
        # as shard 2, and only it.
        want = await nodes[1].digests()
        await flip(clients[2], nodes[1].weights.tensor(2 * shape.shard_len + 9, 1))
        got = await nodes[1].digests()
        assert [i for i in range(shape.shards) if got[i] != want[i]] == [2]


# -- (3) MoE dispatch and combine ---------------------------------------------------------------


@pytest.mark.parametrize("where", PLACEMENTS)
@pytest.mark.parametrize("domain", ["tcp", "chaos"])
@async_test(timeout=120)
async def test_moe_every_token_of_every_step_dispatched_and_combined(domain: str,
                                                                     where: str) -> None:
    shape = moe_dispatch.MoeShape(ranks=4, tokens=4, topk=2)  # some ranks get nothing
    steps = 4
    plan = moe_dispatch.routing(shape, steps)
    assert any(plan[k][s][d] == 0 for k in range(steps) for s in range(4) for d in range(4)
               if s != d), "the routing should leave some rank without tokens from another"
    async with placed(4, domain, where, rails=RAILS[:1]) as clients:
        ranks = await moe_dispatch.join_ranks(clients, shape)
        for k in range(steps):  # every step checked, each with bytes of its own
            for r in ranks:
                await r.fill(seed=100 + k)
            times = await asyncio.gather(*(r.step(plan[k]) for r in ranks))
            digests = [await r.digests(plan[k]) for r in ranks]
            assert moe_dispatch.check_step(digests) == [], f"step {k}"
            for t in times:
                assert t.start < t.scattered < t.dispatched <= t.answered < t.combined
        # Steps in a row (no fill between), then one checked: still every token.
        more = moe_dispatch.routing(shape, 9, seed=77)
        await asyncio.gather(*(r.steps(more[:8]) for r in ranks))
        for r in ranks:
            await r.fill(seed=200)
        await asyncio.gather(*(r.step(more[8]) for r in ranks))
        digests = [await r.digests(more[8]) for r in ranks]
        assert moe_dispatch.check_step(digests) == []
        # The check reads what landed: a changed received token is reported.
        src = next(s for s in range(1, 4) if more[8][s][0])
        await flip(ranks[0].client, ranks[0].recv_buf.tensor(src * shape.slot + 3, 1))
        changed = moe_dispatch.check_step([await r.digests(more[8]) for r in ranks])
        assert changed == [f"rank 0 holds other tokens than rank {src} dispatched to it"]


# -- the benchmarks' own path, at their smallest ------------------------------------------------


def _unpinned(n: int) -> list[Pinning]:
    p = Pinning.detect(enabled=False)
    return [p] * n


# Each benchmark's transferd arm on either placement (inproc: each role's process holds
# its engine, a peer of the others over tcp), beside the floor.
ARM_PLACEMENTS = [pytest.param(Daemons, id="daemons"), pytest.param(Inproc, id="inproc")]


@pytest.mark.parametrize("where", ARM_PLACEMENTS)
def test_kv_benchmark_arms_move_the_same_pages(where: type[Daemons | Inproc]) -> None:
    shape = workloads_kv.shape_args(layers=4, pages=4, page_len=4096)
    # With the benchmark's prefill settings (the watcher polled at full pace).
    with workloads_kv.arms_of([where(rails=1, engine=workloads_kv.ENGINE)], shape,
                              _unpinned(2)) as (arms, _):
        for seed, arm in enumerate(arms, start=1):  # each request checks its pages
            r = arm.request(seed, compute_s=0.002)
            assert len(r["layer_ms"]) == 4 and all(x > 0 for x in r["layer_ms"])
            assert r["request_ms"] >= 4 * 2.0 and 0 < r["tail_ms"] < r["request_ms"]
            p = r["prefill"]
            for layer in range(4):  # each layer's steps in their order, in every arm
                assert (p["bump"][layer] <= p["event"][layer] <= p["issued"][layer]
                        <= p["submitted"][layer] <= p["acked"][layer])
                assert p["bump"][layer] < r["usable"][layer]


def test_kv_armed_arm_moves_the_same_pages_fired_by_the_daemon() -> None:
    # The prefill arms each layer's write (ARM_PAGED_WRITES); daemon A fires it at the
    # bump. The pages are checked per request; the watcher's callback fires no write.
    shape = workloads_kv.shape_args(layers=4, pages=4, page_len=4096)
    armed = workloads_kv.ArmedOn(Daemons(rails=1, engine=workloads_kv.ENGINE))
    with workloads_kv.arms_of([armed], shape, _unpinned(2)) as (arms, _):
        assert arms[0].label == "transferd (daemons, armed)"
        for seed in (1, 2, 3):  # the word keeps counting across requests
            r = arms[0].request(seed, compute_s=0.002)
            assert r["late"] is None  # not measured: no role saw the writes issued
            assert len(r["layer_ms"]) == 4 and all(x > 0 for x in r["layer_ms"])
            p = r["prefill"]
            assert 0 < p["armed"] <= p["start"]
            for layer in range(4):
                assert p["issued"][layer] == 0  # the daemon issued it, unseen by the role
                assert p["bump"][layer] < p["acked"][layer]
                assert p["bump"][layer] < r["usable"][layer]
                assert p["bump"][layer] <= p["event"][layer]


@pytest.mark.parametrize("where", ARM_PLACEMENTS)
def test_a_placements_engine_settings_reach_its_engines(where: type[Daemons | Inproc]
                                                        ) -> None:
    # A key no engine knows is refused by the engine's configuration, naming it: so the
    # settings of an arm (the KV prefill's watcher pace) do reach each node's engine.
    shape = workloads_kv.shape_args(layers=2, pages=2, page_len=4096)
    bad = where(rails=1, engine={"no_such_setting": "1"})
    with pytest.raises(Exception, match=r"engine\.no_such_setting: unknown key"), \
            workloads_kv.arms_of([bad], shape, _unpinned(2)):
        pass


def test_a_layer_is_late_when_its_write_is_handed_over_after_the_next_bump() -> None:
    p = {"bump": [0, 10, 20, 30], "issued": [5, 21, 25, 31], "submitted": [12, 22, 26, 40]}
    assert workloads_kv.late_layers(p, "issued") == 1  # layer 1: issued at 21 > 20
    assert workloads_kv.late_layers(p, "submitted") == 2  # layers 0 and 1 returned late


@pytest.mark.parametrize("where", ARM_PLACEMENTS)
def test_rl_benchmark_arms_move_the_same_shards(where: type[Daemons | Inproc]) -> None:
    shape = {"size": 4 << 20, "shards": 2}
    with workloads_rl.arms_of([where(rails=2)], shape, _unpinned(3),
                              groups=(1, 2)) as (arms, _):
        for arm in arms:
            for n in (1, 2):  # each update checks every node's shards
                r = arm.update(n, seed=n)
                assert len(r["per_node"]) == n and r["total"] > 0


@pytest.mark.parametrize("where", ARM_PLACEMENTS)
def test_moe_benchmark_arms_move_the_same_tokens(where: type[Daemons | Inproc]) -> None:
    shape = {"ranks": 3, "tokens": 4}
    with workloads_moe.arms_of([where(rails=1)], shape, _unpinned(3)) as arms:
        for arm in arms:
            times = arm.sequence(3, offset=0)
            assert len(times) == 3 * 3
            assert all(t[0] < t[2] <= t[3] < t[4] for t in times)
            arm.check(seed=5, offset=3)


# -- the floor's node ---------------------------------------------------------------------------


def test_floor_node_places_counts_acks_and_refuses_what_does_not_fit() -> None:
    a, b = FloorNode(1 << 16), FloorNode(1 << 16)
    try:
        link = a.link(b.port)
        data = bytes(range(256)) * 8  # [100, 2148): clear of the pages at 4 KiB and up
        link.write(7, 100, memoryview(data))
        pages = [memoryview(bytes([i]) * 1024) for i in (1, 2, 3)]
        link.pages(8, 1024, [9, 4, 6], pages)
        link.barrier(9)
        assert b.landed.wait(9, 1, timeout=5) > 0
        assert a.acked.wait(7, 1, timeout=5) <= a.acked.wait(9, 1, timeout=5)
        assert bytes(b.buf.view[100:100 + len(data)]) == data
        for idx, fill in ((9, 1), (4, 2), (6, 3)):
            assert bytes(b.buf.view[idx * 1024:(idx + 1) * 1024]) == bytes([fill]) * 1024
        b.landed.wait(7, 1, timeout=1)
        b.landed.wait(8, 1, timeout=1)
        with pytest.raises(TimeoutError):
            b.landed.wait(7, 1, timeout=0.05)  # consumed
        # One byte past the end: refused, nothing placed, the connection closed.
        raw = socket.create_connection(("127.0.0.1", b.port))
        raw.sendall(HDR.pack(DATA, 11, (1 << 16) - 10, 11) + b"x" * 11)
        raw.settimeout(5)
        try:
            got = raw.recv(64)  # no ACK: the end of the stream
        except ConnectionResetError:  # (a reset: the payload was left unread)
            got = b""
        assert got == b""
        raw.close()
        deadline = time.monotonic() + 5
        while not b.refused and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.refused and "outside" in b.refused[0]
        with pytest.raises(TimeoutError):
            b.landed.wait(11, 1, timeout=0.05)
        assert struct.calcsize("<BxxxIQQ") == HDR.size == 24
    finally:
        a.close()
        b.close()


# -- the examples as a user runs them -----------------------------------------------------------


@pytest.mark.parametrize(("script", "args", "says"), [
    ("kv_cache.py", ["--layers", "3", "--pages", "4", "--page-kib", "4", "--requests", "2",
                     "--rails", "2"], "pages all match"),
    ("weight_update.py", ["--mib", "4", "--shards", "4", "--receivers", "2", "--updates", "1"],
     "shards all match"),
    ("moe_dispatch.py", ["--ranks", "3", "--tokens", "4", "--steps", "3"],
     "every token in place on every rank"),
])
def test_example_runs_from_the_checkout(script: str, args: list[str], says: str) -> None:
    r = subprocess.run([sys.executable, f"examples/{script}", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=90,
                       env={k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")})
    assert r.returncode == 0, r.stdout + r.stderr
    assert says in r.stdout and "MISMATCH" not in r.stdout
