"""(d) The client transports: 4 KiB get_tensor over tcp, unix and seqpacket; connect-to-ready.

Arms, against one daemon listening on all three (servers pinned to one CPU, the
measuring client to the other), in alternating rounds:

- ``tcp``, ``unix``, ``seqpacket``: ``await c.get_tensor(t)`` of 4 KiB, the
  same client code, connected by URL (seqpacket is the message transport: the
  reply's payload is one message received whole and scattered);
- ``floor``: the asyncio+uvloop ping-pong of :mod:`benchmarks.latency` (24-byte
  request, 4096-byte reply over TCP), for the ratios.

Connect-to-ready: ``Client.connect(url)`` until HELLO (and AUTH) are done, then
``close()``, timed per connection over tcp, against a daemon that requires
nothing (``none``) and one that requires a secret (``hmac-sha256``: HELLO with a
nonce, the server's proof checked, AUTH).  Informational: the figure says what
authentication adds per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from typing import Any

from .harness import (
    BenchResult,
    Options,
    ServerProcess,
    Table,
    baseline_command,
    daemon_command,
    fmt_ratio,
    fmt_us,
    interleave,
    median,
    percentile,
    quiet_gc,
)
from .latency import SIZE, _daemon_rtts, _floor_rtts, _PingClient

NAME = "transports"
TITLE = "4 KiB get_tensor over tcp, unix and seqpacket; connect-to-ready with and without hmac"
SECTION = "Connections (issue 6)"

SECRET = "benchmark-secret-0123456789abcdef"


async def _measure_rtts(opts: Options, urls: dict[str, str],
                        floor_addr: tuple[str, int]) -> dict[str, Any]:
    from client import Client

    n = opts.pick(1000, 300)
    rounds = opts.pick(10, 4)
    warm = opts.pick(300, 100)
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(lambda: _PingClient(SIZE), *floor_addr)
    clients = {k: await Client.connect(u) for k, u in urls.items()}
    try:
        payload = bytes((i * 5 + 1) & 0xFF for i in range(SIZE))
        tensors = {}
        for k, c in clients.items():
            buf = await c.alloc_buffer(SIZE)
            tensors[k] = buf.tensor(0, SIZE)
            await c.set_tensor(tensors[k], payload)
            if bytes(await c.get_tensor(tensors[k])) != payload:
                raise AssertionError(f"{k}: the daemon returned other bytes than were set")
        arms: dict[str, Any] = {"floor": lambda k: _floor_rtts(proto, k)}
        for name, c in clients.items():
            arms[name] = lambda k, c=c, t=tensors[name]: _daemon_rtts(c, t, k)
        for fn in arms.values():
            await fn(warm)
        per_round: dict[str, list[float]] = {a: [] for a in arms}
        for r, arm in interleave(list(arms), rounds):
            with quiet_gc():
                xs = await arms[arm](n)
            per_round[arm].append(percentile(xs, 50))
            opts.log(f"round {r} {arm}: p50 {fmt_us(per_round[arm][-1])} us")
    finally:
        for c in clients.values():
            await c.close()
        assert proto.transport is not None
        proto.transport.close()
    return {"n": n, "rounds": rounds, "p50": per_round}


async def _measure_connect(opts: Options, plain: str, secured: str) -> dict[str, Any]:
    from client import Client

    n = opts.pick(200, 60)
    rounds = opts.pick(6, 3)
    arms = {"none": (plain, None), "hmac-sha256": (secured, SECRET)}
    for url, tok in arms.values():  # warm both
        for _ in range(10):
            await (await Client.connect(url, token=tok)).close()
    per_round: dict[str, list[float]] = {a: [] for a in arms}
    for _r, arm in interleave(list(arms), rounds):
        url, tok = arms[arm]
        xs = []
        for _ in range(n):
            t0 = time.perf_counter()
            c = await Client.connect(url, token=tok)
            xs.append(time.perf_counter() - t0)
            await c.close()
        per_round[arm].append(percentile(xs, 50))
    return {"n": n, "rounds": rounds, "p50": per_round}


def run(opts: Options) -> BenchResult:
    import uvloop

    res = BenchResult(NAME, TITLE, SECTION)
    where = tempfile.mkdtemp(prefix="td-bench-", dir="/tmp")
    secret_file = os.path.join(where, "secret")
    with open(secret_file, "w") as f:
        f.write(SECRET)
    os.chmod(secret_file, 0o600)  # the daemon refuses a secret others can read
    try:
        with (
            ServerProcess(daemon_command("--unix", f"{where}/u.sock",
                                         "--listen", f"seqpacket://{where}/s.sock"),
                          opts.pinning, name="rpc-server").start() as daemon,
            ServerProcess(daemon_command("--token-file", secret_file), opts.pinning,
                          name="rpc-server (secret)").start() as secured,
            ServerProcess(baseline_command("pingpong", "--size", str(SIZE)), opts.pinning,
                          name="pingpong") as floor,
        ):
            urls = {s: next(u for u in daemon.urls if u.startswith(s + "://"))
                    for s in ("tcp", "unix", "seqpacket")}
            m = uvloop.run(_measure_rtts(opts, urls, floor.host_port))
            cm = uvloop.run(_measure_connect(opts, daemon.url, secured.url))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(secret_file)
        with contextlib.suppress(OSError):
            os.rmdir(where)
    p50 = m["p50"]
    floor_p50 = p50["floor"]
    table = Table(
        f"4 KiB get_tensor, {m['rounds']} alternating rounds x {m['n']} requests per arm "
        "(median over rounds of each round's p50)",
        ["arm", "p50 us", "vs floor", "vs tcp"],
    )
    summary: dict[str, Any] = {}
    for arm, xs in p50.items():
        r_floor = median([x / f for x, f in zip(xs, floor_p50, strict=True)])
        r_tcp = median([x / t for x, t in zip(xs, p50["tcp"], strict=True)])
        summary[arm] = {"p50": median(xs), "vs_floor": r_floor, "vs_tcp": r_tcp}
        table.add(arm, fmt_us(median(xs)), fmt_ratio(r_floor), fmt_ratio(r_tcp))
    res.tables.append(table)
    cp = cm["p50"]
    ct = Table(
        f"connect-to-ready over tcp, {cm['rounds']} alternating rounds x {cm['n']} connections "
        "(median over rounds of each round's p50)",
        ["auth", "p50 us", "vs none"],
    )
    for arm, xs in cp.items():
        r = median([x / b for x, b in zip(xs, cp["none"], strict=True)])
        summary[f"connect {arm}"] = {"p50": median(xs), "vs_none": r}
        ct.add(arm, fmt_us(median(xs)), fmt_ratio(r))
    res.tables.append(ct)
    res.notes.append(
        "one daemon listens on tcp, unix and seqpacket; the same client.Client code runs over "
        "each; floor = the asyncio+uvloop ping-pong of the latency benchmark; connect-to-ready "
        "= Client.connect() until the handshake is done (TCP connect, HELLO, and for "
        "hmac-sha256 the proof check and AUTH), close not timed"
    )
    res.data = {"size": SIZE, "summary": summary, "rtt": m, "connect": cm}
    return res
