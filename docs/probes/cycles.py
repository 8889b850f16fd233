# What a real daemon leaves to the cyclic collector per operation (stop 37).
#
#   .venv/bin/python docs/probes/cycles.py [N] [SCENARIO ...]
#
# Runs a daemon in this process (fuzzing.harness.InProcessDaemon: the real Session,
# handlers, service and transports on a uvloop loop in a thread; listeners on tcp, unix,
# seqpacket and tls), plays N rounds of each scenario with a raw client socket, and
# prints how many objects gc.collect() then finds in cycles (gc.DEBUG_SAVEALL keeps
# them), per round and by type. The collector is off during the rounds, so nothing is
# collected behind the count. The client's own objects (tests.helpers.RawConn: a socket
# and a decoder) make no cycles; every type counted is the daemon's. Scenarios:
#   conn, unix, seqpacket, tls: HELLO then close, over that transport
#   use: HELLO, ALLOC, SET, GET, WATCH, LEASE, EXPECT_IMM_COUNT left waiting, close
#   errors: refused requests (bad fields, unknown command, NOT_FOUND, a refused SET)
#   watch: WATCH then CANCEL, on one connection
#   names: WATCH, PUBLISH and UNPUBLISH (two change EVENTs), CANCEL
#   lease: LEASE then END_LEASE
#   expect: EXPECT_IMM_COUNT then CANCEL
#   write: SINGLE_WRITE to this daemon's own peer address, waited for
#   uvm: ALLOC_UVM_WATCHER, one change EVENT, close
# and the Python client library's own (client.Client on an asyncio loop of this thread,
# uvloop's with CLIENT_LOOP=uvloop; client.SyncClient on its loop thread): the daemon's
# side leaves nothing now, so every type these count is the client's (inproc's: its node's
# too, made in this process).
#   client, client-unix: Client.connect, then ALLOC, SET, GET, a batched flush (a
#       set_tensor_async and a get_tensor_async), a WATCH closed, a FREE_BUFFER of no
#       buffer (NotFound raised and caught), FREE_BUFFER, close; over tcp, over unix
#   sync, sync-unix: the same with SyncClient
#   client-conn: Client.connect then close, nothing else (tcp)
#   client-tls: the client scenario over tls
#   inproc: Client.connect("inproc://") then close (the engine in this process)
# CYCLES_SHOW=1: each cycle's edges after one round (who refers to whom, by attribute);
# CYCLES_SHOW=2: only the references that make each cycle (not what the cycles keep).
from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import itertools
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.environ.get("TREE", os.getcwd()))

from fuzzing.harness import InProcessDaemon
from tests.helpers import RawConn
from transferd.protocol.constants import Command, Flag


class Probe(InProcessDaemon):
    """InProcessDaemon with every listener kind: tcp, unix, seqpacket, tls."""

    def __init__(self, where: str) -> None:
        cert, key = f"{where}/cert.pem", f"{where}/key.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        super().__init__({"server.unix_socket": f"{where}/s.sock", "server.tls_cert": cert,
                          "server.tls_key": key,
                          "server.listen": [f"seqpacket://{where}/q.sock",
                                            "tls://127.0.0.1:0"]})


def raw(d: Probe, kind: str = "tcp") -> RawConn:
    c = RawConn.at(d.urls[kind], cafile=d.config.server.tls_cert)
    assert not c.hello().is_error
    return c


def ok(f: Any) -> dict:
    assert not f.is_error, f.body
    return f.body


def req(c: RawConn, cmd: int, body: dict, payload: bytes = b"") -> dict:
    """A request's reply (EVENTs of earlier requests before it are dropped)."""
    return ok(answer(c, cmd, body, payload))


def answer(c: RawConn, cmd: int, body: dict, payload: bytes = b"") -> Any:
    seq = c.send(cmd, body, payload)
    while True:
        f = c.recv()
        if f.seq == seq and not f.flags & int(Flag.EVENT):
            return f


