"""Issue 11's "Fairness and bounded work" attacks, replayed against live daemons.

    python -m benchmarks.attacks [--only clears,get650k,...] [--json FILE]

Each attack starts its own daemons (``rpc-server`` subprocesses on loopback), runs what
the issue describes, and reports what happens now: a typed refusal, or a bounded figure,
with the attacked daemon's resident memory growth and, where the issue measured one,
another client's latency while the attack ran.  Nothing here asserts: the replay says
what the daemon does today, whatever it does; ``before`` is the issue's own figure.
Each attack is bounded (a time limit of its own, about 20 s at most; the whole run about
three minutes).  The results are in docs/security.md ("Results").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

from client import Client
from tests.helpers import DaemonProcess, RawConn, rss
from tests.integration.fake_peer import FakePeer
from transferd.protocol.constants import Command, Flag
from transferd.protocol.frames import encode_frame
from transferd.protocol.peer import PeerCommand
from transferd.protocol.values import MrDesc, NetAddr

from .attacks_common import (
    FD_LIMIT,
    Bystander,
    MiB,
    Outcome,
    codes,
    daemons,
    engine_env,
    mib,
    ok,
    pipeline,
)


def clears(quick: bool) -> Outcome:
    size = (256 if quick else 1024) * MiB
    out = Outcome("clears", f"100 pipelined NO_REPLY BUFFER_CLEARs of {size // MiB} MiB (a "
                  "few KB sent); another client's STATS meanwhile",
                  "the daemon's loop held 9.9 s: every other client waited")
    with daemons((["-m", str(size // MiB + 64)], {})) as (d,):
        a = RawConn.to(d, timeout=30)
        a.hello()
        buf = ok(a.request(Command.ALLOC_BUFFER, {"size": size})).body["buffer"]
        base = rss(d)
        window = 3.0 if quick else 8.0
        with Bystander(d) as by:
            a.send_raw(b"".join(encode_frame(Command.BUFFER_CLEAR, Flag.NO_REPLY, 10 + i,
                                             {"buffer": buf, "value": i % 256})
                                for i in range(100)))
            time.sleep(window)
        with RawConn.to(d) as c:
            c.hello()
            ran = ok(c.request(Command.STATS)).body["commands"]["BUFFER_CLEAR"]
        out.rss_growth_mib = mib(rss(d) - base)
        a.close()
        by.fill(out)
        out.numbers.update(clears_run=ran, window_s=window, buffer_mib=size // MiB)
        out.now = (f"{ran} of 100 clears ran in {window:g} s while the other client's STATS "
                   f"took {out.bystander_p50_ms} ms (p50), {out.bystander_max_ms} ms (max)")
    return out


def get650k(quick: bool) -> Outcome:
    out = Outcome("get650k", "GET_TENSORS of 650,000 one-byte tensors, reply never read",
                  "stalled the loop 1.5 s and held 206 MiB per connection not reading")
    with daemons(([], {})) as (d,):
        a = RawConn.to(d, timeout=30)
        a.hello()
        buf = ok(a.request(Command.ALLOC_BUFFER, {"size": 4096})).body["buffer"]
        base = rss(d)
        with Bystander(d) as by:
            t0 = time.perf_counter()
            f = a.request(Command.GET_TENSORS, {"tensors": [[buf, 0, 1]] * 650_000})
            took = time.perf_counter() - t0
            # The largest batch allowed (max_tensors, announced in HELLO), its reply unread.
            cap = 65536
            a.send(Command.GET_TENSORS, {"tensors": [[buf, i % 4096, 1] for i in range(cap)]})
            time.sleep(1.0)
        out.rss_growth_mib = mib(rss(d) - base)
        by.fill(out)
        a.close()
        code = f.body.get("code") if f.is_error else "a reply"
        out.numbers.update(answer=code, answer_s=round(took, 3),
                           message=f.body.get("message", ""))
        out.now = (f"{code} in {took * 1000:.0f} ms ({f.body.get('message', '')}); the "
                   f"connection stays; a {cap}-tensor GET left unread: RSS "
                   f"+{out.rss_growth_mib} MiB")
    return out


def expectations(quick: bool) -> Outcome:
    n = 6000
    out = Outcome("expectations", f"close a connection with {n:,} pending EXPECT_IMM_COUNTs",
                  "stalled the daemon 6.4 s (quadratic: 1,000 took 0.17 s)")
    with daemons(([], {})) as (d,):
        a = RawConn.to(d, timeout=30)
        a.hello()
        got = pipeline(a, [b"".join(encode_frame(
            Command.EXPECT_IMM_COUNT, Flag.NO_REPLY, 10 + k,
            {"imm": 1000 + k % 7, "count": 1 << 30}) for k in range(n))], 30)
        refused = codes(got)
        base = rss(d)
        with Bystander(d) as by:
            time.sleep(0.3)
            t0 = time.perf_counter()
            a.close()
            time.sleep(1.0)
        by.fill(out)
        out.rss_growth_mib = mib(rss(d) - base)
        out.numbers.update(refused=refused, close_window_s=round(time.perf_counter() - t0, 2))
        held = n - sum(refused.values())
        out.now = (f"{held} held, {sum(refused.values())} refused ({refused or 'none'}); "
                   f"around the close the other client's STATS took at most "
                   f"{out.bystander_max_ms} ms")
    return out


async def _writes_to_silent_peer(out: Outcome, ds: list[DaemonProcess]) -> None:
    a_d, b_d, c_d = ds
    a = await Client.connect(a_d.url, timeout=20)
    b = await Client.connect(b_d.url, timeout=20)
    c = await Client.connect(c_d.url, timeout=20)
    victim = await Client.connect(a_d.url, timeout=20)
    try:
        src_buf = await a.alloc_buffer(4096)
        src, _ = await a.reg_mr(src_buf)
        to_b = (await b.reg_mr(await b.alloc_buffer(4096)))[1]
        to_c = (await c.reg_mr(await c.alloc_buffer(4096)))[1]
        for dst in (to_b, to_c):
            await (await a.submit_single_write(64, None, (src, 0), (dst, 0))).wait(20)
        assert b_d.proc is not None
        os.kill(b_d.proc.pid, signal.SIGSTOP)
        await asyncio.sleep(0.3)
        sent = 0

        async def attack() -> None:
            nonlocal sent
            for _ in range(4200):
                await a.submit_single_write(64, None, (src, 0), (to_b, 0))
                sent += 1
        task = asyncio.ensure_future(attack())
        await asyncio.sleep(3.0)
        t0 = time.monotonic()
        await (await victim.submit_single_write(64, None, (src, 0), (to_c, 0))).wait(20)
        took = time.monotonic() - t0
        out.numbers.update(attack_submitted=sent, victim_write_s=round(took, 4))
        out.now = (f"with {sent} of the attacker's writes submitted, another client's write "
                   f"to a live peer completed in {took * 1000:.1f} ms (peer timeout 15 s)")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    finally:
        if b_d.proc is not None and b_d.proc.poll() is None:
            os.kill(b_d.proc.pid, signal.SIGCONT)
        for cl in (victim, a, b, c):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(cl.close(), 2)


def silent_peer(quick: bool) -> Outcome:
    out = Outcome("silent_peer", "4,200 writes to a stopped peer from one client; another "
                  "client's write to a healthy peer",
                  "the other client's write waited the whole peer timeout (4.75 s measured)")
    specs: list[tuple[list[str], dict[str, str]]] = [
        ([], engine_env("127.0.0.2", peer_timeout_s=15)), ([], engine_env("127.0.0.4")),
        ([], engine_env("127.0.0.6"))]
    with daemons(*specs) as ds:
        base = rss(ds[0])
        asyncio.run(asyncio.wait_for(_writes_to_silent_peer(out, ds), 25))
        out.rss_growth_mib = mib(rss(ds[0]) - base)
    return out


def forged_peers(quick: bool) -> Outcome:
    n = 600
    out = Outcome("forged_peers", f"ADD_PEER_GROUP of {n} forged addresses (silent listeners "
                  f"that accept and never answer), the daemon at {FD_LIMIT} file descriptors",
                  "every fd used, no new client accepted, links never reclaimed, 846,000 "
                  "log lines in 10 s")
    listeners = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        listeners.append(s)
    args = ["--log-level", "info"]
    env = engine_env("127.0.0.2", peer_timeout_s=2, handshake_timeout_s=2)
    d = DaemonProcess(args, env, command=[
        sys.executable, "-c", "import resource, runpy, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({FD_LIMIT}, {FD_LIMIT})); "
        "sys.argv = ['rpc-server'] + sys.argv[1:]; runpy.run_module('rpc_server.cli', "
        "run_name='__main__')", "-H", "127.0.0.1", "-p", "0", "--metrics-port", "0"])
    try:
        d.start().wait_ready()
        assert d.proc is not None
        with RawConn.to(d, timeout=30) as a:
            a.hello()
            addrs = [NetAddr(0x7000 + i, 0, [f"127.0.0.1:{s.getsockname()[1]}".encode()])
                     for i, s in enumerate(listeners)]
            lines0 = len(d.stderr.splitlines())
            base = rss(d)
            f = a.request(Command.ADD_PEER_GROUP, {"addrs": [x.to_bytes() for x in addrs]})
            answer = f.body.get("code") if f.is_error else f"group {f.body.get('group')}"
            peak_fds = 0
            t_end = time.monotonic() + (4 if quick else 10)
            accepts: list[float] = []
            while time.monotonic() < t_end:
                peak_fds = max(peak_fds, len(os.listdir(f"/proc/{d.proc.pid}/fd")))
                t0 = time.perf_counter()
                try:
                    with RawConn.to(d, timeout=5) as c:
                        c.hello()
                        ok(c.request(Command.STATS))
                    accepts.append(time.perf_counter() - t0)
                except (OSError, RuntimeError):
                    accepts.append(float("inf"))
                time.sleep(0.2)
            fds_after = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
            lines = len(d.stderr.splitlines()) - lines0
            out.rss_growth_mib = mib(rss(d) - base)
        served = sum(1 for t in accepts if t != float("inf"))
        worst = max((t for t in accepts if t != float("inf")), default=float("nan"))
        out.numbers.update(answer=answer, peak_fds=peak_fds, fds_at_end=fds_after,
                           log_lines=lines, new_clients_served=f"{served}/{len(accepts)}",
                           worst_new_client_s=round(worst, 3))
        out.now = (f"{answer}; daemon fds peak {peak_fds}, {fds_after} at the end; "
                   f"{served}/{len(accepts)} new clients served (worst {worst * 1000:.0f} "
                   f"ms); {lines} log lines")
    finally:
        d.stop()
        for s in listeners:
            s.close()
    return out


async def _sends(out: Outcome, a_url: str, to: NetAddr, n: int, size: int,
                 timeout: float) -> dict[str, int]:
    """``n`` SENDs of ``size`` bytes from a client of A (each with the daemon's own
    deadline, engine.peer_timeout_s); each completion's outcome, waited ``timeout``."""
    a = await Client.connect(a_url, timeout=20)
    results: dict[str, int] = {}
    _SENDING_FROM[id(out)] = time.perf_counter()  # connected: the sends start
    try:
        msg = bytes(size)
        pending = [await a.submit_send(to, msg) for _ in range(n)]
        for c in pending:
            try:
                await c.wait(timeout + 5)
                key = "ok"
            except Exception as exc:
                key = getattr(getattr(exc, "code", None), "value", type(exc).__name__)
                out.numbers.setdefault("send_errors", {}).setdefault(key, str(exc)[:160])
            results[key] = results.get(key, 0) + 1
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(a.close(), 5)
    return results


