"""READs into device memory between two real daemons with the stand-in device
(tests/standin_daemon.py: no host view, reached only through a stream and staging, as a
GPU's is): the bytes are received into staging and copied onto the device before the
read completes; reads *of* device memory are copied into the responder's staging and
sent from there.  Checked by checksum."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from client import Client, Pages
from tests.helpers import DaemonProcess, async_test, digest, wait_until
from tests.integration.engine_cluster import (
    engine_env,
    inflight,
    secret_file,
    standin_pair,
    stopped,
)
from transferd.protocol.errors import BadRequest

KiB = 1024
WAIT = 20.0
CHUNK, CHUNKS = 256 * KiB, 4


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    envs = []
    for rail in ("127.0.0.12", "127.0.0.13"):
        env = engine_env([rail], secret_file=secret_file())
        env.update({"STANDIN_CHUNK": str(CHUNK), "STANDIN_CHUNKS": str(CHUNKS)})
        envs.append(env)
    with standin_pair(*envs) as pair:
        yield pair


@async_test(timeout=90)
async def test_reads_into_device_memory_land_on_the_device(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    a = await Client.connect(pair[0].url)
    b = await Client.connect(pair[1].url)
    try:
        data = os.urandom(CHUNK * CHUNKS)
        host = await b.alloc_buffer(len(data))
        await b.set_tensor(host.tensor(), data)
        _, hdesc = await b.reg_mr(host, access="r")
        dev = await a.alloc_buffer(len(data), device="standin:0")
        dmr, _ = await a.reg_mr(dev)
        # A single read of the whole pool's worth (one chunk per page), at offsets.
        n = CHUNK * CHUNKS - 8192
        r = await a.submit_single_read(n, (dmr, 4096), (hdesc, 8192))
        await r.wait(WAIT)
        got = bytes(await a.get_tensor(dev.tensor(4096, n)))
        assert digest(got) == digest(data[8192:8192 + n])
        # Paged, scattered: every page on the device where it was asked.
        page = 16 * KiB
        sidx, didx = list(range(0, 40, 2)), list(range(63, 43, -1))
        r = await a.submit_paged_reads(page, (dmr, Pages(didx, page)), (hdesc, Pages(sidx, page)))
        await r.wait(WAIT)
        for s, d in zip(sidx, didx, strict=True):
            got = bytes(await a.get_tensor(dev.tensor(d * page, page)))
            assert got == data[s * page:(s + 1) * page], (s, d)
        # Staging went back: the same again works (the pool is 4 chunks).
        for _ in range(3):
            r = await a.submit_single_read(CHUNK * CHUNKS, (dmr, 0), (hdesc, 0))
            await r.wait(WAIT)
        assert digest(bytes(await a.get_tensor(dev.tensor()))) == digest(data)
        # Reads *of* device memory: the responder copies into its staging, then sends.
        dsrc = await b.alloc_buffer(len(data), device="standin:0")
        await b.set_tensor(dsrc.tensor(), data[::-1])
        _, ddesc = await b.reg_mr(dsrc, access="r")
        hdst = await a.alloc_buffer(len(data))
        hmr, _ = await a.reg_mr(hdst)
        r = await a.submit_single_read(CHUNK * CHUNKS, (hmr, 0), (ddesc, 0))
        await r.wait(WAIT)
        assert digest(bytes(await a.get_tensor(hdst.tensor()))) == digest(data[::-1])
        r = await a.submit_paged_reads(page, (hmr, Pages(didx, page)), (ddesc, Pages(sidx, page)))
        await r.wait(WAIT)
        rev = data[::-1]
        for s, d in zip(sidx, didx, strict=True):
            got = bytes(await a.get_tensor(hdst.tensor(d * page, page)))
            assert got == rev[s * page:(s + 1) * page], (s, d)
        # Device to device, staging on both sides; then a read larger than the
        # responder's whole staging is refused (BadRequest), nothing half sent.
        r = await a.submit_single_read(CHUNK, (dmr, 0), (ddesc, CHUNK))
        await r.wait(WAIT)
        assert bytes(await a.get_tensor(dev.tensor(0, CHUNK))) == rev[CHUNK:2 * CHUNK]
        big = await b.alloc_buffer(2 * CHUNK * CHUNKS, device="standin:0")
        _, bigdesc = await b.reg_mr(big, access="r")
        hbig = await a.alloc_buffer(2 * CHUNK * CHUNKS)
        hbmr, _ = await a.reg_mr(hbig)
        r = await a.submit_single_read(CHUNK * CHUNKS + 1, (hbmr, 0), (bigdesc, 0))
        with pytest.raises(BadRequest, match="larger than its staging"):
            await r.wait(WAIT)
    finally:
        await a.close()
        await b.close()


@async_test(timeout=90)
async def test_verified_traced_reads_of_and_into_device_memory(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """verify=True (issue 20) through staging on both ends: into device memory the
    reader's checksum is taken over its staging chunks as they fill, of device memory
    the responder's over its staging copy; traced too, and byte-exact."""
    a = await Client.connect(pair[0].url)
    b = await Client.connect(pair[1].url)
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    try:
        data = os.urandom(CHUNK * CHUNKS)
        dsrc = await b.alloc_buffer(len(data), device="standin:0")
        await b.set_tensor(dsrc.tensor(), data)
        _, ddesc = await b.reg_mr(dsrc, access="r")
        dev = await a.alloc_buffer(len(data), device="standin:0")
        dmr, _ = await a.reg_mr(dev)
        r = await a.submit_single_read(len(data) - 4096, (dmr, 4096), (ddesc, 0),
                                       verify=True, traceparent=tp)
        await r.wait(WAIT)
        got = bytes(await a.get_tensor(dev.tensor(4096, len(data) - 4096)))
        assert digest(got) == digest(data[:-4096])
        page = 16 * KiB
        sidx, didx = [3, 1, 9], [0, 5, 2]
        r = await a.submit_paged_reads(page, (dmr, Pages(didx, page)),
                                       (ddesc, Pages(sidx, page)), verify=True)
        await r.wait(WAIT)
        for s, d in zip(sidx, didx, strict=True):
            assert bytes(await a.get_tensor(dev.tensor(d * page, page))) == \
                data[s * page:(s + 1) * page]
    finally:
        await a.close()
        await b.close()