def event(c: RawConn, seq: int) -> Any:
    while True:
        f = c.recv()
        if f.seq == seq and f.flags & int(Flag.EVENT):
            return f


def until_closed(d: Probe, keep: int) -> None:
    """Wait until the daemon holds no client session but the probe's own (and its loop
    has run what the closes scheduled)."""
    deadline = time.monotonic() + 5
    while (n := d.call(lambda: _sessions(d))) > keep:
        if time.monotonic() > deadline:
            raise SystemExit(f"the daemon still holds {n} sessions")
        time.sleep(0.01)


async def _sessions(d: Probe) -> int:
    import asyncio

    for _ in range(5):
        await asyncio.sleep(0)
    return len(d._frontend.ctx.sessions)


LEASES = itertools.count()


def s_conn(d: Probe, c: RawConn | None, kind: str = "tcp") -> None:
    raw(d, kind).close()


def s_use(d: Probe, c: RawConn | None) -> None:
    r = raw(d)
    buf = req(r, Command.ALLOC_BUFFER, {"device": "cpu", "size": 4096})["buffer"]
    req(r, Command.SET_TENSOR, {"tensor": [buf, 0, 4096]}, payload=b"\x01" * 4096)
    req(r, Command.GET_TENSOR, {"tensor": [buf, 0, 4096]})
    r.send(Command.WATCH, {"prefix": "cyc/"})
    ok(r.recv())
    req(r, Command.LEASE, {"lease": f"cyc-{next(LEASES)}", "ttl_ms": 60_000})
    r.send(Command.EXPECT_IMM_COUNT, {"imm": 5, "count": 1, "timeout_ms": 60_000},
           flags=int(Flag.NO_REPLY))
    req(r, Command.SYNCHRONIZE, {})
    r.close()


def s_errors(d: Probe, c: RawConn | None) -> None:
    assert c is not None
    assert answer(c, Command.ALLOC_BUFFER, {"device": "cpu", "size": "x"}).is_error
    assert answer(c, 0x7E, {}).is_error
    assert answer(c, Command.FREE_BUFFER, {"buffer": 99_999}).is_error
    assert answer(c, Command.SET_TENSOR, {"tensor": [99_999, 0, 64]}, b"\0" * 64).is_error
    assert answer(c, Command.SINGLE_WRITE, {"len": 1, "src": [99_999, 0],
                                            "dst": [d.known["desc"], 0]}).is_error


def s_watch(d: Probe, c: RawConn | None) -> None:
    assert c is not None
    seq = c.send(Command.WATCH, {"prefix": "cyc/"})
    ok(c.recv())
    req(c, Command.CANCEL, {"seq": seq})
    req(c, Command.SYNCHRONIZE, {})
    c.frames.clear()


def s_names(d: Probe, c: RawConn | None) -> None:
    assert c is not None
    seq = c.send(Command.WATCH, {"prefix": "cyn/"})
    ok(c.recv())
    req(c, Command.PUBLISH, {"name": "cyn/a", "kind": "bytes", "value": b"v"})
    req(c, Command.UNPUBLISH, {"name": "cyn/a"})  # (its change EVENTs came before)
    req(c, Command.CANCEL, {"seq": seq})
    req(c, Command.SYNCHRONIZE, {})
    c.frames.clear()


def s_lease(d: Probe, c: RawConn | None) -> None:
    assert c is not None
    req(c, Command.LEASE, {"lease": "cyc-l", "ttl_ms": 60_000})
    req(c, Command.END_LEASE, {"lease": "cyc-l"})


def s_expect(d: Probe, c: RawConn | None) -> None:
    assert c is not None
    seq = c.send(Command.EXPECT_IMM_COUNT, {"imm": 6, "count": 1, "timeout_ms": 60_000},
                 flags=int(Flag.NO_REPLY))
    req(c, Command.CANCEL, {"seq": seq})
    req(c, Command.SYNCHRONIZE, {})
    c.frames.clear()


