"""The other side of the engine figures: a plain socket, Mooncake, NIXL (one process each).

Run as ``PYTHON benchmarks/engine_peers.py ROLE ...`` by :mod:`benchmarks.engine`.
Standard library only (plus the engine under test), so it runs in the
project's venv (``socket-*``) and in the benchmark-only venv that holds
Mooncake and NIXL (``.bench-venv``, see ``make bench-venv``); neither engine
is ever a dependency of transferd.

Every role is a long-lived process that talks JSON lines: it prints one
``{"ready": ...}`` line once set up (or ``{"error": ...}`` and exits), then
reads one command per line on stdin and answers each with one line:

- ``{"op": "bulk", "size": N}``: one write of N bytes, source to target;
  answers ``{"s": seconds}`` (from the call to completion at the initiator);
- ``{"op": "lat", "n": K, "size": S}``: K sequential writes of S bytes, each
  timed from submit to completion; answers ``{"s": [seconds, ...]}``;
- ``{"op": "paged", "size": N, "page": P, "seed": S}`` (``socket-i`` only): the
  same N bytes as N/P pages, source and target pages each in a random order
  (``sendmsg`` / ``recvmsg_into`` over the page lists, 512 a call); ``{"s": seconds}``;
- ``{"op": "crc", "size": N}`` (target): ``{"crc": crc32 of the first N bytes}``;
- ``{"op": "rss"}``: ``{"hwm": VmHWM bytes, "rss": VmRSS bytes}``.

Roles (``-i`` initiator, ``-t`` target):

- ``socket-t`` / ``socket-i``: the baseline.  Blocking sockets, TCP_NODELAY;
  the initiator ``sendall``s a 32-byte header and the bytes from a
  preallocated buffer, the target ``recv_into``s them into its own and answers
  one byte, so the figure is time to "the data is in the target's memory".
- ``mooncake-t`` / ``mooncake-i``: ``mooncake.engine.TransferEngine``,
  ``initialize(host, "P2PHANDSHAKE", "tcp", "")``, buffers registered with
  ``register_memory``, writes with ``transfer_sync_write``.
- ``nixl-t`` / ``nixl-i``: a ``nixl_agent`` with the UCX backend (``UCX_TLS=tcp``
  set by the caller), metadata handed over through the parent, a WRITE
  transfer request made once per size and reposted, completion busy-polled
  with ``check_xfer_state``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import socket
import struct
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

PAGE_NO = struct.Struct("<Q")


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def memory() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                key = "hwm" if line.startswith("VmHWM") else "rss"
                out[key] = int(line.split()[1]) * 1024
    return out


CHUNK = 1 << 20
PAGE = 4096


def fill_chunks(size: int) -> Iterator[tuple[int, bytes]]:
    """The source data of every arm: (offset, chunk) pairs of up to 1 MiB.

    A fixed pseudo-random MiB with each 4 KiB page stamped with its page
    number, so a misplaced or repeated page changes the CRC.
    """
    block = bytearray(random.Random(1234).randbytes(CHUNK))
    for off in range(0, size, CHUNK):
        n = min(CHUNK, size - off)
        for p in range(0, n, PAGE):
            PAGE_NO.pack_into(block, p, (off + p) // PAGE)
        yield off, bytes(block[:n])


class Buffer:
    """Page-aligned anonymous memory, faulted in up front (page faults are not timed)."""

    def __init__(self, size: int, fill: bool) -> None:
        self.size = size
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self.mm = mmap.mmap(-1, size, flags=flags)
        self.view = memoryview(self.mm)
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.source_crc = 0
        if fill:
            for off, chunk in fill_chunks(size):
                self.view[off : off + len(chunk)] = chunk
                self.source_crc = zlib.crc32(chunk, self.source_crc)

    def crc(self, n: int) -> int:
        return zlib.crc32(self.view[:n])


def serve(handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    handlers.setdefault("rss", lambda _: memory())
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        try:
            emit(handlers[cmd["op"]](cmd))
        except Exception as exc:
            emit({"error": f"{type(exc).__name__}: {exc}"})


def timed_lat(one: Callable[[int], None], n: int, size: int) -> list[float]:
    clock = time.perf_counter
    out = []
    for _ in range(n):
        t0 = clock()
        one(size)
        out.append(clock() - t0)
    return out


# -- plain sockets ---------------------------------------------------------------

# A write: kind (1 contiguous, 2 pages), bytes, page size, seed of the page order.
HDR = struct.Struct("<4Q")
IOV_MAX = 512


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("peer closed")
        got += k


def page_views(view: memoryview, nbytes: int, page: int, seed: int) -> list[memoryview]:
    """The pages of ``view`` in a random order (the same order on both sides for a seed)."""
    order = random.Random(seed).sample(range(nbytes // page), nbytes // page)
    return [view[i * page : (i + 1) * page] for i in order]


def _scatter(io: Callable[[list[memoryview]], int], views: list[memoryview]) -> None:
    """sendmsg / recvmsg_into over a page list, IOV_MAX views a call, until all moved."""
    k = 0
    while k < len(views):
        n = io(views[k : k + IOV_MAX])
        if not n:
            raise ConnectionError("peer closed")
        while n:
            v = views[k]
            if n >= len(v):
                n -= len(v)
                k += 1
            else:
                views[k] = v[n:]
                n = 0


def socket_target(a: argparse.Namespace) -> None:
    buf = Buffer(a.size, False)
    srv = socket.create_server((a.host, 0))
    emit({"ready": True, "host": a.host, "port": srv.getsockname()[1], "addr": buf.ptr})
    # The bytes go to the buffer from a thread; commands come on stdin.
    import threading

    def run() -> None:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hdr = bytearray(HDR.size)

        def recv_pages(views: list[memoryview]) -> int:
            return conn.recvmsg_into(views)[0]

        with conn:
            while True:
                try:
                    _recv_exact(conn, memoryview(hdr))
                except ConnectionError:
                    return
                kind, n, page, seed = HDR.unpack(hdr)
                if kind == 1:
                    _recv_exact(conn, buf.view[:n])
                else:
                    _scatter(recv_pages, page_views(buf.view, n, page, seed))
                conn.sendall(b"k")

    threading.Thread(target=run, daemon=True).start()
    serve({"crc": lambda c: {"crc": buf.crc(int(c["size"]))}})


def socket_initiator(a: argparse.Namespace) -> None:
    buf = Buffer(a.size, True)
    sock = socket.create_connection((a.peer_host, a.peer_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = bytearray(1)

    def one(n: int) -> None:
        sock.sendall(HDR.pack(1, n, 0, 0))
        sock.sendall(buf.view[:n])
        _recv_exact(sock, memoryview(ack))

    def bulk(c: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        one(int(c["size"]))
        return {"s": time.perf_counter() - t0}

    def paged(c: dict[str, Any]) -> dict[str, Any]:
        """Pages in a random order on both sides (target order from seed, source seed+1)."""
        n, page, seed = int(c["size"]), int(c["page"]), int(c["seed"])
        t0 = time.perf_counter()
        views = page_views(buf.view, n, page, seed + 1)
        sock.sendall(HDR.pack(2, n, page, seed))
        _scatter(sock.sendmsg, views)
        _recv_exact(sock, memoryview(ack))
        return {"s": time.perf_counter() - t0}

    emit({"ready": True, "crc": buf.source_crc})
    serve({
        "bulk": bulk,
        "paged": paged,
        "lat": lambda c: {"s": timed_lat(one, int(c["n"]), int(c["size"]))},
    })


# -- Mooncake ----------------------------------------------------------------------


def _mooncake(host: str) -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    return engine


def mooncake_target(a: argparse.Namespace) -> None:
    engine = _mooncake(a.host)
    buf = Buffer(a.size, False)
    if engine.register_memory(buf.ptr, a.size) != 0:
        raise RuntimeError("register_memory failed")
    emit({"ready": True, "session": f"{a.host}:{engine.get_rpc_port()}", "addr": buf.ptr})
    serve({"crc": lambda c: {"crc": buf.crc(int(c["size"]))}})


def mooncake_initiator(a: argparse.Namespace) -> None:
    engine = _mooncake(a.host)
    buf = Buffer(a.size, True)
    if engine.register_memory(buf.ptr, a.size) != 0:
        raise RuntimeError("register_memory failed")
    session, remote = a.session, a.addr

    def one(n: int) -> None:
        rc = engine.transfer_sync_write(session, buf.ptr, remote, n)
        if rc != 0:
            raise RuntimeError(f"transfer_sync_write returned {rc}")

    def bulk(c: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        one(int(c["size"]))
        return {"s": time.perf_counter() - t0}

    emit({"ready": True, "crc": buf.source_crc})
    serve({
        "bulk": bulk,
        "lat": lambda c: {"s": timed_lat(one, int(c["n"]), int(c["size"]))},
    })


# -- NIXL ----------------------------------------------------------------------------


def _nixl(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise RuntimeError(f"no UCX backend (plugins: {agent.get_plugin_list()})")
    return agent


def nixl_target(a: argparse.Namespace) -> None:
    agent = _nixl("transferd-bench-target")
    buf = Buffer(a.size, False)
    agent.register_memory([(buf.ptr, a.size, 0, "")], "DRAM")
    emit({"ready": True, "meta": agent.get_agent_metadata().hex(), "addr": buf.ptr})
    serve({"crc": lambda c: {"crc": buf.crc(int(c["size"]))}})


def nixl_initiator(a: argparse.Namespace) -> None:
    agent = _nixl("transferd-bench-initiator")
    buf = Buffer(a.size, True)
    agent.register_memory([(buf.ptr, a.size, 0, "")], "DRAM")
    remote = agent.add_remote_agent(bytes.fromhex(a.meta))
    handles: dict[int, Any] = {}

    def handle(n: int) -> Any:
        h = handles.get(n)
        if h is None:
            local = agent.get_xfer_descs([(buf.ptr, n, 0)], "DRAM")
            dst = agent.get_xfer_descs([(a.addr, n, 0)], "DRAM")
            # WRITE: our buffer into the target's; READ: the target's into ours.
            h = handles[n] = agent.initialize_xfer(a.xfer, local, dst, remote, b"")
        return h

    def one(n: int) -> None:
        h = handle(n)
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in state {state}")

    def bulk(c: dict[str, Any]) -> dict[str, Any]:
        n = int(c["size"])
        handle(n)  # made once per size, outside the timed region
        t0 = time.perf_counter()
        one(n)
        return {"s": time.perf_counter() - t0}

    def lat(c: dict[str, Any]) -> dict[str, Any]:
        handle(int(c["size"]))
        return {"s": timed_lat(one, int(c["n"]), int(c["size"]))}

    # The first transfer opens the UCX connection; do it before "ready".
    one(4096)
    emit({"ready": True, "crc": buf.source_crc})
    serve({"bulk": bulk, "lat": lat})


ROLES: dict[str, Callable[[argparse.Namespace], None]] = {
    "socket-t": socket_target,
    "socket-i": socket_initiator,
    "mooncake-t": mooncake_target,
    "mooncake-i": mooncake_initiator,
    "nixl-t": nixl_target,
    "nixl-i": nixl_initiator,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="engine_peers.py")
    ap.add_argument("role", choices=sorted(ROLES))
    ap.add_argument("--size", type=int, required=True, help="buffer size in bytes")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--peer-host", default="127.0.0.1")
    ap.add_argument("--peer-port", type=int, default=0)
    ap.add_argument("--session", default="", help="mooncake: the target's host:rpc_port")
    ap.add_argument("--addr", type=int, default=0, help="the target buffer's address")
    ap.add_argument("--meta", default="", help="nixl: the target agent's metadata (hex)")
    ap.add_argument("--xfer", default="WRITE", choices=("WRITE", "READ"),
                    help="nixl: the initiator's operation")
    a = ap.parse_args(argv)
    try:
        ROLES[a.role](a)
    except Exception as exc:
        emit({"error": f"{type(exc).__name__}: {exc}"})
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
