"""The soak (issue 11): clients and daemons under mixed load for a bounded time.

``python -m benchmarks.soak --seconds 180`` (``make soak``) starts three real
daemons (``rpc-server`` subprocesses, two loopback rails each, a cluster
secret, listening on tcp, unix, seqpacket and tls) and drives them with 16
clients of the real client library in this process, over the four transports
(tls only where the openssl CLI is, to make a certificate).  Every
client runs one operation at a time, picked at random from:

- tensor ops on a buffer of its own: ``set``, ``get`` (checked against what
  it wrote), ``batch`` (SET_TENSORS then GET_TENSORS), ``copy`` (COPY_TENSOR);
- engine writes into the region of its *target* (the next client, always on
  another daemon): ``write`` (4-64 KiB), ``write_large`` (1.5 MiB, split over
  both rails), ``paged`` (4 KiB pages), ``scatter`` (three pieces),
  ``barrier``, each carrying the writer's own immediate;
- ``send`` of a message to the target's daemon (every client posts receives);
- ``imm``: a client reads the count of its writer's immediate on its own
  daemon and waits for (consumes) that many.

Each client owns its regions and offsets, so what every byte should hold is
known: the writer keeps a mirror of its target's region.  At the end
everything is read back and compared by SHA-256; every message sent and
acknowledged must have been received exactly once, intact; every immediate
counted exactly as often as the writes placed it (consumed + still counted ==
expected).  Each daemon's RSS is sampled every 0.5 s; memory is "flat" when the
RSS at the end of the load is within ``--rss-bound-mib`` of the RSS after
warm-up.  The record goes to ``--out`` (JSON), the plot to ``--plot`` (PNG,
with the optional ``plot`` extra), the summary to stdout; the exit status is 0
only if every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client import Client, MrDesc, MrHandle, NetAddr, Pages, RemoteBuffer, ScatterDst

from .harness import REPO, Pinning, ServerProcess, daemon_command
from .soak_report import Latencies, RssSampler, flatness, plot, summary

MiB = 1 << 20
PAGE = 4096
LOCAL = 1 * MiB  # each client's own tensor buffer
REGION = 2 * MiB  # each client's write source, and the region its writer targets
RECV_LEN = 16 * 1024  # receives each client posts (RECV_COUNT of them)
RECV_COUNT = 16
# Any one operation (and each wait of the checks) that takes longer is a hang.
OP_TIMEOUT = 30.0
TRANSPORTS = ("tcp", "unix", "seqpacket", "tls")  # tls where the openssl CLI is
# Loopback aliases of the soak's daemons (the test clusters use 127.0.0.2-7).
RAILS = [("127.0.0.40", "127.0.0.41"), ("127.0.0.42", "127.0.0.43"),
         ("127.0.0.44", "127.0.0.45")]
# How often each operation is picked (relative weights).
MIX = {"set": 10, "get": 10, "batch": 4, "copy": 4, "write": 12, "write_large": 2,
       "paged": 6, "scatter": 4, "barrier": 3, "send": 8, "imm": 3}
_MSG_HEAD = struct.Struct("<IIII")  # sender, seq, body length, crc32 of the body
ERRORS_KEPT = 50


@dataclass
class Options:
    seconds: float = 180.0
    clients: int = 16
    seed: int = 1
    warmup_s: float | None = None  # default: max(3 s, a sixth of the run)
    rss_interval: float = 0.5
    rss_bound_mib: float = 32.0
    out: str | None = None
    plot: str | None = None
    # Called with the Soak after the load, before the checks (tests use it to check
    # twice, and to tamper in between: the checks must catch it).
    before_check: Callable[[Soak], Awaitable[None]] | None = None

    @property
    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s is not None else max(3.0, self.seconds / 6)


@dataclass
class Region:
    buf: RemoteBuffer
    mr: MrHandle
    desc: MrDesc


@dataclass
class Member:
    """One soak client: its connection, its regions and what it expects of them."""

    idx: int
    daemon: int
    transport: str
    client: Client
    rng: random.Random
    imm: int
    local: RemoteBuffer | None = None
    local_mirror: bytearray = field(default_factory=lambda: bytearray(LOCAL))
    src: Region | None = None
    src_data: bytes = b""
    dst: Region | None = None  # written by this member's writer only
    target: Member | None = None  # whose dst this member writes
    writer: Member | None = None  # who writes this member's dst
    target_mirror: bytearray = field(default_factory=lambda: bytearray(REGION))
    target_addr: NetAddr | None = None
    imm_expected: int = 0  # counts this member's writes placed at the target
    imm_consumed: int = 0  # counts of the writer's immediate this member consumed
    msg_seq: int = 0
    lat: Latencies = field(default_factory=Latencies)


class Soak:
    def __init__(self, opts: Options, tls_ca: str | None = None) -> None:
        self.opts = opts
        self.tls_ca = tls_ca
        self.rng = random.Random(opts.seed)
        self.members: list[Member] = []
        self.errors: list[str] = []
        self.error_count = 0
        # Messages: (sender, seq) acknowledged to the sender / received by any client.
        self.sent: set[tuple[int, int]] = set()
        self.received: Counter[tuple[int, int]] = Counter()
        self.corrupt = 0

    def error(self, what: str) -> None:
        self.error_count += 1
        if len(self.errors) < ERRORS_KEPT:
            self.errors.append(what)

    # -- set-up -----------------------------------------------------------------------

    async def connect(self, daemons: list[ServerProcess]) -> None:
        base = self.rng.randrange(1 << 20, 1 << 30)
        transports = TRANSPORTS if self.tls_ca else TRANSPORTS[:3]
        for i in range(self.opts.clients):
            # 3 daemons, 4 transports: every pairing within 12 clients.
            d = i % len(daemons)
            transport = transports[i % len(transports)]
            url = _url_for(daemons[d], transport)
            kw = {"tls_ca": self.tls_ca} if transport == "tls" else {}
            c = await Client.connect(url, timeout=OP_TIMEOUT, **kw)
            self.members.append(Member(i, d, transport, c, random.Random(self.opts.seed * 1000 + i),
                                       imm=base + i))
        n = len(self.members)
        for m in self.members:
            m.target = self.members[(m.idx + 1) % n]
            m.target.writer = m
        for m in self.members:
            await self._setup(m)
        for m in self.members:
            assert m.target is not None
            m.target_addr = await m.target.client.main_address()

    async def _setup(self, m: Member) -> None:
        c = m.client
        m.local = await c.alloc_buffer(LOCAL)
        await c.buffer_clear(m.local, 0)
        src = await c.alloc_buffer(REGION)
        m.src_data = m.rng.randbytes(REGION)
        await c.set_tensor(src.tensor(), m.src_data)
        mr, desc = await c.reg_mr(src)
        m.src = Region(src, mr, desc)
        dst = await c.alloc_buffer(REGION)
        await c.buffer_clear(dst, 0)
        mr, desc = await c.reg_mr(dst)
        m.dst = Region(dst, mr, desc)
        c.submit_recvs(RECV_LEN, RECV_COUNT, lambda msg: self._on_message(msg))
        await c.imm_count(0)  # a round trip: posted before any sender sends

    def _on_message(self, msg: bytes) -> None:
        if len(msg) < _MSG_HEAD.size:
            self.corrupt += 1
            return
        sender, seq, n, crc = _MSG_HEAD.unpack_from(msg)
        body = msg[_MSG_HEAD.size:]
        if len(body) != n or zlib.crc32(body) != crc:
            self.corrupt += 1
            return
        self.received[(sender, seq)] += 1

    # -- the load -----------------------------------------------------------------------

    async def drive(self, m: Member, until: float) -> None:
        kinds = list(MIX)
        weights = [MIX[k] for k in kinds]
        ops = {k: getattr(self, f"op_{k}") for k in kinds}
        loop = asyncio.get_running_loop()
        while loop.time() < until:
            kind = m.rng.choices(kinds, weights)[0]
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(ops[kind](m), OP_TIMEOUT)
            except Exception as exc:
                self.error(f"client {m.idx} ({m.transport}) {kind}: {type(exc).__name__}: {exc}")
                if isinstance(exc, TimeoutError | ConnectionError):
                    return
                continue
            m.lat.add(kind, time.perf_counter() - t0)

    def _span(self, m: Member, size: int, lo: int = 1, hi: int = 64 * 1024) -> tuple[int, int]:
        n = m.rng.randint(lo, hi)
        return m.rng.randrange(0, size - n + 1), n

    async def op_set(self, m: Member) -> None:
        assert m.local is not None
        off, n = self._span(m, LOCAL)
        data = m.rng.randbytes(n)
        await m.client.set_tensor(m.local.tensor(off, n), data)
        m.local_mirror[off:off + n] = data

    async def op_get(self, m: Member) -> None:
        assert m.local is not None
        off, n = self._span(m, LOCAL)
        got = bytes(await m.client.get_tensor(m.local.tensor(off, n)))
        if got != m.local_mirror[off:off + n]:
            self.error(f"client {m.idx}: get of {n} bytes at {off} differs from what was set")

    async def op_batch(self, m: Member) -> None:
        assert m.local is not None
        spans = [self._span(m, LOCAL, 1, 8192) for _ in range(8)]
        for off, n in spans:
            data = m.rng.randbytes(n)
            m.client.set_tensor_async(m.local.tensor(off, n), data)
            m.local_mirror[off:off + n] = data
        await m.client.flush()
        spans = [self._span(m, LOCAL, 1, 8192) for _ in range(8)]
        futs = [m.client.get_tensor_async(m.local.tensor(off, n)) for off, n in spans]
        await m.client.flush()
        for (off, n), f in zip(spans, futs, strict=True):
            if bytes(await f) != m.local_mirror[off:off + n]:
                self.error(f"client {m.idx}: batched get of {n} bytes at {off} differs")

    async def op_copy(self, m: Member) -> None:
        assert m.local is not None
        n = m.rng.randint(1, 64 * 1024)
        half = LOCAL // 2
        a, b = m.rng.randrange(0, half - n + 1), half + m.rng.randrange(0, half - n + 1)
        if m.rng.random() < 0.5:
            a, b = b, a
        await m.client.copy_tensor(m.local.tensor(a, n), m.local.tensor(b, n))
        m.local_mirror[b:b + n] = m.local_mirror[a:a + n]

    async def _write(self, m: Member, n: int) -> None:
        assert m.src is not None and m.target is not None and m.target.dst is not None
        s = m.rng.randrange(0, REGION - n + 1)
        d = m.rng.randrange(0, REGION - n + 1)
        w = await m.client.submit_single_write(n, m.imm, (m.src.mr, s), (m.target.dst.desc, d))
        await w.wait(OP_TIMEOUT)
        m.target_mirror[d:d + n] = m.src_data[s:s + n]
        m.imm_expected += 1

    async def op_write(self, m: Member) -> None:
        await self._write(m, m.rng.randint(4096, 64 * 1024))

    async def op_write_large(self, m: Member) -> None:
        await self._write(m, 3 * MiB // 2)  # over 1 MiB: split over both rails

    async def op_paged(self, m: Member) -> None:
        assert m.src is not None and m.target is not None and m.target.dst is not None
        pages = REGION // PAGE
        k = m.rng.randint(1, 64)
        sp = m.rng.sample(range(pages), k)
        dp = m.rng.sample(range(pages), k)  # distinct: the result is order-free
        w = await m.client.submit_paged_writes(
            PAGE, m.imm, (m.src.mr, Pages(sp, PAGE)), (m.target.dst.desc, Pages(dp, PAGE)))
        await w.wait(OP_TIMEOUT)
        for s, d in zip(sp, dp, strict=True):
            m.target_mirror[d * PAGE:(d + 1) * PAGE] = m.src_data[s * PAGE:(s + 1) * PAGE]
        m.imm_expected += k

    async def op_scatter(self, m: Member) -> None:
        assert m.src is not None and m.target is not None and m.target.dst is not None
        third = REGION // 3
        dsts, moves = [], []
        for j in range(3):  # one piece in each third: disjoint
            n = m.rng.randint(1, 32 * 1024)
            s = m.rng.randrange(0, REGION - n + 1)
            d = j * third + m.rng.randrange(0, third - n + 1)
            dsts.append(ScatterDst(n, s, (m.target.dst.desc, d)))
            moves.append((s, d, n))
        w = await m.client.submit_scatter(None, m.imm, m.src.mr, dsts)
        await w.wait(OP_TIMEOUT)
        for s, d, n in moves:
            m.target_mirror[d:d + n] = m.src_data[s:s + n]
        m.imm_expected += 3

    async def op_barrier(self, m: Member) -> None:
        assert m.target is not None and m.target.dst is not None
        w = await m.client.submit_barrier(None, m.imm, [m.target.dst.desc])
        await w.wait(OP_TIMEOUT)
        m.imm_expected += 1

    async def op_send(self, m: Member) -> None:
        assert m.target_addr is not None
        m.msg_seq += 1
        body = m.rng.randbytes(m.rng.randint(0, RECV_LEN - _MSG_HEAD.size))
        msg = _MSG_HEAD.pack(m.idx, m.msg_seq, len(body), zlib.crc32(body)) + body
        w = await m.client.submit_send(m.target_addr, msg)
        await w.wait(OP_TIMEOUT)
        self.sent.add((m.idx, m.msg_seq))

    async def op_imm(self, m: Member) -> None:
        assert m.writer is not None
        n = await m.client.imm_count(m.writer.imm)
        if n:
            await (await m.client.expect_imm_count(m.writer.imm, n, wait=False)).wait(OP_TIMEOUT)
            m.imm_consumed += n

    # -- the checks ---------------------------------------------------------------------

    async def check(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        # Messages: every acknowledged one was handed to a client; wait for its event.
        deadline = loop.time() + OP_TIMEOUT
        while not self.sent <= set(self.received) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        lost = len(self.sent - set(self.received))
        dup = sum(n - 1 for n in self.received.values() if n > 1)
        messages = {"sent": len(self.sent), "received": sum(self.received.values()),
                    "lost": lost, "duplicated": dup, "corrupt": self.corrupt,
                    "unacknowledged_received": len(set(self.received) - self.sent)}
        # Immediates: what the target consumed plus what is still counted.
        expected = counted = ilost = idup = 0
        for m in self.members:
            w = m.writer
            assert w is not None
            left = await m.client.imm_count(w.imm)
            expected += w.imm_expected
            counted += m.imm_consumed + left
            diff = m.imm_consumed + left - w.imm_expected
            ilost += max(0, -diff)
            idup += max(0, diff)
        imm = {"expected": expected, "counted": counted, "lost": ilost, "duplicated": idup}
        # Checksums: every byte of every region against its mirror.
        regions = equal = nbytes = 0
        for m in self.members:
            assert m.local is not None and m.src is not None and m.dst is not None
            assert m.writer is not None
            for what, buf, want in (("local", m.local, m.local_mirror),
                                    ("src", m.src.buf, m.src_data),
                                    ("dst", m.dst.buf, m.writer.target_mirror)):
                got = await _read(m.client, buf)
                regions += 1
                nbytes += len(got)
                if hashlib.sha256(got).digest() == hashlib.sha256(want).digest():
                    equal += 1
                else:
                    self.error(f"client {m.idx}: {what} region's checksum differs "
                               f"({_first_diff(got, want)})")
        return {"messages": messages, "imm": imm,
                "checksums": {"regions": regions, "equal": equal, "bytes": nbytes}}

    async def close(self) -> None:
        for m in self.members:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(m.client.close(), 5)


async def _read(c: Client, buf: RemoteBuffer, step: int = MiB) -> bytes:
    out = bytearray()
    for off in range(0, buf.size, step):
        n = min(step, buf.size - off)
        out += bytes(await asyncio.wait_for(c.get_tensor(buf.tensor(off, n)), OP_TIMEOUT))
    return bytes(out)


def _first_diff(got: bytes, want: bytes | bytearray) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"first differing byte at {i}"
    return f"lengths {len(got)} and {len(want)}"


def _url_for(d: ServerProcess, scheme: str) -> str:
    for u in d.urls:
        if u.startswith(f"{scheme}://"):
            return u
    raise RuntimeError(f"{d.name} does not listen on {scheme}: {d.urls}")


def make_cert(where: str) -> tuple[str, str] | None:
    """A self-signed certificate for 127.0.0.1 (cert, key), or None without openssl."""
    if shutil.which("openssl") is None:
        return None
    cert, key = os.path.join(where, "cert.pem"), os.path.join(where, "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30)
    return cert, key


def start_daemons(where: str, secret: str,
                  tls: tuple[str, str] | None = None) -> list[ServerProcess]:
    none = Pinning.detect(enabled=False)
    daemons = []
    try:
        for i, rails in enumerate(RAILS):
            env = {"TRANSFERD_ENGINE_HOST_RAILS": ",".join(rails),
                   "TRANSFERD_ENGINE_SECRET_FILE": secret,
                   "TRANSFERD_LOG_LEVEL": "warning"}
            listen = ["--listen", f"unix://{where}/{i}.sock",
                      "--listen", f"seqpacket://{where}/{i}.seq"]
            if tls is not None:
                env["TRANSFERD_SERVER_TLS_CERT"], env["TRANSFERD_SERVER_TLS_KEY"] = tls
                listen += ["--listen", "tls://127.0.0.1:0"]
            argv = daemon_command(*listen)
            daemons.append(ServerProcess(argv, none, name=f"daemon {'abc'[i]}", env=env).start())
    except BaseException:
        for d in daemons:
            d.stop()
        raise
    return daemons


def _stop(daemons: list[ServerProcess]) -> dict[str, Any]:
    """Stop every daemon (SIGTERM); its exit status and whether it logged a problem."""
    out = {}
    for d in daemons:
        err = d._tail()
        proc = d.proc
        d.stop()
        status = proc.returncode if proc is not None else None
        out[d.name] = {"exit": status,
                       "problems": "Traceback" in err or " ERROR " in err,
                       "stderr_tail": err[-600:]}
    return out


async def run(opts: Options) -> dict[str, Any]:
    """One soak; the record (see the module docstring).  Daemons are always stopped."""
    where = tempfile.mkdtemp(prefix="td-soak-", dir="/tmp")  # AF_UNIX paths are short
    secret = os.path.join(where, "secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32).hex().encode())
    daemons: list[ServerProcess] = []
    tls = make_cert(where)
    soak = Soak(opts, tls_ca=tls[0] if tls else None)
    sampler: RssSampler | None = None
    try:
        daemons = start_daemons(where, secret, tls)
        sampler = RssSampler({d.name: d.pid for d in daemons}, opts.rss_interval)
        sampler.start()
        await soak.connect(daemons)
        loop = asyncio.get_running_loop()
        t_load = time.monotonic()
        until = loop.time() + opts.seconds
        await asyncio.gather(*(soak.drive(m, until) for m in soak.members))
        load_s = time.monotonic() - t_load
        end_s = time.monotonic() - sampler.t0
        if opts.before_check is not None:
            await opts.before_check(soak)
        checks = await soak.check()
        await soak.close()
    finally:
        if sampler is not None:
            sampler.stop()
        stopped = _stop(daemons)
        shutil.rmtree(where, ignore_errors=True)
    warmup = (t_load - sampler.t0) + opts.warmup
    bound = int(opts.rss_bound_mib * MiB)
    memory = {s.name: flatness(s, warmup, end_s, bound) for s in sampler.series}
    lat = Latencies()
    for m in soak.members:
        lat.merge(m.lat)
    ops = lat.table(load_s)
    record: dict[str, Any] = {
        "what": "soak (issue 11): mixed load, every byte checked at the end",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _commit(),
        "clients": opts.clients, "daemons": len(daemons),
        "transports": sorted({m.transport for m in soak.members}),
        "seconds": opts.seconds, "load_s": round(load_s, 2), "warmup_s": round(opts.warmup, 2),
        "rss_bound_mib": opts.rss_bound_mib, "mix": MIX,
        "ops": ops,
        "total_ops": sum(r["count"] for r in ops.values()),
        "total_ops_per_s": round(sum(r["count"] for r in ops.values()) / load_s, 1),
        "checks": checks, "memory": memory,
        "daemons_stopped": {k: {"exit": v["exit"], "problems": v["problems"]}
                            for k, v in stopped.items()},
        "error_count": soak.error_count, "errors": soak.errors,
        "rss_series": {s.name: [[round(t, 2), round(r / MiB, 2)] for t, r in s.points]
                       for s in sampler.series},
    }
    for name, v in stopped.items():
        if v["exit"] != 0 or v["problems"]:
            soak.error(f"{name}: exit {v['exit']}, stderr: {v['stderr_tail']}")
    record["error_count"], record["errors"] = soak.error_count, soak.errors
    record["plot"] = (plot(sampler.series, opts.plot, warmup, end_s) or opts.plot) \
        if opts.plot else "not asked for (--plot FILE)"
    c = checks
    record["passed"] = (
        soak.error_count == 0
        and c["checksums"]["equal"] == c["checksums"]["regions"]
        and not (c["messages"]["lost"] or c["messages"]["duplicated"] or c["messages"]["corrupt"])
        and not (c["imm"]["lost"] or c["imm"]["duplicated"])
        and all(r.get("passed") for r in memory.values())
    )
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float,
                   default=float(os.environ.get("SOAK_SECONDS", "180")),
                   help="seconds of load (default $SOAK_SECONDS or 180)")
    p.add_argument("--clients", type=int, default=16, help="clients (default 16)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds of warm-up before the memory baseline "
                        "(default max(3, seconds/6))")
    p.add_argument("--rss-bound-mib", type=float, default=32.0,
                   help="most a daemon's RSS may grow after warm-up (default 32 MiB)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "soak.json"))
    p.add_argument("--plot", default=str(REPO / "benchmarks" / "results" / "soak.png"))
    a = p.parse_args(argv)
    if a.clients < 2:
        p.error("--clients must be at least 2 (each writes into the next one's region)")
    opts = Options(seconds=a.seconds, clients=a.clients, seed=a.seed, warmup_s=a.warmup,
                   rss_bound_mib=a.rss_bound_mib, out=a.out, plot=a.plot)
    import uvloop

    record = uvloop.run(run(opts))
    print(summary(record))
    print(f"record: {opts.out}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
