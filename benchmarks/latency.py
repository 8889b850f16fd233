"""(a) Round-trip latency of a 4 KiB get_tensor against an asyncio+uvloop floor.

Arms, all measured by one client process (pinned) against servers pinned to
another CPU, in alternating rounds:

- ``floor``: a plain asyncio ``Protocol`` client on uvloop sends 24 bytes to
  :mod:`benchmarks.baselines`' ``pingpong`` server (also asyncio on uvloop),
  which answers 4096 bytes.  The same request/reply sizes as a GET_TENSOR of
  4 KiB (24-byte header + body; 24-byte header + 4 KiB payload).
- ``daemon``: the real async :class:`client.Client` on uvloop calls
  ``await c.get_tensor(t)`` (a 4 KiB tensor) on the real ``rpc-server``.
- ``daemon out=``: the same into a preallocated buffer (no allocation per
  call); informational.
- ``bare frames``: the same GET_TENSOR frames, sent by a bare asyncio
  ``BufferedProtocol`` client to :mod:`benchmarks.baselines`' ``bare`` server
  (header, msgpack body, payload: nothing else); informational, it shows what
  the wire format itself costs in Python, apart from the daemon's layers.

Each round times ``n`` sequential round trips per arm; the figure is the
median over rounds of each arm's p50 and p99, and the ratio to the floor is
taken per round and its median reported.  Target: p50 within 1.5x the floor.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .baselines import FRAME, PING_SIZE, BareFrames
from .harness import (
    BenchResult,
    Check,
    Options,
    ServerProcess,
    Table,
    baseline_command,
    fmt_ratio,
    fmt_us,
    interleave,
    median,
    percentile,
    quiet_gc,
    start_daemon,
)
from .scale_baselines import PingClient as _PingClient

NAME = "latency"
TITLE = "round-trip latency of a 4 KiB get_tensor vs an asyncio+uvloop ping-pong floor"
SECTION = "Protocol (issue 2)"

SIZE = 4096
TARGET_P50 = 1.3  # issue 18 (was 1.5, issue 2)


class _BareClient(BareFrames):
    """GET_TENSOR frames with nothing around them: header, msgpack body, payload."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = 0
        self.want = 0
        self.out = bytearray()
        self.waiter: asyncio.Future[None] | None = None

    def buffer_updated(self, nbytes: int) -> None:
        self.n += nbytes
        if self.n >= FRAME.size + self.want and self.waiter is not None:
            self.out[:] = self.view[FRAME.size : FRAME.size + self.want]
            self.n = 0
            w, self.waiter = self.waiter, None
            w.set_result(None)

    def request(self, t: tuple[int, int, int]) -> asyncio.Future[None]:
        import msgpack

        self.seq += 1
        body = msgpack.packb({"tensor": t})
        assert self.transport is not None
        self.transport.write(FRAME.pack(b"TD", 0x06, 0, self.seq, len(body), 0, 0) + body)
        self.want = t[2]
        self.out = bytearray(t[2])
        self.waiter = asyncio.get_running_loop().create_future()
        return self.waiter


async def _bare_rtts(proto: _BareClient, n: int) -> list[float]:
    out = []
    clock = time.perf_counter
    t = (1, SIZE, SIZE)
    for _ in range(n):
        t0 = clock()
        await proto.request(t)
        out.append(clock() - t0)
    return out


async def _floor_rtts(proto: _PingClient, n: int) -> list[float]:
    loop = asyncio.get_running_loop()
    req = b"\0" * PING_SIZE
    transport = proto.transport
    assert transport is not None
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        w = loop.create_future()
        proto.waiter = w
        transport.write(req)
        await w
        out.append(clock() - t0)
    return out


async def _daemon_rtts(c: Any, t: Any, n: int, out: Any = None) -> list[float]:
    res = []
    clock = time.perf_counter
    get = c.get_tensor
    if out is None:
        for _ in range(n):
            t0 = clock()
            await get(t)
            res.append(clock() - t0)
    else:
        for _ in range(n):
            t0 = clock()
            await get(t, out=out)
            res.append(clock() - t0)
    return res