def s_write(d: Probe, c: RawConn | None) -> None:
    assert c is not None
    seq = c.send(Command.SINGLE_WRITE, {"len": 64, "src": [d.known["mr"], 0],
                                        "dst": [d.known["desc"], 64]})
    ok(event(c, seq))


def s_uvm(d: Probe, c: RawConn | None) -> None:
    r = raw(d)
    seq = r.send(Command.ALLOC_UVM_WATCHER, {})
    w = ok(r.recv())
    fd = os.open(w["path"], os.O_RDWR)
    with contextlib.closing(mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED)) as m:
        os.close(fd)
        m[w["offset"]: w["offset"] + 8] = (5).to_bytes(8, "little")
        ok(event(r, seq))
    r.close()


# The async Client's loop (one for every round, as an application's): asyncio's own, or
# with CLIENT_LOOP=uvloop uvloop's.
LOOP = asyncio.new_event_loop() if os.environ.get("CLIENT_LOOP") != "uvloop" \
    else __import__("uvloop").new_event_loop()
INPROC = {"engine.peer_port": 0, "engine.host_rails": "127.0.0.1", "metrics.enabled": False,
          "memory.host_limit_mib": 64}


async def client_use(c: Any) -> None:
    """What the client scenarios do with a connected Client (c), every call awaited."""
    from transferd.protocol.errors import NotFound

    buf = await c.alloc_buffer(4096)
    await c.set_tensor(buf.tensor(), b"\x01" * 4096)
    assert bytes(await c.get_tensor(buf.tensor(0, 16))) == b"\x01" * 16
    c.set_tensor_async(buf.tensor(0, 64), b"\x02" * 64)
    got = c.get_tensor_async(buf.tensor(0, 64))
    await c.flush()
    assert bytes(await got) == b"\x02" * 64
    async with c.watch("cyc/"):
        pass
    try:
        await c.free_buffer(99_999)
    except NotFound:
        pass
    else:
        raise AssertionError("FREE_BUFFER of no buffer succeeded")
    await c.free_buffer(buf)


def s_client(d: Probe, c: RawConn | None, kind: str = "tcp", use: bool = True) -> None:
    from client import Client

    async def one() -> None:
        tls = {"tls_ca": d.config.server.tls_cert} if kind == "tls" else {}
        cl = await Client.connect(d.urls[kind], **tls)
        try:
            if use:
                await client_use(cl)
        finally:
            await cl.close()

    LOOP.run_until_complete(one())


def s_sync(d: Probe, c: RawConn | None, kind: str = "tcp") -> None:
    from client import SyncClient
    from transferd.protocol.errors import NotFound

    cl = SyncClient.connect(d.urls[kind])
    try:
        buf = cl.alloc_buffer(4096)
        cl.set_tensor(buf.tensor(), b"\x01" * 4096)
        assert bytes(cl.get_tensor(buf.tensor(0, 16))) == b"\x01" * 16
        cl.set_tensor_async(buf.tensor(0, 64), b"\x02" * 64)
        got = cl.get_tensor_async(buf.tensor(0, 64))
        cl.flush()
        assert bytes(got.result(10)) == b"\x02" * 64
        with cl.watch("cyc/"):
            pass
        try:
            cl.free_buffer(99_999)
        except NotFound:
            pass
        cl.free_buffer(buf)
    finally:
        cl.close()


def s_inproc(d: Probe, c: RawConn | None) -> None:
    from client import Client

    async def one() -> None:
        cl = await Client.connect("inproc://", overrides=INPROC)
        await cl.close()

    LOOP.run_until_complete(one())


SCENARIOS = {
    "conn": (s_conn, False),
    "unix": (lambda d, c: s_conn(d, c, "unix"), False),
    "seqpacket": (lambda d, c: s_conn(d, c, "seqpacket"), False),
    "tls": (lambda d, c: s_conn(d, c, "tls"), False),
    "use": (s_use, False),
    "errors": (s_errors, True),
    "watch": (s_watch, True),
    "names": (s_names, True),
    "lease": (s_lease, True),
    "expect": (s_expect, True),
    "write": (s_write, True),
    "uvm": (s_uvm, False),
    "client": (s_client, False),
    "client-unix": (lambda d, c: s_client(d, c, "unix"), False),
    "client-conn": (lambda d, c: s_client(d, c, "tcp", use=False), False),
    "client-tls": (lambda d, c: s_client(d, c, "tls"), False),
    "sync": (s_sync, False),
    "sync-unix": (lambda d, c: s_sync(d, c, "unix"), False),
    "inproc": (s_inproc, False),
}


