"""The engine in the caller's process, attacked as a careless user would: the caller's own
memory changed under the engine, odd buffers, memory registered twice, a client closed
with operations pending.  Each fixed break has its test here (docs/security.md, "The
engine in the caller's process, attacked"); the engines are real inproc nodes writing
to each other over loopback, every byte checked."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client import Client, MrDesc, SyncClient
from client.inproc import InprocClient
from tests.helpers import async_test, pattern
from tests.integration import engine_cluster
from tests.integration.engine_cluster import (
    HANDSHAKE_TIMEOUT_S,
    Cluster,
    MiB,
    client_url,
    engine_env,
    fresh_imm,
    secret_file,
    settle,
    start_many,
)
from tests.integration.fake_peer import FakePeer
from transferd import tracing
from transferd.config import ConfigError
from transferd.protocol.errors import BadRequest, ConnectionLost, TransferdError

WAIT = 30.0
clusters = engine_cluster.clusters


@contextlib.asynccontextmanager
async def engine(**overrides: Any) -> AsyncIterator[InprocClient]:
    # The defaults: loopback, ephemeral ports (two engines in one process never collide).
    c = await Client.connect("inproc://", overrides=overrides, timeout=WAIT)
    assert isinstance(c, InprocClient)
    try:
        yield c
    finally:
        await asyncio.wait_for(c.close(), WAIT)


def sha(b: Any) -> str:
    return hashlib.sha256(memoryview(b).cast("B")).hexdigest()


@async_test(timeout=60)
async def test_a_registered_numpy_array_cannot_be_reallocated_under_the_engine() -> None:
    # numpy's resize(refcheck=False) ignores buffer exports: before the fix it moved the
    # array's data while the engine still wrote into the old, freed block.
    async with engine() as me:
        a = np.zeros(1 << 16, np.uint8)
        buf = await me.register_memory(a)
        with pytest.raises(ValueError, match="resize"):
            a.resize(1 << 22, refcheck=False)
        # A view registered: the array owning its data is held too.
        base = np.zeros(1 << 16, np.uint8)
        vbuf = await me.register_memory(base[4096:])
        with pytest.raises(ValueError, match="resize"):
            base.resize(1 << 22, refcheck=False)
        # Freed: the array is the caller's again, to resize.
        await me.free_buffer(buf)
        await me.free_buffer(vbuf)
        a.resize(1 << 17, refcheck=False)
        base.resize(1 << 17, refcheck=False)


@async_test(timeout=60)
async def test_odd_buffers_are_refused_typed_and_exports_hold() -> None:
    async with engine() as me:
        # A dtype with no buffer format (before: numpy's ValueError escaped untyped).
        with pytest.raises(BadRequest, match="no buffer"):
            await me.register_memory(np.zeros(4, "M8[s]"))
        ro = np.zeros(8, np.uint8)
        ro.flags.writeable = False
        for bad in (ro, np.zeros((4, 4))[:, 1], np.asfortranarray(np.zeros((4, 4))), b"x", 7):
            with pytest.raises(BadRequest):
                await me.register_memory(bad)
        # What held: an mmap or a bytearray registered can be neither closed nor resized
        # (the view is an export); dropped by the caller, the object lives on while held.
        mm = mmap.mmap(-1, 1 << 16)
        mbuf = await me.register_memory(mm)
        with pytest.raises(BufferError):
            mm.close()
        with pytest.raises(BufferError):
            mm.resize(1 << 20)
        ba = bytearray(4096)
        await me.register_memory(ba)
        with pytest.raises(BufferError):
            ba.extend(b"x" * 10)
        x = np.zeros(4096, np.uint8)
        ref = weakref.ref(x)
        xbuf = await me.register_memory(x)
        del x
        gc.collect()
        assert ref() is not None
        await me.free_buffer(xbuf)
        gc.collect()
        assert ref() is None
        await me.free_buffer(mbuf)
        mm.close()


@async_test(timeout=90)
async def test_memory_registered_twice_and_writes_at_the_edges_of_a_caller_region() -> None:
    async with engine() as a, engine() as b:
        assert (await a.main_address()) != (await b.main_address())
        dst = np.zeros(4096, np.uint8)
        src = np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8)
        d1, d2 = await b.register_memory(dst), await b.register_memory(dst)
        assert d1.id != d2.id
        _, desc1 = await b.reg_mr(d1)
        _, desc2 = await b.reg_mr(d2)
        smr, _ = await a.reg_mr(await a.register_memory(src))
        for length, so, do in ((4097, 0, 0), (4096, 1, 0), (4096, 0, 1), (1, 4096, 0),
                               (1, 0, 4096), (1, -1, 0), (2 ** 64 - 1, 0, 0)):
            c = await a.submit_single_write(length, None, (smr, so), (desc1, do), timeout=10)
            with pytest.raises(TransferdError):
                await c
        assert not dst.any()  # nothing landed of a refused write
        await (await a.submit_single_write(2048, None, (smr, 0), (desc1, 0), timeout=10))
        await (await a.submit_single_write(2048, None, (smr, 2048), (desc2, 2048),
                                           timeout=10))
        await (await a.submit_single_write(1, None, (smr, 4095), (desc2, 4095), timeout=10))
        assert sha(dst) == sha(src)
        # One of the two freed: the other still reaches the same bytes.
        await b.free_buffer(d1)
        await (await a.submit_single_write(4096, None, (smr, 0), (desc2, 0), timeout=10))
        assert sha(dst) == sha(src)


@async_test(timeout=90)
async def test_closing_the_client_ends_every_pending_completion_typed() -> None:
    # Before the fix an expectation pending at close never ended (the node dropped it
    # with its caller, and nothing told the Completion): `await` hung for ever.
    async with engine() as b:
        a = await Client.connect("inproc://", timeout=WAIT)
        assert isinstance(a, InprocClient)
        mine = await a.expect_imm_count(4242, 3, wait=False)
        dst = np.zeros(1 << 20, np.uint8)
        _, desc = await b.reg_mr(await b.register_memory(dst))
        src = np.ones(1 << 20, np.uint8)
        smr, _ = await a.reg_mr(await a.register_memory(src))
        writes = [await a.submit_single_write(1 << 20, 9, (smr, 0), (desc, 0), timeout=20)
                  for _ in range(16)]
        await asyncio.wait_for(a.close(), WAIT)
        with pytest.raises(ConnectionLost):
            await asyncio.wait_for(mine, 5)
        ends = await asyncio.wait_for(asyncio.gather(*writes, return_exceptions=True), 5)
        assert all((r is not None and not isinstance(r, BaseException))
                   or isinstance(r, TransferdError) for r in ends), ends
        with pytest.raises(ConnectionLost):
            await a.expect_imm_count(1, 1, wait=False)


def test_a_sync_client_used_from_two_threads_and_closed_from_a_third() -> None:
    # Before the fix a thread blocked in sc.wait() when another thread closed the client
    # waited for ever (the loop stopped under its call), and any call after the close
    # raised RuntimeError("Event loop is closed").
    sc = SyncClient.connect("inproc://", timeout=WAIT)
    got: dict[str, BaseException | str] = {}
    ready = threading.Event()

    def waiter() -> None:
        e = sc.expect_imm_count(99, 2, wait=False)
        ready.set()
        try:
            sc.wait(e)
            got["wait"] = "ended without its count"
        except BaseException as exc:
            got["wait"] = exc

    def worker(name: str) -> None:
        n = 0
        try:
            while n < 10_000:  # bounded: the close ends it long before
                b = sc.alloc_buffer(4096)
                sc.set_tensor((b.id, 0, 4), name.encode()[:4].ljust(4))
                assert bytes(sc.get_tensor((b.id, 0, 4))) == name.encode()[:4].ljust(4)
                sc.free_buffer(b)
                n += 1
            got[name] = "ran out"
        except BaseException as exc:
            got[name] = exc

    threads = [threading.Thread(target=waiter), threading.Thread(target=worker, args=("one",)),
               threading.Thread(target=worker, args=("two",))]
    for t in threads:
        t.start()
    assert ready.wait(WAIT)
    closer = threading.Thread(target=sc.close)
    closer.start()
    closer.join(WAIT)
    for t in threads:
        t.join(10)
    assert not closer.is_alive() and not any(t.is_alive() for t in threads)
    assert all(isinstance(got[k], ConnectionLost) for k in ("wait", "one", "two")), got
    sc.close()  # a second close is nothing
    with pytest.raises(ConnectionLost):
        sc.alloc_buffer(16)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@async_test(timeout=60)
async def test_a_port_taken_or_a_bad_config_is_a_typed_error_with_nothing_left_running(
        tmp_path: Path) -> None:
    # Before the fix a port in use was a bare OSError naming neither the key nor the port.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        gc.collect()
        threads, fds, tasks = threading.active_count(), _open_fds(), asyncio.all_tasks()
        shares = tracing.embedded()
        with pytest.raises(BadRequest, match=f"metrics_port {port} .*in use"):
            await Client.connect("inproc://", metrics_port=port)
        with pytest.raises(BadRequest, match=rf"engine\.peer_port {port}.*in use"):
            await Client.connect("inproc://", overrides={"engine.peer_port": port})
        # What held: a bad key, a secret others can read: ConfigError naming the key.
        bad = tmp_path / "bad.toml"
        bad.write_text("[engine]\nhost_railz = '127.0.0.1'\n")
        with pytest.raises(ConfigError, match=r"engine\.host_railz: unknown key"):
            await Client.connect(f"inproc://?config={bad}")
        secret = tmp_path / "secret"
        secret.write_text("s" * 32)
        secret.chmod(0o644)
        with pytest.raises(ConfigError, match=r"engine\.secret_file.*chmod 600"):
            await Client.connect("inproc://", overrides={"engine.secret_file": str(secret)})
        # (a failed bind's socket lives in the error's frames until they are collected)
        gc.collect()
        assert threading.active_count() == threads
        assert _open_fds() == fds
        assert asyncio.all_tasks() == tasks
        # Nor a share of the spans (the next engine of the process then found them taken
        # and made none for its own log.otel).
        assert tracing.embedded() == shares
    # Two engines with every default, and two metrics ports of 0: no collision.
    async with engine() as a, engine() as b:
        assert (await a.main_address()) != (await b.main_address())
    x = await Client.connect("inproc://", metrics_port=0)
    y = await Client.connect("inproc://", metrics_port=0)
    assert isinstance(x, InprocClient) and isinstance(y, InprocClient)
    assert x.metrics_url and y.metrics_url and x.metrics_url != y.metrics_url
    await x.close()
    await y.close()


@async_test(timeout=120)
async def test_a_callback_that_blocks_the_engines_loop_costs_the_peer_a_timeout_not_bytes(
        clusters: Callable[[str], Cluster]) -> None:
    # The engine runs on the caller's loop: a receive callback that sleeps stops it.  A
    # daemon writing into the caller's array meanwhile may time out; it never lands
    # wrong bytes, and once the loop runs again every write lands whole.
    from tests.integration.test_inproc import inproc

    cl = clusters("tcp")
    async with inproc("tcp") as me:
        a = await Client.connect(client_url(cl.a), timeout=WAIT)
        try:
            size = 4 * MiB
            dst = np.zeros(size, np.uint8)
            _, desc = await me.reg_mr(await me.register_memory(dst))
            sbuf = await a.alloc_buffer(size)
            data = pattern(size, 11)
            await a.set_tensor(sbuf.tensor(), data)
            smr, _ = await a.reg_mr(sbuf)
            writes = [await a.submit_single_write(size, None, (smr, 0), (desc, 0), timeout=1.0)
                      for _ in range(4)]
            # The writes are on their way from the daemon: a callback of the user's
            # (any code on this loop) now holds the loop, past the writes' deadline.
            t0 = time.monotonic()
            asyncio.get_running_loop().call_soon(time.sleep, 3.0)
            ends = await asyncio.gather(*writes, return_exceptions=True)
            assert time.monotonic() - t0 >= 3.0
            assert all(not isinstance(e, BaseException) or isinstance(e, TransferdError)
                       for e in ends), ends
            await asyncio.sleep(0.5)
            # Whatever landed is the source's bytes, whole or in part (never foreign).
            assert sha(dst) in (sha(data), sha(bytes(size))) or all(
                dst[i:i + 65536].tobytes() in (data[i:i + 65536], bytes(65536))
                for i in range(0, size, 65536))
            dst[:] = 0
            await (await a.submit_single_write(size, None, (smr, 0), (desc, 0), timeout=10))
            assert sha(dst) == sha(data)
        finally:
            await a.close()
    cl.check_alive("after writing into an inproc engine whose loop was blocked")


@async_test(timeout=90)
async def test_a_hostile_peer_cannot_reach_past_the_callers_array() -> None:
    # A raw peer after a real handshake (no secret: a local process proving the
    # address it listens at) writes at the edges of a region over the middle of the
    # caller's array, with a wrong rkey, and with the rkey of a region freed: every one
    # is refused, the array's bytes around the region never change.
    async with engine() as me:
        whole = np.full(3 * 4096, 0xEE, np.uint8)
        mid = whole[4096:8192]  # the region: a view over the middle of the array
        buf = await me.register_memory(mid)
        _, desc = await me.reg_mr(buf)
        addr = await me.main_address()
        (_, rkey), = desc.rkeys
        base, size = desc.ptr, desc.size
        assert size == 4096
        data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8).tobytes()

        def attack() -> list[bool]:
            oks = []
            with FakePeer(addr, 0, None) as p:
                p.handshake()
                for op, (a, n) in enumerate([(base + size - 1, 2), (base - 1, 1),
                                             (base + size, 1), (base - 4096, 4096),
                                             (base, size + 1), (2 ** 64 - 1, 1)], 1):
                    oks.append(bool(p.write(rkey, [a], [n], b"\x11" * n, op=op)
                                    .body.get("ok")))
                oks.append(bool(p.write(rkey ^ 0x5A5A, [base], [1], b"\x22", op=20)
                                .body.get("ok")))
                oks.append(bool(p.write(rkey, [base], [size], data, op=21).body.get("ok")))
            return oks

        oks = await asyncio.to_thread(attack)
        assert oks == [False] * 7 + [True], oks
        assert mid.tobytes() == data
        assert not (whole[:4096] != 0xEE).any() and not (whole[8192:] != 0xEE).any()
        # Freed: its rkey is revoked at once, for a link that was up and a new one.
        await me.free_buffer(buf)

        def after_free() -> bool:
            with FakePeer(addr, 0, None) as p:
                p.handshake()
                return bool(p.write(rkey, [base], [1], b"\x33", op=1).body.get("ok"))

        assert not await asyncio.to_thread(after_free)
        assert mid.tobytes() == data  # freed: nothing more landed
        # The engine serves on: a fresh region takes a whole write.
        again = np.zeros(4096, np.uint8)
        _, desc2 = await me.reg_mr(await me.register_memory(again))
        (_, rkey2), = desc2.rkeys

        def honest() -> bool:
            with FakePeer(addr, 0, None) as p:
                p.handshake()
                return bool(p.write(rkey2, [desc2.ptr], [4096], data, op=1).body.get("ok"))

        assert await asyncio.to_thread(honest)
        assert again.tobytes() == data


@async_test(timeout=120)
async def test_a_process_killed_mid_write_and_mid_receive_leaves_the_daemon_clean() -> None:
    # The inproc process floods the daemon with writes (8 in flight) while the daemon
    # writes 32 x 1 MiB into the process's own array; SIGKILL in the middle of both.
    from tests.integration.test_inproc import _links, poll_value

    [d] = start_many([{"env": engine_env(["127.0.0.32"], secret_file=secret_file(),
                                         handshake_timeout_s=HANDSHAKE_TIMEOUT_S)}])
    proc: subprocess.Popen[str] | None = None
    try:
        assert d.metrics_url is not None
        url = d.metrics_url
        b = await Client.connect(d.url, timeout=WAIT)
        region = await b.alloc_buffer(MiB)
        mr, desc = await b.reg_mr(region)
        imm, slots = fresh_imm(), 4
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.inproc_peer", secret_file(), "127.0.0.33",
             desc.to_bytes().hex(), str(imm), str(slots), "flood"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdin is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), WAIT)
        assert line, proc.stderr.read() if proc.stderr else ""
        theirs = MrDesc.from_bytes(bytes.fromhex(json.loads(line)["desc"]))
        await asyncio.wait_for(b.expect_imm_count(imm, slots), WAIT)
        proc.stdin.write("\n")
        proc.stdin.flush()
        said = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), WAIT)
        assert said.strip() == "flooding", proc.stderr.read() if proc.stderr else ""
        into = [await b.submit_single_write(MiB, None, (mr, 0), (theirs, 0), timeout=20)
                for _ in range(32)]
        proc.kill()
        assert await asyncio.to_thread(proc.wait, WAIT) == -signal.SIGKILL
        # Every write into the gone process ends, typed or done, within its deadline.
        ends = await asyncio.wait_for(settle(into), WAIT)
        assert all(e is None or isinstance(e, TransferdError) for e in ends), ends
        assert await poll_value(lambda: _links(url, "transferd_engine_inbound_links"), 0) == 0
        assert await poll_value(lambda: _links(url, "transferd_engine_links",
                                               state="ready"), 0) == 0
        # What it counted stays as it is: nothing of the dead process counts later.
        counted = await b.imm_count(imm)
        await asyncio.sleep(1.0)
        assert await b.imm_count(imm) == counted
        # The daemon serves on.
        await b.set_tensor(region.tensor(0, 4), b"live")
        assert bytes(await b.get_tensor(region.tensor(0, 4))) == b"live"
        await b.close()
        assert d.alive()
        assert "Traceback" not in d.stderr and " ERROR " not in d.stderr, d.output()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        d.stop()


@async_test(timeout=60)
async def test_refused_expectations_and_arms_leave_no_completion_behind() -> None:
    # Before the fix an expect_imm_count or arm_paged_writes the node refused (a count
    # over 32 bits, the connection's engine.max_expectations reached, no such watcher)
    # raised, but its Completion stayed in the client's table of pending ones for ever:
    # a caller retrying a refused call grew that table without bound.
    from transferd.protocol.errors import NotFound, OverLimit
    from transferd.protocol.values import Pages

    async with engine(**{"engine.max_expectations": 4}) as a:
        held = [await a.expect_imm_count(fresh_imm(), 1, wait=False) for _ in range(4)]
        assert len(a._completions) == 4
        for _ in range(300):
            with pytest.raises(OverLimit, match="max_expectations"):
                await a.expect_imm_count(fresh_imm(), 1, wait=False)
            with pytest.raises(BadRequest, match="32-bit"):
                await a.expect_imm_count(1, 2 ** 32, wait=False)
        src = np.zeros(4096, np.uint8)
        smr, sdesc = await a.reg_mr(await a.register_memory(src))
        for _ in range(300):
            with pytest.raises(NotFound, match="watcher"):
                await a.arm_paged_writes(987654, 1, 4096, None, (smr, Pages([0], 4096, 0)),
                                         (sdesc, Pages([0], 4096, 0)))
        assert len(a._completions) == 4, len(a._completions)
        for h in held:
            assert await h.cancel()
        assert len(a._completions) == 0
        # And the node still serves: an expectation met by the counter fires.
        assert await a.imm_count(0) >= 0


@async_test(timeout=60)
async def test_an_inproc_paged_submit_over_the_page_cap_is_refused() -> None:
    # engine.max_paged_pages binds an inproc caller too (the Service counts its Pages, as
    # the wire's handler counts a request's): five pages refused whole, nothing written,
    # no Completion left behind; four land, byte for byte.
    from transferd.protocol.errors import OverLimit
    from transferd.protocol.values import Pages

    page = 4096
    async with engine(**{"engine.max_paged_pages": 4}) as a:
        src = np.frombuffer(bytearray(pattern(8 * page, 7)), dtype=np.uint8)
        dst = np.zeros(8 * page, np.uint8)
        smr, _ = await a.reg_mr(await a.register_memory(src))
        _, ddesc = await a.reg_mr(await a.register_memory(dst))
        five, four = Pages(range(5), page), Pages(range(4), page)
        for s_pages, d_pages in ((five, five), (four, five), (five, four)):
            with pytest.raises(OverLimit, match="max_paged_pages"):
                w = await a.submit_paged_writes(page, None, (smr, s_pages), (ddesc, d_pages))
                await w.wait(WAIT)
            with pytest.raises(OverLimit, match="max_paged_pages"):
                w = await a.submit_paged_reads(page, (smr, s_pages), (ddesc, d_pages))
                await w.wait(WAIT)
        assert len(a._completions) == 0
        assert not dst.any()
        await (await a.submit_paged_writes(page, None, (smr, four), (ddesc, four))).wait(WAIT)
        assert sha(dst[:4 * page]) == sha(src[:4 * page]) and not dst[4 * page:].any()


@async_test(timeout=60)
async def test_a_submit_given_up_while_it_waits_for_a_slot_leaves_nothing_behind() -> None:
    # Before the fix a submit waiting for a slot (engine.max_inflight_per_client taken)
    # whose caller gave up (asyncio.wait_for, a task cancelled) stayed in the client's
    # table of pending Completions for ever, one more per retry.
    from transferd.protocol.values import NetAddr

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # never accepted, never read: a write to it is held
    try:
        async with engine(**{"engine.max_inflight_per_client": 1,
                             "engine.peer_timeout_s": 20}) as a:
            src = np.arange(4096, dtype=np.uint8)
            smr, sdesc = await a.reg_mr(await a.register_memory(src))
            nowhere = NetAddr(0x5157, 0, (silent.getsockname(),))
            desc = MrDesc(1 << 20, [(nowhere, 0x1234)], 4096)
            held = await a.submit_single_write(4096, None, (smr, 0), (desc, 0))
            assert not held.done()
            for _ in range(50):
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        a.submit_single_write(4096, None, (smr, 0), (sdesc, 0)), 0.01)
            assert len(a._completions) == 1, len(a._completions)
            assert await held.cancel()
            assert len(a._completions) == 0
            # The slot is free again: a write to itself lands, every byte.
            dst = np.zeros(4096, np.uint8)
            _, ddesc = await a.reg_mr(await a.register_memory(dst))
            await asyncio.wait_for(
                await a.submit_single_write(4096, None, (smr, 0), (ddesc, 0)), WAIT)
            assert sha(dst) == sha(src)
    finally:
        silent.close()


@async_test(timeout=90)
async def test_immediates_used_once_each_leave_no_counter_behind() -> None:
    # A fresh immediate per transfer (a request id), each write's count consumed by its
    # expectation: before the fix every one left a counter at 0 in the node for ever,
    # so a long-running receiver's table of counters grew with every request it served.
    async with engine() as a:
        src = np.arange(4096, dtype=np.uint8)
        dst = np.zeros(4096, np.uint8)
        smr, _ = await a.reg_mr(await a.register_memory(src))
        _, ddesc = await a.reg_mr(await a.register_memory(dst))
        counter = a.service._engine().counter
        before = len(counter._counts)
        base = fresh_imm()
        for i in range(300):
            imm = base + (i + 1) * 1_000_003 % (2 ** 31)
            w = await a.submit_single_write(4096, imm, (smr, 0), (ddesc, 0))
            await asyncio.wait_for(w, WAIT)
            await asyncio.wait_for(a.expect_imm_count(imm, 1), WAIT)
            assert await a.imm_count(imm) == 0
        assert sha(dst) == sha(src)
        assert len(counter._counts) <= before + 1, len(counter._counts) - before
        # Counted once, never lost: a count not yet consumed stays, then is consumed.
        imm = base + 7
        for _ in range(3):
            await asyncio.wait_for(
                await a.submit_single_write(4096, imm, (smr, 0), (ddesc, 0)), WAIT)
        assert await a.imm_count(imm) == 3
        await asyncio.wait_for(a.expect_imm_count(imm, 2), WAIT)
        assert await a.imm_count(imm) == 1
        await asyncio.wait_for(a.expect_imm_count(imm, 1), WAIT)
        assert await a.imm_count(imm) == 0
        assert len(counter._counts) <= before + 1


@async_test(timeout=60)
async def test_receives_and_expectations_of_odd_numbers_are_refused_typed() -> None:
    # Over the wire the daemon's handlers take only unsigned integers; in process the
    # Service took what it was given: before the fix submit_recvs posted a pool of NaN,
    # 1.5 or True bytes (a NaN length in the sorted index of lengths), raised a bare
    # TypeError for a string, and expect_imm_count waited on immediate 1.5 (never met).
    import math

    async with engine() as a:
        for length, count in [("x", 1), (math.nan, 1), (True, 1), (1.5, 1), (4096, math.inf),
                              (4096, 2.0), (2 ** 64, 1), (-1, 1), (4096, 2 ** 64)]:
            with pytest.raises(BadRequest, match=r"length|count"):
                a.submit_recvs(length, count, lambda m: None)
        for imm, count in [(1.5, 1), ("a", 1), (True, 1), (1, True), (1, math.nan)]:
            with pytest.raises(BadRequest, match=r"imm|count"):
                await a.expect_imm_count(imm, count, wait=False)
        assert len(a._completions) == 0
        assert a.service._engine().receives.pools == 0
        # What is right is taken: a message to itself lands in the receive it posted.
        got: list[bytes] = []
        a.submit_recvs(4096, 1, got.append)
        msg = bytes(pattern(1000, 3))
        await asyncio.wait_for(await a.submit_send(await a.main_address(), msg), WAIT)
        for _ in range(200):
            if got:
                break
            await asyncio.sleep(0.01)
        assert [sha(m) for m in got] == [sha(msg)]


WATCHED_AND_RESIZED = r"""
import asyncio, sys, time
import numpy as np
from client import Client

