"""UVM watchers without a GPU: a shared word bumped by another process.

The daemon polls the word; the bumper is a real second process that maps
the page the daemon named and stores into it, as a GPU kernel would through
its mapped registration.  Latency is measured from the bump (the bumper's
CLOCK_MONOTONIC, shared by every process of the machine) to the client's
callback.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client import Client, SyncClient
from tests.helpers import DaemonProcess, async_test
from transferd.protocol.constants import Command, ErrorCode, Flag
from transferd.protocol.errors import BadRequest, OutOfBounds

BUMPER = r"""
import json, mmap, os, sys, time
import numpy as np
path, offset, n, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
os.close(fd)
word = np.frombuffer(m, dtype=np.uint64)[offset // 8: offset // 8 + 1]
times = []
for i in range(1, n + 1):
    t = time.monotonic_ns()
    word[0] = i
    times.append(t)
    time.sleep(gap)
print(json.dumps(times))
"""


def percentile(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


@async_test(timeout=60)
async def test_watcher_on_a_shared_word_bumped_by_another_process(daemon: DaemonProcess) -> None:
    seen: list[tuple[int, int, int]] = []
    async with await Client.connect(daemon.url) as c:
        w = await c.alloc_uvm_watcher(lambda old, new: seen.append((old, new, time.monotonic_ns())))
        assert w.path and Path(w.path).exists() and w.value == 0
        assert os.stat(w.path).st_mode & 0o777 == 0o600
        n = 200
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", BUMPER, w.path, str(w.offset), str(n), "0.002",
            stdout=subprocess.PIPE)
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
        bumps = json.loads(out)
        for _ in range(200):
            if seen and seen[-1][1] == n:
                break
            await asyncio.sleep(0.01)
    assert seen and seen[-1][1] == n
    # Changes are reported in order, each starting where the last one ended.
    prev = 0
    for old, new, _ in seen:
        assert old == prev and new > old
        prev = new
    # Latency from each bump the callback reported to that callback.
    lat_us = [(t - bumps[new - 1]) / 1000 for _, new, t in seen]
    p50, p99 = percentile(lat_us, 50), percentile(lat_us, 99)
    print(f"\nwatcher latency, bump in another process -> client callback: "
          f"p50 {p50:.0f} us, p99 {p99:.0f} us over {len(seen)} changes of {n} bumps")
    assert len(seen) >= n // 2  # 2 ms apart: nearly every bump is its own change
    assert 0 < p50 < 50_000 and p99 < 500_000


@async_test(timeout=30)
async def test_watcher_page_goes_with_the_connection(daemon: DaemonProcess) -> None:
    c = await Client.connect(daemon.url)
    w = await c.alloc_uvm_watcher(lambda old, new: None)
    w2 = await c.alloc_uvm_watcher(lambda old, new: None)
    assert w2.path == w.path and w2.offset == w.offset + 8 and w2.id != w.id
    path = Path(str(w.path))
    await c.close()
    for _ in range(300):
        if not path.exists():
            break
        await asyncio.sleep(0.01)
    assert not path.exists()


@async_test(timeout=30)
async def test_watcher_on_a_buffer_word_moved_by_set_tensor(daemon: DaemonProcess) -> None:
    got: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    async with await Client.connect(daemon.url) as c, await Client.connect(daemon.url) as other:
        buf = await c.alloc_buffer(4096)
        w = await c.alloc_uvm_watcher(lambda o, n: got.put_nowait((o, n)), buffer=buf, offset=64)
        assert w.path is None and w.value == 0
        await other.set_tensor(buf.tensor(64, 8), (41).to_bytes(8, "little"))
        assert await asyncio.wait_for(got.get(), 5) == (0, 41)
        await other.set_tensor(buf.tensor(64, 8), (42).to_bytes(8, "little"))
        assert await asyncio.wait_for(got.get(), 5) == (41, 42)
        with pytest.raises(OutOfBounds):
            await c.alloc_uvm_watcher(lambda o, n: None, buffer=buf, offset=4092)
        with pytest.raises(BadRequest):
            await c.alloc_uvm_watcher(lambda o, n: None, buffer=buf, offset=4)
        with pytest.raises(BadRequest):
            w.word()  # a buffer word has no shared page to map
        # The connection still serves.
        assert await c.get_tensor(buf.tensor(64, 8)) == (42).to_bytes(8, "little")


@async_test(timeout=30)
async def test_watcher_bumped_from_this_process_and_its_event_frame(
        daemon: DaemonProcess) -> None:
    async with await Client.connect(daemon.url) as c:
        got: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        w = await c.alloc_uvm_watcher(lambda o, n: got.put_nowait((o, n)))
        w.set(7)
        assert await asyncio.wait_for(got.get(), 5) == (0, 7)
        assert w.bump(3) == 10
        assert await asyncio.wait_for(got.get(), 5) == (7, 10)
        assert w.value == 10 and w.changes == 2
        w.close()


def test_watcher_wire_form(daemon: DaemonProcess) -> None:
    from tests.helpers import RawConn

    with RawConn.to(daemon) as raw:
        raw.hello()
        f = raw.request(Command.ALLOC_UVM_WATCHER, {})
        assert f.flags == Flag.REPLY
        body = f.body
        assert set(body) == {"watcher", "value", "path", "offset", "page_size"}
        assert body["page_size"] == 4096
        import mmap

        fd = os.open(body["path"], os.O_RDWR)
        m = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED)
        os.close(fd)
        m[body["offset"]: body["offset"] + 8] = (5).to_bytes(8, "little")
        ev = raw.recv()
        assert ev.cmd == Command.ALLOC_UVM_WATCHER and ev.flags == Flag.EVENT
        assert ev.seq == f.seq
        assert ev.body == {"watcher": body["watcher"], "old": 0, "new": 5}
        m.close()
        bad = raw.request(Command.ALLOC_UVM_WATCHER, {"buffer": 999})
        assert bad.is_error and bad.body["code"] == ErrorCode.NOT_FOUND


def test_sync_client_watcher(daemon: DaemonProcess) -> None:
    import threading

    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def cb(old: int, new: int) -> None:
        seen.append((old, new))
        done.set()

    with SyncClient.connect(daemon.url) as c:
        w = c.alloc_uvm_watcher(cb)
        w.set(3)
        assert done.wait(5)
    assert seen == [(0, 3)]


@async_test(timeout=30)
async def test_watchers_per_connection_are_bounded(daemon: DaemonProcess) -> None:
    from transferd.engine.watchers import MAX_PER_OWNER
    from transferd.protocol.errors import OutOfMemory

    async with await Client.connect(daemon.url) as c:
        for _ in range(MAX_PER_OWNER):
            await c.alloc_uvm_watcher(lambda o, n: None)
        with pytest.raises(OutOfMemory):
            await c.alloc_uvm_watcher(lambda o, n: None)
        assert (await c.get_devices())[0]["name"] == "cpu"  # still serving


def test_layer_watcher_example_runs() -> None:
    """examples/layer_watcher.py: a watcher bumped per layer triggers that layer's writes."""
    from tests.helpers import REPO

    r = subprocess.run([sys.executable, "examples/layer_watcher.py", "--layers", "4",
                        "--pages", "4", "--page-kib", "4"], cwd=REPO, capture_output=True,
                       text=True, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checksums: all layers match" in r.stdout
    assert r.stdout.count("pages counted on the decode node") == 4