_SENDING_FROM: dict[int, float] = {}


def peak(d: DaemonProcess) -> int:
    """The daemon's peak resident memory so far (VmHWM), bytes."""
    assert d.proc is not None
    with open(f"/proc/{d.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _pair() -> tuple[tuple[list[str], dict[str, str]], ...]:
    return (([], engine_env("127.0.0.2", peer_timeout_s=5)),
            (["-m", "256"], engine_env("127.0.0.4", peer_timeout_s=5)))


def _main_address(d: DaemonProcess) -> NetAddr:
    with RawConn.to(d) as c:
        c.hello()
        return NetAddr.from_bytes(ok(c.request(Command.MAIN_ADDRESS)).body["addr"])


def sends_unread(quick: bool) -> Outcome:
    n = 200 if quick else 600
    out = Outcome("sends_unread", f"{n} x 1 MiB SENDs to a receiver that posted a receive "
                  "and stopped reading",
                  "the receiving daemon grew by 599 MiB, every SEND acknowledged")
    with daemons(*_pair()) as (a_d, b_d):
        to = _main_address(b_d)
        r = RawConn.to(b_d, timeout=30)
        r.hello()
        r.send(Command.SUBMIT_RECVS, {"len": MiB, "count": n}, flags=Flag.NO_REPLY)
        ok(r.request(Command.STATS))
        r.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never reads
        base = rss(b_d)
        t0 = time.monotonic()
        res = asyncio.run(asyncio.wait_for(_sends(out, a_d.url, to, n, MiB, 8), 30))
        out.rss_growth_mib = mib(rss(b_d) - base)
        top = mib(peak(b_d) - base)
        out.seconds = round(time.monotonic() - t0, 1)
        r.close()
        out.numbers.update(sends=res, peak_growth_mib=top)
        out.now = (f"SENDs: {res}; the receiving daemon +{out.rss_growth_mib} MiB at the end, "
                   f"+{top} MiB at its peak ({n} MiB sent, its memory limit 256 MiB)")
    return out


def backlog(quick: bool) -> Outcome:
    n = 200 if quick else 700
    out = Outcome("backlog", f"{n} x 1 MiB SENDs with no receive posted; the sender goes; "
                  "then an unrelated client posts a receive",
                  "700 MiB waited in a backlog outside the memory limit, survived the "
                  "sender, and were handed to the unrelated client")
    with daemons(*_pair()) as (a_d, b_d):
        to = _main_address(b_d)
        base = rss(b_d)
        res = asyncio.run(asyncio.wait_for(_sends(out, a_d.url, to, n, MiB, 8), 30))
        grown = rss(b_d) - base
        got: list[int] = []

        async def unrelated() -> None:
            c = await Client.connect(b_d.url, timeout=20)
            try:
                c.submit_recvs(MiB, n, lambda m: got.append(len(m)))
                await asyncio.sleep(2.0)
            finally:
                await asyncio.wait_for(c.close(), 5)

        asyncio.run(asyncio.wait_for(unrelated(), 15))
        out.rss_growth_mib = mib(grown)
        out.numbers.update(sends=res, unrelated_client_got=len(got))
        out.now = (f"SENDs: {res}; the receiving daemon +{out.rss_growth_mib} MiB; an "
                   f"unrelated client's receive got {len(got)} of them afterwards")
    return out


def unread_acks(quick: bool) -> Outcome:
    window = 3.0 if quick else 6.0
    out = Outcome("unread_acks", f"a peer writes 1 MiB WRITEs into a region for {window:g} s "
                  "and never reads its ACKs",
                  "the inbound rail kept reading: 45 MiB sent, the daemon +265 MiB in 6 s")
    with daemons(([], engine_env("127.0.0.4"))) as (b_d,):
        dst = _main_address(b_d)
        with RawConn.to(b_d) as c:
            c.hello()
            buf = ok(c.request(Command.ALLOC_BUFFER, {"size": MiB})).body["buffer"]
            desc = MrDesc.from_wire(ok(c.request(Command.REG_MR, {"buffer": buf})).body["desc"])
            rkey = desc.rkeys[0][1]
            with FakePeer(dst, 0, None, timeout=10) as p:
                p.handshake()
                base = rss(b_d)
                p.conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                p.conn.sock.settimeout(1.0)
                payload = bytes(MiB)
                sent = 0
                blocked = ""
                t_end = time.monotonic() + window
                try:
                    while time.monotonic() < t_end:
                        p.send(PeerCommand.WRITE, {"op": sent + 1, "part": 0, "rkey": rkey,
                                                   "addrs": [desc.ptr], "lens": [MiB]},
                               payload)
                        sent += 1
                except (TimeoutError, OSError) as exc:
                    blocked = f"then the rail stopped taking bytes ({type(exc).__name__})"
                out.rss_growth_mib = mib(rss(b_d) - base)
        out.numbers.update(sent_mib=sent, window_s=window, blocked=blocked)
        out.now = (f"{sent} MiB sent in {window:g} s with no ACK read, "
                   f"{blocked or 'the rail still reading'}; the daemon "
                   f"+{out.rss_growth_mib} MiB")
    return out


def recv_pools(quick: bool) -> Outcome:
    n = 20_000 if quick else 200_000
    out = Outcome("recv_pools", f"{n:,} SUBMIT_RECVS on one connection; then 100 messages "
                  "to another client's receive",
                  "90 MiB, and every incoming message cost 16 ms")
    with daemons(*_pair()) as (a_d, b_d):
        to = _main_address(b_d)
        r = RawConn.to(b_d, timeout=60)
        r.hello()
        base = rss(b_d)
        t0 = time.monotonic()
        got = pipeline(r, [b"".join(encode_frame(Command.SUBMIT_RECVS, Flag.NO_REPLY, 10 + k,
                                                 {"len": 64, "count": 1})
                                    for k in range(i, min(n, i + 10_000)))
                           for i in range(0, n, 10_000)], 40)
        took = time.monotonic() - t0
        refused = codes(got)
        grown = rss(b_d) - base
        pools = n - sum(refused.values())
        r.close()  # its pools go with it: the messages below go to the other client
        time.sleep(0.3)
        arrived: list[float] = []

        async def measure() -> float:
            c = await Client.connect(b_d.url, timeout=20)
            try:
                c.submit_recvs(64, 100, lambda m: arrived.append(time.perf_counter()))
                await c.flush()
                res = await _sends(out, a_d.url, to, 100, 64, 8)
                t0 = _SENDING_FROM.pop(id(out))
                for _ in range(100):
                    if len(arrived) >= 100:
                        break
                    await asyncio.sleep(0.05)
                out.numbers["sends"] = res
                return (max(arrived) - t0) / max(len(arrived), 1) if arrived else float("nan")
            finally:
                await asyncio.wait_for(c.close(), 5)

        per = asyncio.run(asyncio.wait_for(measure(), 30))
        out.rss_growth_mib = mib(grown)
        out.numbers.update(pools_held=pools, refused=refused, delivered=len(arrived),
                           per_message_ms=round(per * 1000, 3), submits_s=round(took, 2))
        out.now = (f"{pools} pools held, {sum(refused.values())} refused ({refused or 'none'})"
                   f" in {took:.1f} s, +{out.rss_growth_mib} MiB; 100 messages then took "
                   f"{per * 1000:.2f} ms each ({len(arrived)} delivered)")
    return out


ATTACKS: dict[str, Callable[[bool], Outcome]] = {
    "clears": clears, "get650k": get650k, "expectations": expectations,
    "silent_peer": silent_peer, "forged_peers": forged_peers, "sends_unread": sends_unread,
    "backlog": backlog, "unread_acks": unread_acks, "recv_pools": recv_pools,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help=f"comma-separated: {', '.join(ATTACKS)}")
    ap.add_argument("--quick", action="store_true", help="smaller attacks (a smoke run)")
    ap.add_argument("--json", default="", help="also write the outcomes here")
    ap.add_argument("--markdown", action="store_true", help="also print them as table rows")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(ATTACKS)
    unknown = sorted(set(names) - set(ATTACKS))
    if unknown:
        ap.error(f"unknown attack(s) {', '.join(unknown)}; have {', '.join(ATTACKS)}")
    results = []
    for name in names:
        t0 = time.monotonic()
        try:
            o = ATTACKS[name](args.quick)
        except Exception as exc:  # say so and go on: the replay reports, never hides
            o = Outcome(name, "", "", now=f"the replay failed: {type(exc).__name__}: {exc}")
        o.seconds = o.seconds or round(time.monotonic() - t0, 1)
        results.append(o)
        print(f"== {o.name} ({time.monotonic() - t0:.1f} s)\n   attack: {o.attack}\n"
              f"   before: {o.before}\n   now:    {o.now}", flush=True)
        if o.rss_growth_mib is not None:
            print(f"   daemon RSS growth: {o.rss_growth_mib} MiB", flush=True)
        if o.bystander_max_ms is not None:
            print(f"   another client: p50 {o.bystander_p50_ms} ms, max "
                  f"{o.bystander_max_ms} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(o) for o in results], f, indent=1, default=str)
    if args.markdown:  # the rows of docs/security.md's table
        for o in results:
            extra = [f"RSS {o.rss_growth_mib:+} MiB"] if o.rss_growth_mib is not None \
                and f"{o.rss_growth_mib} MiB" not in o.now else []
            if o.bystander_max_ms is not None and f"{o.bystander_max_ms} ms" not in o.now:
                extra.append(f"another client p50 {o.bystander_p50_ms} ms, max "
                             f"{o.bystander_max_ms} ms")
            print(f"| {o.attack} (`{o.name}`) | {o.before} | {o.now}"
                  f"{'; ' + '; '.join(extra) if extra else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