async def main():
    c = await Client.connect("inproc://", timeout=10)
    pinned = 0
    for i in range(12):
        a = np.zeros(1 << 22, np.uint8)
        buf = await c.register_memory(a)
        await c.alloc_uvm_watcher(lambda o, n: None, buffer=buf, offset=(1 << 22) - 8 * (i + 1))
        await c.free_buffer(buf)
        deadline = time.monotonic() + 10
        while True:  # bounded: the watcher ends within its sweep
            try:
                a.resize(1 << 26, refcheck=False)  # the old mapping is unmapped
                break
            except ValueError:
                pinned += 1
                assert time.monotonic() < deadline, "the freed buffer stayed pinned"
                await asyncio.sleep(0.01)
        del a
        await asyncio.sleep(0.02)  # the watcher thread polls meanwhile
    await asyncio.sleep(0.3)
    await c.close()
    print("ok", pinned)

asyncio.run(main())
"""


def test_a_watched_array_freed_and_reallocated_is_never_read_again() -> None:
    # Before the fix a watcher on a registered numpy array kept polling its word after
    # free_buffer let go of the array's pins: the caller's resize(refcheck=False)
    # unmapped the old data and the watcher thread read it (SIGSEGV, the whole process).
    # Now the watcher pins the array until it ended: the resize is refused until then.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", WATCHED_AND_RESIZED],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stdout, r.stderr[-3000:])


async def _pair_of_arrays(a: InprocClient) -> tuple[Any, Any, Any, Any, Any]:
    """8 KiB source (0, 1, 2, ...) and zeroed destination arrays, registered in ``a``:
    the arrays, the source's buffer, its MR and the destination's descriptor."""
    src = np.arange(8192, dtype=np.uint8)
    dst = np.zeros(8192, np.uint8)
    sbuf = await a.register_memory(src)
    smr, _ = await a.reg_mr(sbuf)
    _, ddesc = await a.reg_mr(await a.register_memory(dst))
    return src, dst, sbuf, smr, ddesc


@async_test(timeout=60)
async def test_a_write_whose_immediate_is_not_an_integer_is_refused_typed() -> None:
    # Over the wire the daemon takes only unsigned integers; in process, before the fix,
    # imm=1.5 passed the range check and broke the peer link's encoder in a loop
    # callback (struct.error): the write never ended until its deadline.
    import math

    from transferd.protocol.values import Pages

    async with engine() as a:
        src, dst, _, smr, ddesc = await _pair_of_arrays(a)
        for imm in (1.5, math.nan, "7", -1, 2 ** 32):
            w = await a.submit_single_write(4096, imm, (smr, 0), (ddesc, 0), timeout=20)
            with pytest.raises(BadRequest, match="immediate"):
                await asyncio.wait_for(w.wait(), 5)
            p = await a.submit_paged_writes(4096, imm, (smr, Pages([0], 4096)),
                                            (ddesc, Pages([1], 4096)), timeout=20)
            with pytest.raises(BadRequest, match="immediate"):
                await asyncio.wait_for(p.wait(), 5)
        assert len(a._completions) == 0
        assert sha(dst) == sha(bytes(8192))  # nothing of those landed
        # A numpy integer is an integer: taken, counted once.
        imm = np.uint32(fresh_imm() % 2 ** 32)
        await asyncio.wait_for(
            await a.submit_single_write(8192, imm, (smr, 0), (ddesc, 0)), WAIT)
        await asyncio.wait_for(a.expect_imm_count(int(imm), 1), WAIT)
        assert sha(dst) == sha(src)


@async_test(timeout=60)
async def test_odd_offsets_and_lengths_of_watchers_and_writes_are_refused_typed() -> None:
    # Before the fix an inproc caller's float or string offset reached numpy or a slice:
    # a bare IndexError or TypeError, not the daemon's BadRequest.
    async with engine() as a:
        src, dst, sbuf, smr, ddesc = await _pair_of_arrays(a)
        for off in (8.0, "8", None):
            with pytest.raises(BadRequest, match="offset"):
                await a.alloc_uvm_watcher(lambda o, n: None, buffer=sbuf, offset=off)
        for bad in (1.5, "4096"):
            w = await a.submit_single_write(bad, None, (smr, 0), (ddesc, 0))
            with pytest.raises(BadRequest, match="length"):
                await asyncio.wait_for(w.wait(), 5)
            w = await a.submit_single_write(4096, None, (smr, bad), (ddesc, 0))
            with pytest.raises(BadRequest, match="offset"):
                await asyncio.wait_for(w.wait(), 5)
            w = await a.submit_single_write(4096, None, (smr, 0), (ddesc, bad))
            with pytest.raises(BadRequest, match="offset"):
                await asyncio.wait_for(w.wait(), 5)
        assert len(a._completions) == 0
        assert sha(dst) == sha(bytes(8192))
        got: list[tuple[int, int]] = []
        w8 = await a.alloc_uvm_watcher(lambda o, n: got.append((o, n)), buffer=sbuf,
                                       offset=np.int64(8))
        assert w8.id
        await asyncio.wait_for(
            await a.submit_single_write(np.int64(8192), None, (smr, 0), (ddesc, 0)), WAIT)
        assert sha(dst) == sha(src)


@async_test(timeout=60)
async def test_odd_page_lengths_and_scatter_fields_are_refused_typed() -> None:
    # Before the fix an inproc caller's float page_len or ScatterDst field reached a
    # slice or the peer wire's struct: a bare TypeError or struct.error, not BadRequest.
    from client import ScatterDst
    from transferd.protocol.values import Pages

    async with engine() as a:
        src, dst, _, smr, ddesc = await _pair_of_arrays(a)
        for pl in (4096.0, "4096"):
            w = await a.submit_paged_writes(pl, None, (smr, Pages([0], 4096)),
                                            (ddesc, Pages([1], 4096)))
            with pytest.raises(BadRequest, match="page length"):
                await asyncio.wait_for(w.wait(), 5)
        for d in (ScatterDst(16.0, 0, (ddesc, 0)), ScatterDst(16, 0.0, (ddesc, 0)),
                  ScatterDst(16, 0, (ddesc, 0.5))):
            w = await a.submit_scatter(None, None, smr, [d])
            with pytest.raises(BadRequest, match="scatter"):
                await asyncio.wait_for(w.wait(), 5)
        assert len(a._completions) == 0
        assert sha(dst) == sha(bytes(8192))
        w = await a.submit_scatter(None, None, smr, [ScatterDst(np.int64(16), 0, (ddesc, 32))])
        await asyncio.wait_for(w.wait(), WAIT)
        assert sha(dst[32:48]) == sha(src[:16])


@async_test(timeout=60)
async def test_an_arm_with_an_immediate_or_page_length_no_write_takes_is_refused_at_once(
) -> None:
    # An arm is checked whole when it is made (service/armed.py); before the fix its
    # immediate (-1, 1.5) and a float page length were checked only when it fired.
    from transferd.protocol.values import Pages

    async with engine() as a:
        mem = np.zeros(1 << 16, np.uint8)
        mr, desc = await a.reg_mr(await a.register_memory(mem))
        w = await a.alloc_uvm_watcher(lambda o, n: None)
        for pl, imm in ((4096.0, None), (4096, 1.5), (4096, -1), (4096, 2 ** 32)):
            with pytest.raises(BadRequest, match=r"immediate|page length"):
                await a.arm_paged_writes(w, 1, pl, imm, (mr, Pages([0], 4096)),
                                         (desc, Pages([1], 4096)))
        assert len(a._completions) == 0
        ok = await a.arm_paged_writes(w, 1, 4096, fresh_imm() % 2 ** 32,
                                      (mr, Pages([0], 4096)), (desc, Pages([1], 4096)))
        w.set(5)
        await asyncio.wait_for(ok.wait(), WAIT)


@async_test(timeout=60)
async def test_a_close_asked_while_another_closes_returns_once_the_node_is_closed() -> None:
    # Before the fix the second close returned at once: its caller went on with the
    # node still open (its rail listening, its expectation not ended yet).
    from transferd.domains.rails import parse_rail

    a = await Client.connect("inproc://", timeout=WAIT)
    mine = await a.expect_imm_count(4243, 1, wait=False)
    rail = parse_rail((await a.main_address()).rails[0])
    first = asyncio.ensure_future(a.close())
    await asyncio.sleep(0)  # (the first is under way)
    await asyncio.wait_for(a.close(), WAIT)
    assert first.done() and mine.done()
    with pytest.raises(ConnectionLost):
        await mine
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(rail, 1).close()
    await asyncio.wait_for(a.close(), WAIT)  # and a third: nothing


def test_a_sync_close_asked_while_another_thread_closes_waits_for_it() -> None:
    # A receive callback holds the engine's loop (the user's code, on its thread) while
    # one thread closes: before the fix a close from a second thread returned at once,
    # the first not even begun.
    a = SyncClient.connect("inproc://", timeout=WAIT)
    b = SyncClient.connect("inproc://", timeout=WAIT)
    try:
        held = threading.Event()

        def slow(_msg: bytes) -> None:
            held.set()
            time.sleep(0.5)

        a.submit_recvs(16, 1, slow)
        mine = a.expect_imm_count(4244, 1, wait=False)
        sent = b.submit_send(a.main_address(), b"hold")
        assert held.wait(WAIT)
        closer = threading.Thread(target=a.close)
        closer.start()
        deadline = time.monotonic() + WAIT
        while not a._closing and time.monotonic() < deadline:
            time.sleep(0.001)
        a.close()
        assert mine.done() and not closer.is_alive()
        assert isinstance(mine.exception(), ConnectionLost), mine.exception()
        b.wait(sent, WAIT)
    finally:
        a.close()
        b.close()


def test_a_sync_inproc_device_copy_is_refused_typed_without_cupy() -> None:
    # Before the fix SyncClient resolved a CuPy stream first: without CuPy the inproc
    # refusal was a ModuleNotFoundError (with it, a stream made for nothing).
    from transferd.protocol.errors import UnknownCommand

    with SyncClient.connect("inproc://", timeout=WAIT) as sc:
        buf = sc.alloc_buffer(4096)
        with pytest.raises(UnknownCommand, match="register the CuPy array"):
            sc.copy_from_device(buf.tensor(0, 16), bytearray(16))
        with pytest.raises(UnknownCommand, match="register the CuPy array"):
            sc.copy_to_device(bytearray(16), buf.tensor(0, 16))


@async_test(timeout=60)
async def test_an_inproc_memory_limit_past_the_machines_is_refused_as_serve_refuses_it(
) -> None:
    # Before the fix the node took it and promised the memory (GET_DEVICES: 95 TiB).
    from transferd.preflight import machine_memory

    total = machine_memory()
    assert total is not None
    huge = (total >> 20) * 2
    with pytest.raises(ConfigError, match=rf"memory\.host_limit_mib: {huge} MiB is more "
                       "than this machine's memory"):
        await Client.connect("inproc://", overrides={"memory.host_limit_mib": huge})
    async with engine(**{"memory.host_limit_mib": 64}) as me:
        assert (await me.get_devices())[0]["total"] == 64 << 20
