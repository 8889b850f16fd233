"""``transferd bench``: one-sided writes between two daemons, timed.

Without ``--peer`` it starts two daemons on loopback (``rpc-server`` processes it
stops afterwards); with ``--peer URL`` the destination is that daemon (another node)
and the source a daemon it starts here, or ``--source URL``.  It keeps ``--window``
writes of ``--size`` bytes in flight for ``--duration`` seconds, checks the bytes
that landed against the source (sha256), and prints a table: writes, bytes,
throughput, and latency percentiles.  ``--plot FILE`` writes a PNG of throughput over
time (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import click

from transferd.exits import Exit

SIZE = re.compile(r"^\s*(\d+)\s*([KMG]i?B?)?\s*$", re.I)


def parse_size(text: str) -> int:
    m = SIZE.match(text)
    if not m:
        raise click.BadParameter(f"{text!r}: a size like 4096, 64KiB, 4MiB or 1GiB")
    unit = (m.group(2) or "").upper()[:1]
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[unit]


@contextlib.contextmanager
def _daemon(host: str, mem_mib: int) -> Iterator[str]:
    """An rpc-server on ``host`` (engine on), stopped on the way out; yields its URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    env["PYTHONUNBUFFERED"] = "1"
    p = subprocess.Popen([sys.executable, "-m", "rpc_server.cli", "-H", host, "-p", "0",
                          "--metrics-port", "-1", "-m", str(mem_mib)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         stdin=subprocess.DEVNULL)
    try:
        url = None
        assert p.stdout is not None
        deadline = time.monotonic() + 30
        for line in p.stdout:
            if line.startswith("transferd: listening on tcp://") and url is None:
                url = line.split()[-1]
            if line.strip() == "transferd: ready" or time.monotonic() > deadline:
                break
        if url is None or p.poll() is not None:
            err = p.stderr.read() if p.stderr else ""
            raise click.ClickException(f"a bench daemon did not start: {err.strip()}")
        yield url
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


async def _run(src_url: str, dst_url: str, size: int, window: int, duration: float,
               token: str | None, tick: Any) -> dict[str, Any]:
    from client import Client

    a = await Client.connect(src_url, token=token)
    b = await Client.connect(dst_url, token=token)
    try:
        src, dst = await a.alloc_buffer(size), await b.alloc_buffer(size)
        data = os.urandom(size)
        await a.set_tensor(src.tensor(), data)
        (src_mr, _), (_, dst_desc) = await a.reg_mr(src), await b.reg_mr(dst)
        lat: list[float] = []
        series: list[tuple[float, int]] = []  # (seconds since start, bytes done)
        done = 0
        t0 = time.perf_counter()
        end = t0 + duration
        inflight: set[asyncio.Task[None]] = set()

        async def one() -> None:
            nonlocal done
            s = time.perf_counter()
            w = await a.submit_single_write(size, None, (src_mr, 0), (dst_desc, 0))
            await w.wait(30)
            lat.append(time.perf_counter() - s)
            done += size

        last_tick = t0
        while time.perf_counter() < end:
            while len(inflight) < window:
                t = asyncio.ensure_future(one())
                inflight.add(t)
                t.add_done_callback(inflight.discard)
            await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            for t in [t for t in list(inflight) if t.done()]:
                t.result()
            now = time.perf_counter()
            if now - last_tick >= 0.1:
                series.append((now - t0, done))
                tick(now - last_tick)
                last_tick = now
        if inflight:
            await asyncio.gather(*inflight)
        elapsed = time.perf_counter() - t0
        series.append((elapsed, done))
        got = bytes(await b.get_tensor(dst.tensor()))
        verified = hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
        lat.sort()

        def pct(q: float) -> float:
            return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0

        return {"source": src_url, "destination": dst_url, "size": size, "window": window,
                "writes": len(lat), "bytes": done, "seconds": elapsed,
                "gbps": done * 8 / elapsed / 1e9 if elapsed else 0.0,
                "gib_per_s": done / elapsed / (1 << 30) if elapsed else 0.0,
                "p50_ms": pct(0.5) * 1e3, "p99_ms": pct(0.99) * 1e3,
                "max_ms": (lat[-1] if lat else 0.0) * 1e3, "verified": verified,
                "series": series}
    finally:
        await a.close()
        await b.close()


def _plot(path: str, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["series"]
    xs, ys = [], []
    for (t0, b0), (t1, b1) in itertools.pairwise(pts):
        if t1 > t0:
            xs.append(t1)
            ys.append((b1 - b0) / (t1 - t0) / (1 << 30))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(xs, ys)
    ax.set_xlabel("seconds")
    ax.set_ylabel("GiB/s")
    ax.set_title(f"transferd bench: {result['size']} B writes, window {result['window']}")
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


@click.command(short_help="Time one-sided writes between two daemons.")
@click.option("--peer", default=None, metavar="URL",
              help="Destination daemon (another node); default: one started here.")
@click.option("--source", default=None, metavar="URL",
              help="Source daemon; default: one started here.")
@click.option("--size", default="4MiB", show_default=True, help="Bytes per write.")
@click.option("--window", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="Writes in flight at once.")
@click.option("--duration", type=click.FloatRange(0.2, 3600), default=5.0, show_default=True,
              help="Seconds to run.")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Write a PNG of throughput over time (needs matplotlib: transferd[plot]).")
@click.option("--json", "as_json", is_flag=True, help="The summary as JSON.")
def bench(peer: str | None, source: str | None, size: str, window: int, duration: float,
          plot_path: str | None, as_json: bool) -> None:
    """Keep WINDOW writes of SIZE in flight from the source daemon to the destination
    daemon for DURATION seconds; check what landed; print throughput and latency.

    A daemon's token comes from TRANSFERD_TOKEN.  Exit 1 when the bytes that landed
    differ from the source's, 5 when --plot is asked for and matplotlib is missing.
    """
    nbytes = parse_size(size)
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            click.echo("transferd bench: --plot needs matplotlib, which is not installed: "
                       "pip install 'transferd[plot]' (or pip install matplotlib)", err=True)
            sys.exit(Exit.INSTALL)
    token = os.environ.get("TRANSFERD_TOKEN") or None
    mem = max(64, (nbytes >> 20) * 2 + 16)
    with contextlib.ExitStack() as stack:
        src = source or stack.enter_context(_daemon("127.0.0.1", mem))
        dst = peer or stack.enter_context(_daemon("127.0.0.1", mem))
        steps = int(duration * 10)
        with click.progressbar(length=steps, label="bench", file=sys.stderr,
                               show_eta=True) as bar:
            def tick(dt: float) -> None:
                bar.update(max(1, round(dt * 10)))

            try:
                result = asyncio.run(_run(src, dst, nbytes, window, duration, token, tick))
            except Exception as exc:
                click.echo(f"transferd bench: {exc}", err=True)
                sys.exit(Exit.FAILURE)
    if plot_path is not None:
        _plot(plot_path, result)
    if as_json:
        click.echo(json.dumps(result))
    else:
        rows = [("source", result["source"]), ("destination", result["destination"]),
                ("write size", f"{nbytes:,} B"), ("window", str(window)),
                ("writes", f"{result['writes']:,}"), ("bytes", f"{result['bytes']:,}"),
                ("seconds", f"{result['seconds']:.2f}"),
                ("throughput", f"{result['gib_per_s']:.2f} GiB/s ({result['gbps']:.1f} Gbit/s)"),
                ("latency p50", f"{result['p50_ms']:.2f} ms"),
                ("latency p99", f"{result['p99_ms']:.2f} ms"),
                ("latency max", f"{result['max_ms']:.2f} ms"),
                ("bytes landed", "match the source" if result["verified"] else "DIFFER")]
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            click.echo(f"{k:<{width}}  {v}")
        if plot_path:
            click.echo(f"{'plot':<{width}}  {plot_path}")
    sys.exit(Exit.OK if result["verified"] else Exit.FAILURE)
