"""``transferd bench``: one-sided transfers between two daemons, timed, size by size.

Without ``--peer`` it starts two daemons on loopback (``rpc-server`` processes it stops
afterwards); with ``--peer URL`` the destination is that daemon (another node) and the
source a daemon it starts here (on the address that reaches the peer, with the cluster
secret of ``--secret-file`` or the ``TRANSFERD_ENGINE_SECRET*`` variables), or
``--source URL``.  For each size of ``--sizes`` it keeps ``--window`` transfers in flight
for ``--duration`` seconds after ``--warmup`` untimed ones, checks that the two regions
then hold the same bytes (sha256), and prints a row: transfers, bandwidth, latency
percentiles.  What it allocated and registered on either daemon is given back on every
way out (done, an error, SIGINT, SIGTERM).  ``--json`` for scripts; ``--plot FILE`` a PNG
of throughput over time (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import itertools
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import click

from transferd.exits import Exit

from .bench_run import (
    OPERATIONS,
    PERCENTILES,
    BenchError,
    Pair,
    SizeResult,
    Stopped,
    daemon,
    local_address_towards,
    run_size,
)
from .remote import TOKEN, check_url

SIZE = re.compile(r"^\s*(\d+)\s*([KMG]i?B?)?\s*$", re.I)
MAX_SIZE = 16 << 30
STEPS = 100  # progress-bar steps per size


def parse_size(text: str) -> int:
    m = SIZE.match(text)
    if not m:
        raise click.BadParameter(f"{text!r}: a size like 4096, 64KiB, 4MiB or 1GiB")
    unit = (m.group(2) or "").upper()[:1]
    n = int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[unit]
    if not 1 <= n <= MAX_SIZE:
        raise click.BadParameter(f"{text!r}: a transfer is 1 byte to 16 GiB")
    return n


def _sizes(_ctx: Any, _param: Any, text: str | None) -> list[int] | None:
    if text is None:
        return None
    sizes = [parse_size(t) for t in text.split(",") if t.strip()]
    if not sizes:
        raise click.BadParameter("give at least one size, e.g. 4K,64K,1M,64M")
    return sizes


def _size_text(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _secret(path: str | None) -> dict[str, str]:
    """The variable that gives the daemons the bench starts the cluster secret."""
    if path is not None:
        return {"TRANSFERD_ENGINE_SECRET_FILE": os.path.abspath(path)}
    for name in ("TRANSFERD_ENGINE_SECRET_FILE", "TRANSFERD_ENGINE_SECRET"):
        if os.environ.get(name):
            return {name: os.environ[name]}
    return {}


def _is_loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"


# -- signals: Stopped where the bench waits, a stop event where it runs ----------------


def _raise_stopped(signum: int, _frame: Any) -> None:
    raise Stopped(signum)


async def _main(src: str, dst: str, op_name: str, sizes: list[int], window: int,
                duration: float, warmup: int, timeout: float,
                tokens: tuple[str | None, str | None], progress: Any) -> list[SizeResult]:
    from client import Client

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():  # a second one: leave now, whatever is held
            click.echo(f"\ntransferd bench: {signal.Signals(signum).name} again: leaving "
                       f"without giving back what the bench holds on {src} and {dst}",
                       err=True)
            os._exit(128 + signum)
        stop.signum = signum  # type: ignore[attr-defined]
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    clients: list[Any] = []
    pair: Pair | None = None
    try:
        # The token is for the daemons the user named; one the bench started has none
        # (and a client holding a token refuses a daemon that does not prove it).
        for url, token in zip((src, dst), tokens, strict=True):
            clients.append(await Client.connect(url, token=token, timeout=timeout,
                                                connect_timeout=timeout))
        op = OPERATIONS[op_name]
        why = op.missing(clients[0])
        if why is not None:
            raise BenchError(f"--op {op_name}: {why}")
        pair = Pair(clients[0], clients[1])
        await pair.take(max(sizes), op.access)
        results = []
        for i, size in enumerate(sizes):
            progress(i, size, 0.0)
            results.append(await run_size(
                pair, op, size, window, duration, warmup, stop,
                functools.partial(progress, i, size), timeout))
        return results
    finally:
        problems = await pair.close() if pair is not None else []
        for c in clients:
            with contextlib.suppress(Exception):
                await c.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
            signal.signal(sig, _raise_stopped)
        for p in problems:
            click.echo(f"transferd bench: could not give back a buffer or region: {p}",
                       err=True)


def _plot(path: str, results: list[dict[str, Any]], op: str, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for r in results:
        xs, ys = [], []
        for (t0, b0), (t1, b1) in itertools.pairwise(r["series"]):
            if t1 > t0:
                xs.append(t1)
                ys.append((b1 - b0) / (t1 - t0) / (1 << 30))
        ax.plot(xs, ys, label=_size_text(r["size"]))
    ax.set_xlabel("seconds")
    ax.set_ylabel("GiB/s")
    ax.set_title(f"transferd bench: {op}, window {window}")
    ax.legend()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def _table(out: dict[str, Any]) -> list[str]:
    lines = [f"transferd bench: {out['op']}, window {out['window']}, "
             f"{out['duration_s']:g} s per size",
             f"source       {out['source']}", f"destination  {out['destination']}", ""]
    cols = ["size", "transfers", "GiB/s", "Gbit/s"] + \
        [f"{n[0]}{n[1:3]}{'.' + n[3:] if len(n) > 3 else ''} ms" for n, _ in PERCENTILES] + \
        ["max ms", "bytes"]
    rows = []
    for r in out["results"]:
        rows.append([_size_text(r["size"]), f"{r['transfers']:,}", f"{r['gib_per_s']:.2f}",
                     f"{r['gbps']:.1f}"] + [f"{r[n + '_ms']:.2f}" for n, _ in PERCENTILES]
                    + [f"{r['max_ms']:.2f}", "match" if r["verified"] else "DIFFER"])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines.append("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in rows:
        lines.append("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
    return lines


@click.command(short_help="Time one-sided transfers between two daemons, size by size.")
@click.option("--peer", default=None, metavar="URL", callback=check_url,
              help="Destination daemon (another node); default: one started here.")
@click.option("--source", default=None, metavar="URL", callback=check_url,
              help="Source daemon; default: one started here (next to the peer's route).")
@click.option("--op", "op_name", type=click.Choice(sorted(OPERATIONS)), default="write",
              show_default=True, help="write: one-sided writes; read: one-sided reads "
              "(where the build and the daemons have them).")
@click.option("--size", default=None, metavar="SIZE",
              callback=lambda _c, _p, v: None if v is None else parse_size(v),
              help="Bytes per transfer (4096, 64KiB, 4MiB, 1GiB) [4MiB].")
@click.option("--sizes", default=None, metavar="LIST", callback=_sizes,
              help="A sweep, one row each: e.g. 4K,64K,1M,64M (instead of --size).")
@click.option("--window", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="Transfers in flight at once.")
@click.option("--duration", type=click.FloatRange(0.2, 3600), default=5.0, show_default=True,
              help="Seconds to time, per size.")
@click.option("--warmup", type=click.IntRange(0, 100_000), default=8, show_default=True,
              help="Untimed transfers before each size's timing.")
@click.option("--timeout", type=click.FloatRange(0.1, 3600), default=30.0, show_default=True,
              help="Seconds one transfer (or a request) may take before the bench fails.")
@click.option("--secret-file", default=None, type=click.Path(dir_okay=False, exists=True),
              help="The cluster secret for the daemons the bench starts (else "
                   "TRANSFERD_ENGINE_SECRET_FILE or TRANSFERD_ENGINE_SECRET): needed with a "
                   "--peer that has one.")
@TOKEN
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Write a PNG of throughput over time (needs matplotlib: transferd[plot]).")
@click.option("--json", "as_json", is_flag=True, help="The results as one JSON object.")
def bench(peer: str | None, source: str | None, op_name: str, size: int | None,
          sizes: list[int] | None, window: int, duration: float, warmup: int, timeout: float,
          secret_file: str | None, token: str | None, plot_path: str | None,
          as_json: bool) -> None:
    """Keep WINDOW transfers of each size in flight from the source daemon to the
    destination daemon for DURATION seconds; check what landed; print bandwidth and
    latency percentiles (p50, p90, p99, p99.9, max) per size.

    A daemon's token comes from --token-file or TRANSFERD_TOKEN.  Exit 0 when every
    size's bytes matched, 1 when some differ or the bench failed, 2 for a usage error,
    5 when --plot is asked for and matplotlib is missing, 128 + N after signal N (what
    the bench held on the daemons given back first).
    """
    if size is not None and sizes is not None:
        raise click.UsageError("give --size or --sizes, not both")
    todo = sizes or [size or 4 << 20]
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            click.echo("transferd bench: --plot needs matplotlib, which is not installed: "
                       "pip install 'transferd[plot]' (or pip install matplotlib)", err=True)
            sys.exit(Exit.INSTALL)
    secret = _secret(secret_file)
    # The daemon the bench starts puts its rail where the other daemon reaches it.
    other = peer if not source else source if not peer else None
    try:
        host = local_address_towards(other) if other else "127.0.0.1"
    except BenchError as exc:
        click.echo(f"transferd bench: {exc}", err=True)
        sys.exit(Exit.FAILURE)
    if not _is_loopback(host) and not secret:
        raise click.UsageError(
            f"{other} is on another host: the daemon the bench starts on {host} needs the "
            "cluster secret it has (--secret-file FILE, or TRANSFERD_ENGINE_SECRET_FILE)")
    mem = max(64, (max(todo) >> 20) + 16)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_stopped)
    with click.progressbar(length=len(todo) * STEPS, label="bench", file=sys.stderr,
                           show_eta=False) as bar:

        def progress(i: int, n: int, frac: float) -> None:
            bar.label = f"bench {op_name} {_size_text(n)}"
            bar.update(max(0, i * STEPS + round(frac * STEPS) - bar.pos))

        try:
            with contextlib.ExitStack() as stack:
                src = source or stack.enter_context(daemon(host, mem, secret))
                dst = peer or stack.enter_context(daemon(host, mem, secret))
                tokens = (token if source else None, token if peer else None)
                results = asyncio.run(_main(src, dst, op_name, todo, window, duration,
                                            warmup, timeout, tokens, progress))
        except Stopped as exc:
            click.echo(f"\ntransferd bench: stopped by {exc}", err=True)
            sys.exit(128 + exc.signum)
        except (BenchError, OSError, TimeoutError) as exc:
            click.echo(f"\ntransferd bench: {exc or type(exc).__name__}", err=True)
            sys.exit(Exit.FAILURE)
        except Exception as exc:
            from transferd.protocol.errors import TransferdError

            if not isinstance(exc, TransferdError):
                raise
            click.echo(f"\ntransferd bench: {exc}", err=True)
            sys.exit(Exit.FAILURE)
    out: dict[str, Any] = {"op": op_name, "source": src, "destination": dst, "window": window,
           "duration_s": duration, "warmup": warmup,
           "results": [r.to_dict() for r in results]}
    if plot_path is not None:
        _plot(plot_path, out["results"], op_name, window)
    if as_json:
        click.echo(json.dumps(out))
    else:
        for line in _table(out):
            click.echo(line)
        if plot_path:
            click.echo(f"plot         {Path(plot_path)}")
    ok = all(r["verified"] for r in out["results"])
    sys.exit(Exit.OK if ok else Exit.FAILURE)
