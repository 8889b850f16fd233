"""(b) The seed's table for this daemon: commands, bytes and time per step.

A *step* is what one decode step of the seed's backend-sampling case does to
the RPC server: the client queues ``N`` ``set_tensor_async`` of a small row
(4 bytes, like each dist sampler's uniform input; and a 4 KiB variant) and
``N`` ``get_tensor_async`` of rows, then calls ``flush()``.  The rows read are
the rows just written, so every step is checked to come back byte-identical
(outside the timed region).

Arms, each against a real ``rpc-server`` pinned like every other arm:

- ``batched``: protocol 1.2 server, default client (one SET_TENSORS and one
  GET_TENSORS per step);
- ``unbatched (env)``: same server, client connected with
  ``TRANSFERD_NO_BATCHED_GET=1`` and ``TRANSFERD_NO_BATCHED_SET=1``;
- ``minor-1 server``: ``rpc-server --protocol-minor 1``, default client (it
  falls back to one GET_TENSOR / SET_TENSOR per tensor).

Commands and bytes per step come from the server's STATS command (deltas
around a block of steps, less the STATS exchange itself), cross-checked with
``client.stats()``.  Each round times a block of steps of every (arm, row
size, batch size) in alternating order; step time is the median over rounds
of each block's median, and every ratio is taken within a round, then the
median over rounds.  Targets: one read and one write per step at every
batch size (batched arm); batch-32 step time within 1.3x of batch 1.
"""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import contextmanager
from typing import Any

from .harness import (
    BenchResult,
    Check,
    Options,
    Table,
    fmt_ratio,
    fmt_us,
    interleave,
    median,
    quiet_gc,
    start_daemon,
)

NAME = "batching"
TITLE = "the seed's table: commands, bytes and step time per step, batched vs unbatched"
SECTION = "Protocol (issue 2)"

BATCHES = (1, 8, 32, 128)
ROWS = (4, 4096)
ARMS = ("batched", "unbatched (env)", "minor-1 server")
UNBATCH_ENV = {"TRANSFERD_NO_BATCHED_GET": "1", "TRANSFERD_NO_BATCHED_SET": "1"}
TARGET_RATIO = 1.3
# Issue 18 (a flat batched step): (row bytes, N) -> the most N's step time may be of N=1's.
TARGETS = {(4, 32): TARGET_RATIO, (4096, 32): 1.6, (4, 128): 2.0}
READS = ("GET_TENSOR", "GET_TENSORS")
WRITES = ("SET_TENSOR", "SET_TENSORS")


@contextmanager
def _env(extra: dict[str, str]) -> Any:
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Config:
    """One (arm, row size, batch size): its client, tensors and data."""

    def __init__(self, arm: str, client: Any, buf: Any, row: int, n: int) -> None:
        self.arm, self.client, self.row, self.n = arm, client, row, n
        self.tensors = [buf.tensor(i * row, row) for i in range(n)]
        seed = (ARMS.index(arm) * 31 + n * 7 + row) & 0xFF
        self.data = [bytes(((seed + i + j) & 0xFF) for j in range(row)) for i in range(n)]
        self.times: list[list[float]] = []  # per round

    async def step(self) -> list[asyncio.Future[Any]]:
        c = self.client
        for t, d in zip(self.tensors, self.data, strict=True):
            c.set_tensor_async(t, d)
        futs = [c.get_tensor_async(t) for t in self.tensors]
        await c.flush()
        return futs

    async def timed_steps(self, k: int) -> list[float]:
        clock = time.perf_counter
        out = []
        step = self.step
        for _ in range(k):
            t0 = clock()
            await step()
            out.append(clock() - t0)
        return out

    async def verify(self) -> None:
        futs = await self.step()
        got = [bytes(f.result()) for f in futs]
        if got != self.data:
            raise AssertionError(f"{self.arm} N={self.n} row={self.row}: reads differ from writes")

    async def count(self, k: int) -> dict[str, Any]:
        """Commands and bytes per step, from server STATS deltas and client stats."""
        c = self.client
        before_in = c.stats()["bytes_in"]
        s0 = await c.server_stats()
        stats_reply = c.stats()["bytes_in"] - before_in
        c0 = c.stats()
        for _ in range(k):
            await self.step()
        c1 = c.stats()
        out0 = c1["bytes_out"]
        s1 = await c.server_stats()
        stats_request = c.stats()["bytes_out"] - out0
        cmds = {
            name: (s1["commands"].get(name, 0) - s0["commands"].get(name, 0)) / k
            for name in s1["commands"]
        }
        cmds["STATS"] -= 1 / k  # s1's own
        cmds = {name: v for name, v in cmds.items() if v}
        server_bytes = (
            s1["bytes_in"]
            + s1["bytes_out"]
            - s0["bytes_in"]
            - s0["bytes_out"]
            - stats_reply
            - stats_request
        ) / k
        client_cmds = {
            name: (c1["commands"].get(name, 0) - c0["commands"].get(name, 0)) / k
            for name in c1["commands"]
        }
        client_bytes = (c1["bytes_in"] + c1["bytes_out"] - c0["bytes_in"] - c0["bytes_out"]) / k
        return {
            "commands": cmds,
            "bytes": server_bytes,
            "client_commands": {k_: v for k_, v in client_cmds.items() if v},
            "client_bytes": client_bytes,
            "reads": sum(cmds.get(n, 0) for n in READS),
            "writes": sum(cmds.get(n, 0) for n in WRITES),
            "total": sum(cmds.values()),
        }