async def _measure(
    opts: Options, daemon_url: str, floor_addr: tuple[str, int], bare_addr: tuple[str, int]
) -> dict[str, Any]:
    from client import Client

    n = opts.pick(1000, 400)
    rounds = opts.pick(15, 4)
    warm = opts.pick(500, 200)
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(lambda: _PingClient(SIZE), *floor_addr)
    _, bare = await loop.create_connection(_BareClient, *bare_addr)
    c = await Client.connect(daemon_url)
    try:
        buf = await c.alloc_buffer(SIZE * 4)
        t = buf.tensor(SIZE, SIZE)
        payload = bytes((i * 7 + 3) & 0xFF for i in range(SIZE))
        await c.set_tensor(t, payload)
        got = await c.get_tensor(t)
        if bytes(got) != payload:
            raise AssertionError("daemon returned different bytes than were set")
        out = bytearray(SIZE)
        arms = {
            "floor": lambda k: _floor_rtts(proto, k),
            "daemon": lambda k: _daemon_rtts(c, t, k),
            "daemon out=": lambda k: _daemon_rtts(c, t, k, out),
            "bare frames": lambda k: _bare_rtts(bare, k),
        }
        for fn in arms.values():
            await fn(warm)
        per_round: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
        for r, arm in interleave(list(arms), rounds):
            with quiet_gc():
                xs = await arms[arm](n)
            per_round[arm].append(
                {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "mean": sum(xs) / len(xs)}
            )
            opts.log(f"round {r} {arm}: p50 {fmt_us(per_round[arm][-1]['p50'])} us")
        if bytes(out) != payload:
            raise AssertionError("get_tensor(out=) filled different bytes than were set")
    finally:
        await c.close()
        assert proto.transport is not None and bare.transport is not None
        proto.transport.close()
        bare.transport.close()
    return {"n": n, "rounds": rounds, "per_round": per_round}


def run(opts: Options) -> BenchResult:
    import uvloop

    res = BenchResult(NAME, TITLE, SECTION)
    with (
        start_daemon(opts.pinning) as daemon,
        ServerProcess(
            baseline_command("pingpong", "--size", str(SIZE)), opts.pinning, name="pingpong"
        ) as floor,
        ServerProcess(
            baseline_command("bare", "--size", str(4 * SIZE)), opts.pinning, name="bare"
        ) as bare,
    ):
        m = uvloop.run(_measure(opts, daemon.url, floor.host_port, bare.host_port))
    pr = m["per_round"]
    floor_p50 = [x["p50"] for x in pr["floor"]]
    ratios: dict[str, dict[str, float]] = {}
    table = Table(
        f"4 KiB round trip, {m['rounds']} alternating rounds x {m['n']} requests per arm "
        "(median over rounds; us)",
        ["arm", "p50 us", "p99 us", "mean us", "p50 vs floor", "p99 vs floor", "target"],
    )
    for arm, rows in pr.items():
        p50 = median([x["p50"] for x in rows])
        p99 = median([x["p99"] for x in rows])
        mean = median([x["mean"] for x in rows])
        r50 = median([x["p50"] / f for x, f in zip(rows, floor_p50, strict=True)])
        r99 = median([x["p99"] / f["p99"] for x, f in zip(rows, pr["floor"], strict=True)])
        ratios[arm] = {"p50": p50, "p99": p99, "mean": mean, "p50_ratio": r50, "p99_ratio": r99}
        target = ""
        if arm == "daemon":
            target = f"p50 <= {TARGET_P50}x: {'PASS' if r50 <= TARGET_P50 else 'MISS'}"
        table.add(
            arm, fmt_us(p50), fmt_us(p99), fmt_us(mean), fmt_ratio(r50), fmt_ratio(r99), target
        )
    res.tables.append(table)
    res.checks.append(
        Check(
            "4 KiB get_tensor p50 / floor p50", ratios["daemon"]["p50_ratio"], "<=", TARGET_P50, "x"
        )
    )
    lo, hi = min(floor_p50), max(floor_p50)
    res.notes.append(
        f"the floor's p50 ranged {fmt_us(lo)} to {fmt_us(hi)} us over the rounds"
        + (
            " (the machine changed speed during the run: read the ratios with care)"
            if hi > 1.5 * lo
            else ""
        )
    )
    res.notes.append(
        "floor = asyncio Protocol client and server on uvloop, 24-byte request, 4096-byte reply; "
        "daemon = client.Client.get_tensor over TCP loopback to rpc-server; bare frames = the "
        "same GET_TENSOR frames through a bare BufferedProtocol pair (what the wire format "
        "alone costs in Python); ratios are per round (same minute), then the median over rounds"
    )
    res.data = {"size": SIZE, "summary": ratios, "floor_p50_range_s": [lo, hi], **m}
    return res
