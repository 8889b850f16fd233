"""Transfers through the staging of one device, held up by a stopped peer, and those
of another device.

Each device (each group's stream) has its own pool of pinned staging chunks, and a
transfer takes all the chunks it needs at once, one transfer at a time, so that two
never hold half each.  That "one at a time" was one lock for the whole engine: while
a read into cuda:0 from a stopped peer held every chunk of cuda:0's pool, the next
read into cuda:0 waited for them holding the lock, and every transfer through *any*
other device's staging (another client's read into cuda:1 from a healthy peer) waited
behind it until the stopped peer's reads timed out (engine.peer_timeout_s each).  Now
the lock is per pool: the other device's read completes at once.

The stand-in device (tests/standin_daemon.py, two of them here) is reached only through
its stream and staging, as a GPU is.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest

from client import Client
from tests.helpers import DaemonProcess, async_test, digest, wait_until
from tests.integration.engine_cluster import (
    STANDIN_COMMAND,
    engine_env,
    inflight,
    secret_file,
    settle,
    start_many,
    stopped,
)
from transferd.protocol.errors import BadRequest

KiB = 1024
CHUNK, CHUNKS = 256 * KiB, 4
PEER_TIMEOUT_S = 6
WAIT = 30.0


@pytest.fixture(scope="module")
def trio() -> Iterator[list[DaemonProcess]]:
    """A (two stand-in devices), B (to be stopped) and C (healthy): host memory."""
    a_env = engine_env(["127.0.0.17"], secret_file=secret_file(), peer_timeout_s=PEER_TIMEOUT_S)
    a_env.update({"STANDIN_DEVICES": "2", "STANDIN_CHUNK": str(CHUNK),
                  "STANDIN_CHUNKS": str(CHUNKS)})
    ds = start_many([
        {"command": STANDIN_COMMAND, "env": a_env},
        {"env": engine_env(["127.0.0.18"], secret_file=secret_file())},
        {"env": engine_env(["127.0.0.19"], secret_file=secret_file())}])
    yield ds
    for d in ds:
        d.stop()
    for d in ds:
        assert "Traceback" not in d.stderr, d.output()


@async_test(timeout=120)
async def test_a_stopped_peer_holds_up_only_its_own_devices_staging(
        trio: list[DaemonProcess]) -> None:
    a_d, b_d, _ = trio
    a, b, c = [await Client.connect(d.url) for d in trio]
    try:
        whole = CHUNK * CHUNKS  # a read of this holds every chunk of its pool
        data = os.urandom(whole)
        descs = []
        for peer in (b, c):
            host = await peer.alloc_buffer(whole)
            await peer.set_tensor(host.tensor(), data)
            descs.append((await peer.reg_mr(host, access="r"))[1])
        bdesc, cdesc = descs
        dev0 = await a.alloc_buffer(2 * whole, device="standin:0")
        dev1 = await a.alloc_buffer(whole, device="standin:1")
        mr0, _ = await a.reg_mr(dev0)
        mr1, _ = await a.reg_mr(dev1)
        # Links to both peers first (a stopped peer's handshake is not the point).
        for mr, desc in ((mr0, bdesc), (mr1, cdesc)):
            await (await a.submit_single_read(4096, (mr, 0), (desc, 0))).wait(WAIT)
        with stopped(b_d):
            first = await a.submit_single_read(whole, (mr0, 0), (bdesc, 0))
            second = await a.submit_single_read(whole, (mr0, whole), (bdesc, 0))
            # The second waits for standin:0's chunks, which the first holds.
            assert await asyncio.to_thread(wait_until, lambda: any(
                e["kind"] == "read" and e["stage"] == "queued" for e in inflight(a_d)), WAIT)
            t0 = time.monotonic()
            third = await a.submit_single_read(whole, (mr1, 0), (cdesc, 0))
            await third.wait(WAIT)
            took = time.monotonic() - t0
            assert took < PEER_TIMEOUT_S / 3, f"a read through standin:1 waited {took:.1f} s"
            assert not first.done() and not second.done()
        assert digest(bytes(await a.get_tensor(dev1.tensor()))) == digest(data)
        # B is back: its reads end (landed, or timed out while it was stopped).
        await settle([first, second], WAIT * 2)
    finally:
        for cl in (a, b, c):
            await cl.close()


@async_test(timeout=60)
async def test_a_read_into_device_memory_too_large_for_its_staging_says_read(
        trio: list[DaemonProcess]) -> None:
    """Refused before anything moves, named as what it is (it said "a write from")."""
    a, c = await Client.connect(trio[0].url), await Client.connect(trio[2].url)
    try:
        whole = CHUNK * CHUNKS
        host = await c.alloc_buffer(2 * whole)
        _, desc = await c.reg_mr(host, access="r")
        dev = await a.alloc_buffer(2 * whole, device="standin:1")
        mr, _ = await a.reg_mr(dev)
        r = await a.submit_single_read(whole + 4096, (mr, 0), (desc, 0))
        with pytest.raises(BadRequest, match=f"a read into standin:1 memory needs "
                                             f"{CHUNKS + 1} staging chunks, its pool has "
                                             f"{CHUNKS}"):
            await r.wait(WAIT)
        await (await a.submit_single_read(whole, (mr, 0), (desc, 0))).wait(WAIT)  # fits
    finally:
        await a.close()
        await c.close()