async def _measure(opts: Options, url2: str, url1: str) -> dict[str, Any]:
    from client import Client

    rounds = opts.pick(8, 3)
    steps = opts.pick(25, 8)
    count_steps = opts.pick(20, 5)
    clients = {
        "batched": await Client.connect(url2),
        "minor-1 server": await Client.connect(url1),
    }
    with _env(UNBATCH_ENV):
        clients["unbatched (env)"] = await Client.connect(url2)
    try:
        if clients["minor-1 server"].minor != 1:
            raise AssertionError("the --protocol-minor 1 server did not report minor 1")
        if clients["unbatched (env)"].switches.batched_get:
            raise AssertionError("TRANSFERD_NO_BATCHED_GET was not read at connect")
        bufs = {a: await c.alloc_buffer(max(BATCHES) * max(ROWS)) for a, c in clients.items()}
        configs = {
            (a, row, n): _Config(a, clients[a], bufs[a], row, n)
            for row in ROWS
            for n in BATCHES
            for a in ARMS
        }
        counts: dict[tuple[str, int, int], dict[str, Any]] = {}
        for key, cfg in configs.items():
            await cfg.verify()
            counts[key] = await cfg.count(count_steps)
        opts.log("counted; timing")
        # Every round visits every (arm, row size, batch size), in alternating
        # order, so the ratios between any two of them (N=32 against N=1,
        # batched against unbatched) are taken within the same stretch of time.
        for r, key in interleave(list(configs), rounds):
            cfg = configs[key]
            with quiet_gc():
                cfg.times.append(await cfg.timed_steps(steps))
            opts.log(f"round {r} {key}: {fmt_us(median(cfg.times[-1]))} us")
        for cfg in configs.values():
            await cfg.verify()
    finally:
        for c in clients.values():
            await c.close()
    return {
        "rounds": rounds,
        "steps": steps,
        "count_steps": count_steps,
        "configs": configs,
        "counts": counts,
    }


def _kib(n: float) -> str:
    return f"{n:,.0f} B" if n < 10 * 1024 else f"{n / 1024:,.1f} KiB"


def run(opts: Options) -> BenchResult:
    import uvloop

    res = BenchResult(NAME, TITLE, SECTION)
    with (
        start_daemon(opts.pinning, name="rpc-server") as d2,
        start_daemon(opts.pinning, "--protocol-minor", "1", name="rpc-server minor 1") as d1,
    ):
        m = uvloop.run(_measure(opts, d2.url, d1.url))
    configs: dict[tuple[str, int, int], _Config] = m["configs"]
    counts = m["counts"]
    # Per-round medians, then medians over rounds; ratios taken within a round.
    med = {k: [median(ts) for ts in cfg.times] for k, cfg in configs.items()}
    step = {k: median(v) for k, v in med.items()}
    data_rows = []
    for row in ROWS:
        t = Table(
            f"{row}-byte rows: per step = N set_tensor_async + N get_tensor_async + flush() "
            f"({m['rounds']} alternating rounds x {m['steps']} steps; counts over "
            f"{m['count_steps']} steps)",
            [
                "arm",
                "N",
                *READS,
                *WRITES,
                "cmds/step",
                "bytes/step",
                "step p50 us",
                "vs N=1",
                "vs batched",
            ],
        )
        for arm in ARMS:
            for n in BATCHES:
                k = (arm, row, n)
                cnt = counts[k]
                vs1 = median([a / b for a, b in zip(med[k], med[(arm, row, 1)], strict=True)])
                vsb = median([a / b for a, b in zip(med[k], med[("batched", row, n)], strict=True)])
                t.add(
                    arm,
                    n,
                    *(f"{cnt['commands'].get(c, 0):.2f}" for c in (*READS, *WRITES)),
                    f"{cnt['total']:.2f}",
                    _kib(cnt["bytes"]),
                    fmt_us(step[k]),
                    fmt_ratio(vs1),
                    fmt_ratio(vsb),
                )
                data_rows.append(
                    {
                        "arm": arm,
                        "row_bytes": row,
                        "batch": n,
                        **cnt,
                        "step_p50_s": step[k],
                        "step_p50_per_round_s": med[k],
                        "vs_batch1": vs1,
                        "vs_batched": vsb,
                    }
                )
        res.tables.append(t)
    for row in ROWS:
        rw = [counts[("batched", row, n)] for n in BATCHES]
        worst = max((max(c["reads"], c["writes"]) for c in rw), key=lambda x: abs(x - 1))
        res.checks.append(
            Check(
                f"batched, {row}-byte rows: reads and writes per step at N=1,8,32,128",
                worst,
                "==",
                1,
            )
        )
    for row in ROWS:
        for n in (32, 128):
            limit = TARGETS.get((row, n))
            if limit is None:
                continue
            ratio = median(
                [
                    a / b
                    for a, b in zip(med[("batched", row, n)], med[("batched", row, 1)],
                                    strict=True)
                ]
            )
            res.checks.append(
                Check(f"batched, {row}-byte rows: step time N={n} / N=1", ratio, "<=", limit,
                      "x")
            )
    mismatched = [
        r
        for r in data_rows
        if r["client_commands"] != r["commands"] or abs(r["client_bytes"] - r["bytes"]) > 0.5
    ]
    res.notes.append(
        "reads = GET_TENSOR + GET_TENSORS, writes = SET_TENSOR + SET_TENSORS; bytes/step are "
        "frame bytes both ways (headers, msgpack bodies, payloads) from server STATS deltas; "
        + (
            "client.stats() agrees on every row"
            if not mismatched
            else f"client.stats() differs on {len(mismatched)} row(s)"
        )
    )
    res.data = {
        "rows": data_rows,
        "rounds": m["rounds"],
        "steps": m["steps"],
        "count_steps": m["count_steps"],
    }
    return res