@async_test(timeout=90)
async def test_a_read_into_device_memory_is_listed_while_it_waits_for_staging(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """A read into device memory is in flight from its submit: while a first read holds
    every staging chunk (its peer stopped), a second is listed `queued`, waiting for
    staging, with its owner and trace id; both end byte-exact once the peer is back."""
    a = await Client.connect(pair[0].url)
    b = await Client.connect(pair[1].url)
    tid = "5bf92f3577b34da6a3ce929d0e0e4736"
    try:
        data = os.urandom(CHUNK * CHUNKS)
        host = await b.alloc_buffer(len(data))
        await b.set_tensor(host.tensor(), data)
        _, hdesc = await b.reg_mr(host, access="r")
        dev = await a.alloc_buffer(2 * len(data), device="standin:0")
        dmr, _ = await a.reg_mr(dev)
        with stopped(pair[1]):
            first = await a.submit_single_read(len(data), (dmr, 0), (hdesc, 0))
            second = await a.submit_single_read(len(data), (dmr, len(data)), (hdesc, 0),
                                                traceparent=f"00-{tid}-{'4' * 16}-01")

            def queued() -> list[dict]:
                return [e for e in inflight(pair[0])
                        if e["trace_id"] == tid and e["stage"] == "queued"]

            assert await asyncio.to_thread(wait_until, lambda: bool(queued()), WAIT)
            (e,) = queued()
            assert e["kind"] == "read" and e["what"] == "waiting for staging chunks", e
            assert e["owner"] and (e["done"], e["total"]) == (0, len(data)), e
            assert not first.done()
        await first.wait(WAIT)
        await second.wait(WAIT)
        got = bytes(await a.get_tensor(dev.tensor()))
        assert digest(got[:len(data)]) == digest(data) == digest(got[len(data):])
        assert not [e for e in inflight(pair[0]) if e["kind"] == "read"]
    finally:
        await a.close()
        await b.close()
