"""Commands that ask a running daemon: ``ping``, ``stats``, ``buffers``.

Each connects with the client library (any URL the client takes, a token when the
daemon wants one), asks over the protocol, and prints for a person or, with
``--json``, for a script.  A daemon that cannot be reached, or refuses, is exit 1
with the reason on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import click

from transferd.exits import Exit
from transferd.logs import escaped_char

T = TypeVar("T")


def shown(text: str) -> str:
    """``text`` for a terminal: each hostile character (:data:`transferd.logs.HOSTILE`)
    but a newline written as Python writes it in a repr (``\\x1b``, ``\\u202e``). What
    a listing prints comes from a daemon's answer, and through it from clients and from
    whoever can write to etcd (a node's name is any bytes of its key): printed as it
    came, ESC [2J cleared the operator's screen, ESC [1A ESC [2K hid the line above."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if not line.isprintable():  # the fast path: printable holds none of them
            lines[i] = "".join(escaped_char(ch) for ch in line)
    return "\n".join(lines)


def say(text: str, err: bool = False) -> None:
    """``click.echo`` of :func:`shown` text: how a command prints what a daemon said."""
    click.echo(shown(text), err=err)

def check_url(_ctx: Any, _param: Any, url: str | None) -> str | None:
    """A daemon's URL, checked as the client will read it: a malformed one is a usage
    error (exit 2), not a failure to reach a daemon."""
    if url is None:
        return None
    from transferd import transports
    from transferd.protocol.errors import TransferdError

    try:
        transports.parse(url)
    except TransferdError as exc:
        raise click.BadParameter(exc.message) from None
    return url


URL = click.argument("url", default="tcp://127.0.0.1:18515", required=False,
                     callback=check_url)
TOKEN = click.option("--token-file", "token", default=None, type=click.Path(dir_okay=False),
                     callback=lambda _ctx, _p, v: _read_token(v),
                     help="File holding the daemon's token (else TRANSFERD_TOKEN, if set); "
                          "never on the command line, where ps shows it.")


def _read_token(path: str | None) -> str | None:
    if path is None:
        return os.environ.get("TRANSFERD_TOKEN") or None
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        raise click.BadParameter(f"{path}: {exc.strerror}", param_hint="--token-file") from None
TIMEOUT = click.option("--timeout", type=float, default=5.0, show_default=True,
                       help="Seconds to wait for the daemon.")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


async def ask(c: Any, cmd: int, body: dict[str, Any] | None = None) -> Any:
    """One request of a command, its reply frame: within ``--timeout`` (the client's),
    as every call of the client library is. (A bare ``conn.request`` has no timer: a
    server that answered HELLO and then stalled held ``inflight`` and ``buffers`` for
    as long as it kept its socket open.)"""
    return await c.conn.request(cmd, body, timeout=c.timeout)


def _with_client(url: str, token: str | None, timeout: float,
                 work: Callable[[Any], Awaitable[T]]) -> T:
    """Connect, run ``work(client)``, close; exit 1 naming the reason when it fails."""
    from client import Client
    from transferd.protocol.errors import TransferdError

    greeted = False  # HELLO answered: a later timeout is not the handshake's

    async def go() -> T:
        nonlocal greeted
        c = await asyncio.wait_for(
            Client.connect(url, token=token, timeout=timeout, connect_timeout=timeout), timeout)
        greeted = True
        failed = True
        try:
            out = await work(c)
            failed = False
            return out
        finally:
            # Every command here asks and waits for its answers, so once ``work`` is
            # over nothing sent needs the server any more: close() waits for it to close
            # its side no longer than --timeout, and not at all after a failure (a
            # server that stopped answering and kept its socket open held the command
            # 5 s, close()'s own linger, past its timeout).
            await c.close(linger=0.0 if failed else timeout)

    try:
        with unreadable(url):  # what ``work`` makes of the answers
            return asyncio.run(go())
    except (OSError, TimeoutError, TransferdError) as exc:
        say(f"transferd: {url}: {explain(url, exc, token, timeout, greeted)}", err=True)
        sys.exit(Exit.FAILURE)


# What reading a reply that is not what this version of the daemon sends raises (a
# field missing, of another type, a number that is text).
UNREADABLE = (KeyError, IndexError, TypeError, ValueError, AttributeError)


@contextlib.contextmanager
def unreadable(url: str) -> Iterator[None]:
    """An answer a command cannot read (from a daemon of another version, or anything
    that speaks the wire format and lies): one line naming it, exit 1, no traceback."""
    try:
        yield
    except UNREADABLE as exc:
        say(f"transferd: {url}: an answer this command cannot read "
            f"({type(exc).__name__}: {str(exc)[:200]}): is it a transferd daemon "
            "of this version?", err=True)
        sys.exit(Exit.FAILURE)


def explain(url: str, exc: BaseException, token: str | None, timeout: float,
            greeted: bool = False) -> str:
    """What went wrong reaching ``url``, in words: what answers there instead of a
    transferd RPC port, and where the token comes from when it was refused.
    ``greeted``: the server had answered HELLO (so it speaks the protocol)."""
    from transferd import transports
    from transferd.protocol.constants import ErrorCode
    from transferd.protocol.errors import TransferdError

    ep = transports.parse(url)
    where = f"{ep.host}:{ep.port}" if not ep.path else ep.path
    rpc = "the daemon prints its RPC URL at start: 'transferd: listening on ...'"
    code = exc.code if isinstance(exc, TransferdError) else None
    if greeted and (isinstance(exc, TimeoutError) or code is ErrorCode.TIMEOUT):
        # Not "no HELLO reply" (what a port that is no RPC port gets): it answered one.
        what = (exc.message if isinstance(exc, TransferdError)
                else f"no answer within {timeout:g} s")
        return (f"{what}: it answered HELLO, then stopped answering (a daemon stopped or "
                "overloaded, or not a transferd one)")
    if code is ErrorCode.NO_HELLO:
        # An RPC server answers HELLO; a peer port speaks the same frames, not HELLO.
        return (f"{where} is a transferd peer port (the engine's rails, daemon to daemon), "
                f"not an RPC port: {rpc}")
    if code is ErrorCode.UNAUTHORIZED:
        return f"{exc} ({_token_hint(token)})"
    if isinstance(exc, TimeoutError) or code is ErrorCode.BAD_FRAME:
        other = _what_answers(ep, timeout) if not ep.path else None
        if other is not None:
            return f"{other} on {where}, not a transferd RPC port: {rpc}"
        if isinstance(exc, TimeoutError):
            return (f"no HELLO reply within {timeout:g} s: {where} accepts connections but "
                    f"does not answer as transferd ({rpc})" if _connects(ep, timeout) else
                    f"cannot connect to {where} within {timeout:g} s (no host there, a "
                    "firewall that drops it, or a listener that accepts nothing)")
    return str(exc) or type(exc).__name__


def _token_hint(token: str | None) -> str:
    if token is not None:
        return "the token given (--token-file, or TRANSFERD_TOKEN) is not the daemon's"
    hint = "the daemon requires a token: --token-file FILE, or TRANSFERD_TOKEN"
    if os.environ.get("TRANSFERD_SERVER_TOKEN") or os.environ.get("TRANSFERD_SERVER_TOKEN_FILE"):
        hint += ("; TRANSFERD_SERVER_TOKEN(_FILE) is set, but that is the daemon's own "
                 "setting: the commands read TRANSFERD_TOKEN")
    return hint


def _connects(ep: Any, timeout: float) -> bool:
    import socket

    with contextlib.suppress(OSError), socket.create_connection((ep.host, ep.port),
                                                                timeout=timeout):
        return True
    return False


def _what_answers(ep: Any, timeout: float) -> str | None:
    """"an HTTP server answers" (the metrics endpoint, often) when one does, else None."""
    import socket

    try:
        with socket.create_connection((ep.host, ep.port), timeout=min(timeout, 2.0)) as s:
            s.settimeout(min(timeout, 2.0))
            s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            head = s.recv(4096)
    except OSError:
        return None
    if not head.startswith(b"HTTP/"):
        return None
    if b"transferd_" in head or b"text/plain; version=0.0.4" in head:
        return "transferd's metrics endpoint (HTTP) answers"
    return "an HTTP server answers"


# -- ping -------------------------------------------------------------------------------


@click.command(short_help="HELLO a daemon and time round trips.")
@URL
@TOKEN
@TIMEOUT
@click.option("-n", "--count", type=click.IntRange(1, 100_000), default=10, show_default=True,
              help="Round trips to time (SYNCHRONIZE: the cheapest command with a reply).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
def ping(url: str, token: str | None, timeout: float, count: int, as_json: bool) -> None:
    """Connect to URL (tcp://, unix://, ...), print what HELLO says, time COUNT round trips."""

    async def work(c: Any) -> dict[str, Any]:
        rtts = []
        for _ in range(count):
            t0 = time.perf_counter()
            await asyncio.wait_for(c.synchronize(), timeout)
            rtts.append(time.perf_counter() - t0)
        return {"rtts": rtts, "version": ".".join(map(str, c.version)),
                "server": c.server, "features": c.features, "max_body": c.max_body}

    t0 = time.perf_counter()
    out = _with_client(url, token, timeout, work)
    out["url"] = url
    out["connect_s"] = time.perf_counter() - t0 - sum(out["rtts"])
    rtts = sorted(out["rtts"])
    out["min_s"], out["max_s"] = rtts[0], rtts[-1]
    out["avg_s"] = sum(rtts) / len(rtts)
    out["p50_s"] = rtts[len(rtts) // 2]
    if as_json:
        click.echo(json.dumps(out))
        return
    us = 1e6
    say(f"{url}: {out['server']} protocol {out['version']}, "
        f"features {', '.join(out['features']) or '(none)'}, "
        f"max_body {_size(out['max_body'])}")
    click.echo(f"{count} round trips: min {out['min_s'] * us:.0f} us, p50 {out['p50_s'] * us:.0f} "
               f"us, avg {out['avg_s'] * us:.0f} us, max {out['max_s'] * us:.0f} us")


# -- stats ------------------------------------------------------------------------------


async def _sample(c: Any) -> dict[str, Any]:
    from transferd.protocol.constants import Command

    # summary: uptime, connections, errors, the engine; discovery: where the daemon's
    # names live and whether that store is up (a daemon before them ignores them).
    stats = dict((await ask(c, Command.STATS, {"summary": True, "discovery": True})).body)
    devices = (await ask(c, Command.GET_DEVICES)).body.get("devices", [])
    stats["devices"] = list(devices)
    stats["t"] = time.monotonic()
    return stats


def _duration(s: float) -> str:
    d, rest = divmod(int(s), 86400)
    h, rest = divmod(rest, 3600)
    m, sec = divmod(rest, 60)
    return (f"{d} d {h} h" if d else f"{h} h {m} min" if h else f"{m} min {sec} s" if m
            else f"{s:.1f} s")


def _rate_of(now: dict[str, Any], before: dict[str, Any] | None, dt: float, group: str,
             key: str) -> str:
    if not before or dt <= 0 or group not in before:
        return ""
    return f"{(now[group][key] - before[group][key]) / dt:,.0f}/s"


def _table(now: dict[str, Any], before: dict[str, Any] | None, url: str) -> str:
    dt = (now["t"] - before["t"]) if before else 0.0
    lines = [f"transferd stats {url}  ({time.strftime('%H:%M:%S')})", ""]

    def rate(key: str) -> str:
        if not before or dt <= 0:
            return ""
        return f"{(now[key] - before[key]) / dt:,.0f}/s"

    if "uptime_s" in now:
        lines.append(f"{'up':<22}{_duration(now['uptime_s']):>18}")
        conns = now["connections"]
        lines.append(f"{'connections open':<22}{conns['open']:>18,}")
        lines.append(f"{'connections accepted':<22}{conns['accepted']:>18,}  "
                     f"{_rate_of(now, before, dt, 'connections', 'accepted'):>14}")
    lines.append(f"{'bytes in':<22}{now['bytes_in']:>18,}  {rate('bytes_in'):>14}")
    lines.append(f"{'bytes out':<22}{now['bytes_out']:>18,}  {rate('bytes_out'):>14}")
    if "errors" in now:
        errs = {k: v for k, v in now["errors"].items() if v}
        lines.append(f"{'errors':<22}{sum(errs.values()):>18,}  "
                     + (", ".join(f"{k} {v:,}" for k, v in sorted(errs.items(),
                                                                  key=lambda kv: -kv[1]))))
        fails = now.get("auth_failures") or {}
        lines.append(f"{'failed handshakes':<22}{sum(fails.values()):>18,}  "
                     + ", ".join(f"{k} {v:,}" for k, v in sorted(fails.items())))
    eng = now.get("engine")
    if eng:
        lines.append(f"{'engine bytes out':<22}{eng['bytes_out']:>18,}  "
                     f"{_rate_of(now, before, dt, 'engine', 'bytes_out'):>14}")
        lines.append(f"{'engine bytes landed':<22}{eng['bytes_landed']:>18,}  "
                     f"{_rate_of(now, before, dt, 'engine', 'bytes_landed'):>14}")
        lines.append(f"{'engine transfers':<22}{eng['transfers_ok']:>18,}  "
                     f"{_rate_of(now, before, dt, 'engine', 'transfers_ok'):>14}  "
                     f"{eng['transfers_error']:,} failed, {eng['in_flight']:,} in flight, "
                     f"{eng['refused_writes']:,} peer writes refused")
    disc = now.get("discovery")
    if disc:
        where = disc.get("url") or "this daemon (embedded)"
        lines.append(f"{'names':<22}{disc.get('state', '?')} in {where}: "
                     f"{disc.get('names', 0)} here, {disc.get('mirrored', 0)} mirrored, "
                     f"{disc.get('peers', 0)} peers" + (f" ({disc['error']})"
                                                         if disc.get("error") else ""))
    lines.append("")
    lines.append(f"{'device':<10}{'used':>14}{'free':>14}{'total':>14}")
    for d in now["devices"]:
        total, free = int(d.get("total", 0)), int(d.get("free", 0))
        lines.append(f"{d.get('name', '?'):<10}{_size(total - free):>14}{_size(free):>14}"
                     f"{_size(total):>14}")
    lines.append("")
    lines.append(f"{'command':<22}{'received':>18}  {'rate':>14}")
    prev = before["commands"] if before else {}
    for name, n in sorted(now["commands"].items(), key=lambda kv: -kv[1]):
        if not n:
            continue
        r = f"{(n - prev.get(name, 0)) / dt:,.1f}/s" if before and dt > 0 else ""
        lines.append(f"{name:<22}{n:>18,}  {r:>14}")
    return "\n".join(lines)


@click.command(short_help="A live table of a daemon's counters.")
@URL
@TOKEN
@TIMEOUT
@click.option("--once", is_flag=True, help="Print once and exit.")
@click.option("--json", "as_json", is_flag=True,
              help="JSON: one object per refresh (with --once, just one).")
@click.option("-i", "--interval", type=click.FloatRange(0.1, 3600), default=1.0,
              show_default=True, help="Seconds between refreshes.")
@click.option("--count", type=click.IntRange(1), default=None,
              help="Stop after this many refreshes (default: until Ctrl-C).")
def stats(url: str, token: str | None, timeout: float, once: bool, as_json: bool,
          interval: float, count: int | None) -> None:
    """Show STATS and GET_DEVICES of the daemon at URL, refreshed in place every INTERVAL s.

    Counts are since the daemon started; rates are over the last interval.
    """
    if once:
        count = 1
    tty = sys.stdout.isatty() and not as_json

    async def work(c: Any) -> None:
        before: dict[str, Any] | None = None
        n = 0
        while count is None or n < count:
            now = await asyncio.wait_for(_sample(c), timeout)
            if as_json:
                click.echo(json.dumps({k: v for k, v in now.items() if k != "t"}))
            else:
                text = shown(_table(now, before, url))
                # In place on a terminal: home, clear, draw.
                click.echo(("\x1b[H\x1b[2J" if tty else "") + text + ("" if tty else "\n"))
            before = now
            n += 1
            if count is None or n < count:
                await asyncio.sleep(interval)

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends a live table
        _with_client(url, token, timeout, work)


# -- buffers ----------------------------------------------------------------------------


def _by(b: dict[str, Any]) -> str:
    """Who allocated it; "(owned)" when it dies with that connection (shared memory)."""
    who = b.get("allocated_by") or b.get("owner") or "?"
    return f"{who} (owned)" if b.get("owner") else str(who)


@click.command(short_help="List a daemon's buffers and regions.")
@URL
@TOKEN
@TIMEOUT
@click.option("--json", "as_json", is_flag=True, help="The listing as JSON.")
def buffers(url: str, token: str | None, timeout: float, as_json: bool) -> None:
    """List the buffers of the daemon at URL: id, device, size, the connection that owns
    it, and its registered regions (STATS with "buffers", docs/protocol.md)."""
    from transferd.protocol.constants import Command

    async def work(c: Any) -> dict[str, Any]:
        return dict((await ask(c, Command.STATS, {"buffers": True})).body)

    body = _with_client(url, token, timeout, work)
    if "buffers" not in body:
        click.echo(f"transferd: {url}: this daemon does not list its buffers (an older "
                   "version): upgrade it", err=True)
        sys.exit(Exit.FAILURE)
    if as_json:
        with unreadable(url):
            click.echo(json.dumps({"buffers": body["buffers"],
                                   "truncated": body["truncated"]}))
        return
    with unreadable(url):  # whole before a line is printed
        rows = body["buffers"]
        lines = [f"{'id':>8}  {'device':<8}{'size':>12}  {'allocated by':<24}regions"]
        total: dict[str, int] = {}
        for b in rows:
            regions = ", ".join(f"{r['id']} ({_size(r['size'])}"
                                + (f", {r['admitted']} writes landing" if r["admitted"]
                                   else "") + ")"
                                for r in b["regions"]) or "-"
            lines.append(f"{b['id']:>8}  {b['device']:<8}{_size(b['size']):>12}  "
                         f"{_by(b):<24}{regions}")
            total[b["device"]] = total.get(b["device"], 0) + b["size"]
        summary = ", ".join(f"{_size(n)} on {d}" for d, n in total.items()) or "nothing"
        more = " (listing cut at 10,000)" if body["truncated"] else ""
        lines.append(f"{len(rows)} buffer(s){more}: {summary}")
    say("\n".join(lines))