def _name(o: object) -> str:
    t = type(o)
    if t.__name__ == "method":
        return f"method {type(o.__self__).__qualname__}.{o.__func__.__name__}"  # type: ignore
    if t.__name__ == "function":
        return f"function {o.__qualname__}"  # type: ignore[attr-defined]
    return f"{t.__module__}.{t.__qualname__}"


def cycles(garbage: list[object]) -> list[set[int]]:
    """The cycles among the objects found: their strongly connected components (by id),
    one object referring to itself included; the rest is only what they keep."""
    ids = {id(o): o for o in garbage}
    edges = {i: [id(r) for r in gc.get_referents(o) if id(r) in ids] for i, o in ids.items()}
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on: set[int] = set()
    out: list[set[int]] = []
    for root in ids:
        if root in index:
            continue
        work = [(root, 0)]
        while work:  # Tarjan's, without recursion
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            for j in range(i, len(edges[v])):
                w = edges[v][j]
                if w not in index:
                    work += [(v, j + 1), (w, 0)]
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in edges[v]:
                        out.append(comp)
                if work:
                    u = work[-1][0]
                    low[u] = min(low[u], low[v])
    return out


def show(garbage: list[object], only_cycles: bool = False) -> None:
    """Every reference between the objects found (by attribute where it has one); with
    ``only_cycles`` (CYCLES_SHOW=2) only those of each cycle, a cycle at a time."""
    if only_cycles:
        byid = {id(o): o for o in garbage}
        for n, comp in enumerate(cycles(garbage)):
            print(f"    cycle {n}: {len(comp)} objects")
            _edges([byid[i] for i in comp], comp)
        return
    _edges(garbage, {id(o) for o in garbage})


def _edges(objs: list[object], ids: set[int]) -> None:
    for o in objs:
        for r in gc.get_referents(o):
            if id(r) not in ids:
                continue
            how = ""
            with contextlib.suppress(TypeError):
                how = next((f".{k}" for k, v in vars(o).items() if v is r), "")
            for k in getattr(type(o), "__slots__", ()):
                if getattr(o, k, None) is r:
                    how = f".{k}"
            print(f"      {_name(o)}@{id(o) % 10**6} -{how}-> {_name(r)}@{id(r) % 10**6}")


def measure(d: Probe, name: str, n: int) -> None:
    fn, shared = SCENARIOS[name]
    c = raw(d) if shared else None
    try:
        fn(d, c)  # warm: what is made once (imports, caches) is not counted
        until_closed(d, 1 if shared else 0)
        gc.collect()
        gc.garbage.clear()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.disable()
        try:
            for _ in range(n):
                fn(d, c)
            until_closed(d, 1 if shared else 0)
            found = gc.collect()
            kinds = collections.Counter(_name(o) for o in gc.garbage)
            if os.environ.get("CYCLES_SHOW") and found:
                show(gc.garbage[: found // n], os.environ["CYCLES_SHOW"] == "2")
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    finally:
        if c is not None:
            c.close()
    print(f"{name}: {found} objects in cycles after {n} rounds, {found / n:.1f} per round")
    for kind, count in kinds.most_common(30):
        print(f"    {count / n:8.1f}  {kind}")


def main() -> None:
    args = sys.argv[1:]
    n = int(args.pop(0)) if args and args[0].isdigit() else 50
    names = args or list(SCENARIOS)
    where = tempfile.mkdtemp(prefix="td-probe-cycles-")
    try:
        with Probe(where) as d:
            for name in names:
                measure(d, name, n)
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
