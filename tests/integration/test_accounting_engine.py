"""What the engine holds is counted, and let go: writes to a silent peer, writes in flight
when their region is deregistered or freed.  Live daemons; the peer is a real daemon or a
socket driven by hand.

The hand-driven peer speaks the peer plane of transferd/protocol/peer.py (the handshake,
then a WRITE whose payload it sends in two halves), so a test can hold a write half-landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import signal
import socket
from typing import Any

import pytest

from client import Client
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, async_test, pattern, rss, wait_until
from tests.integration.fake_peer import Ack, FakePeer, data_frame
from tests.integration.test_accounting import OVERHEAD, device
from transferd.memory import charge_of
from transferd.protocol.errors import Timeout
from transferd.protocol.peer import PeerCommand
from transferd.protocol.values import MrDesc, NetAddr

MiB = 1 << 20


@async_test(timeout=60)
async def test_a_write_to_a_silent_peer_is_let_go_after_the_client_has_gone(
    daemon_factory: DaemonFactory,
) -> None:
    """The peer accepts and never answers: the buffer stays charged while the write is in
    flight, then its memory and charge come back, with nobody left to free them."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # never accepted, never read: the kernel completes the connects
    d = daemon_factory(["-m", "128"], env={"TRANSFERD_ENGINE_PEER_TIMEOUT_S": "1"})
    ctl = RawConn.to(d)
    ctl.hello()
    base = rss(d)
    size = 64 * MiB
    try:
        async with await Client.connect(d.url) as c:
            buf = await c.alloc_buffer(size)
            await c.buffer_clear(buf, 9)  # every page resident
            mr, _ = await c.reg_mr(buf)
            nowhere = NetAddr(0x5157, 0, (silent.getsockname(),))
            desc = MrDesc(1 << 20, [(nowhere, 0x1234)], size)
            done = await c.submit_single_write(size, None, (mr, 0), (desc, 0))
            await c.free_buffer(buf)
            assert not done.done()
        # The client is gone; the write is still held, and counted as held.
        assert device(ctl)["free"] == 128 * MiB - charge_of(size)
        assert rss(d) - base <= 128 * MiB + OVERHEAD
        assert wait_until(lambda: device(ctl)["free"] == 128 * MiB, timeout=15), device(ctl)
        assert wait_until(lambda: rss(d) - base <= OVERHEAD, timeout=5), rss(d) - base
    finally:
        silent.close()


class HandPeer:
    """One rail's link to a daemon, driven frame by frame."""

    def __init__(self, dst: NetAddr) -> None:
        # Through the peer handshake first (the daemon has no secret: it probes the
        # address the fake peer claims, where the fake peer listens).
        self._fake = FakePeer(dst, 0, None)
        self._fake.handshake()
        self.sock = self._fake.conn.sock

    def recv(self) -> Ack:
        """The next ACK (ConnectionError if the daemon closed the link)."""
        return self._fake.recv()

    def write_header(self, op: int, desc: MrDesc, offset: int, length: int) -> None:
        """A WRITE's header alone: its payload is the test's to send, or not."""
        self.sock.sendall(data_frame(PeerCommand.WRITE, {
            "op": op, "part": 0, "rkey": desc.rkeys[0][1], "addrs": [desc.ptr + offset],
            "lens": [length]}))


async def _landing(c: Client, buf: Any, first: bytes) -> bool:
    return bytes(await c.get_tensor(buf.tensor(0, len(first)))) == first


@pytest.mark.parametrize("how", ["dereg_mr", "free_buffer"])
@async_test(timeout=60)
async def test_a_write_in_flight_lands_before_dereg_returns_and_none_after(
    daemon: DaemonProcess, how: str
) -> None:
    size, half = 64 * MiB, 32 * MiB
    data = pattern(size, 7)
    async with await Client.connect(daemon.url) as c:
        buf = await c.alloc_buffer(size)
        mr, desc = await c.reg_mr(buf)
        peer = await asyncio.to_thread(HandPeer, desc.rkeys[0][0])
        peer.write_header(1, desc, 0, size)
        await asyncio.to_thread(peer.sock.sendall, data[:half])
        # The write was admitted and is landing: its first bytes are in the buffer.
        for _ in range(200):
            if await _landing(c, buf, data[:64]):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the first half never landed")
        ender = asyncio.ensure_future(
            c.dereg_mr(mr) if how == "dereg_mr" else c.free_buffer(buf))
        await asyncio.sleep(0.3)
        assert not ender.done(), f"{how} returned while an admitted write was half-landed"
        await asyncio.to_thread(peer.sock.sendall, data[half:])
        ack = await asyncio.to_thread(peer.recv)
        assert ack.cmd == PeerCommand.ACK and ack.body.get("ok") is True, ack.body  # told: landed
        await asyncio.wait_for(ender, 10)
        if how == "dereg_mr":
            got = bytes(await c.get_tensor(buf.tensor()))
            assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
        # A write after it is refused, and its initiator is told so.
        peer.write_header(2, desc, 0, 4096)
        await asyncio.to_thread(peer.sock.sendall, b"\xff" * 4096)
        nack = await asyncio.to_thread(peer.recv)
        assert nack.cmd == PeerCommand.ACK and nack.body.get("code") == "NOT_FOUND", nack.body
        if how == "dereg_mr":
            assert bytes(await c.get_tensor(buf.tensor(0, 4096))) == data[:4096]
            await c.free_buffer(buf)
        peer.sock.close()


@async_test(timeout=60)
async def test_a_write_stalled_mid_payload_is_cut_short_by_dereg(
    daemon_factory: DaemonFactory,
) -> None:
    """A peer that sends half a write and stalls holds DEREG_MR only for peer_timeout_s:
    then its link is closed and nothing more of it lands."""
    d = daemon_factory(env={"TRANSFERD_ENGINE_PEER_TIMEOUT_S": "1"})
    size, half = 8 * MiB, 4 * MiB
    data = pattern(size, 9)
    async with await Client.connect(d.url) as c:
        buf = await c.alloc_buffer(size)
        mr, desc = await c.reg_mr(buf)
        peer = await asyncio.to_thread(HandPeer, desc.rkeys[0][0])
        peer.write_header(1, desc, 0, size)
        await asyncio.to_thread(peer.sock.sendall, data[:half])
        for _ in range(200):
            if await _landing(c, buf, data[:64]):
                break
            await asyncio.sleep(0.01)
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(c.dereg_mr(mr), 10)
        waited = asyncio.get_running_loop().time() - t0
        assert 0.5 <= waited <= 5, waited
        before = hashlib.sha256(bytes(await c.get_tensor(buf.tensor()))).digest()
        with contextlib.suppress(OSError):  # the daemon closed the link
            peer.sock.settimeout(2)
            peer.sock.sendall(data[half:])
        await asyncio.sleep(0.2)
        after = hashlib.sha256(bytes(await c.get_tensor(buf.tensor()))).digest()
        assert after == before  # nothing landed after DEREG_MR returned
        peer.sock.close()
        await c.free_buffer(buf)
    assert d.alive()


@async_test(timeout=90)
async def test_a_write_to_a_peer_that_stops_reading_is_let_go_after_the_timeout(
    daemon_factory: DaemonFactory,
) -> None:
    """The peer shook hands, then stopped (SIGSTOP: its kernel buffers a little, then reads
    nothing). The write times out; the link still holding its unsent bytes is closed, so the
    freed buffer's memory and charge come back with the client gone."""
    a = daemon_factory(["-m", "128"], env={"TRANSFERD_ENGINE_PEER_TIMEOUT_S": "1"})
    b = daemon_factory()
    assert b.proc is not None
    ctl = RawConn.to(a)
    ctl.hello()
    base = rss(a)
    size = 64 * MiB
    try:
        async with await Client.connect(a.url) as ca, await Client.connect(b.url) as cb:
            dst = await cb.alloc_buffer(size)
            _, desc = await cb.reg_mr(dst)
            src = await ca.alloc_buffer(size)
            await ca.buffer_clear(src, 3)
            mr, _ = await ca.reg_mr(src)
            # The link is up (handshake done), then the peer stops.
            await (await ca.submit_single_write(4096, None, (mr, 0), (desc, 0))).wait(20)
            b.proc.send_signal(signal.SIGSTOP)
            done = await ca.submit_single_write(size, None, (mr, 0), (desc, 0))
            await ca.free_buffer(src)
            assert device(ctl)["free"] == 128 * MiB - charge_of(size)  # held, and counted
            with pytest.raises(Timeout):
                await done.wait(20)
        assert wait_until(lambda: device(ctl)["free"] == 128 * MiB, timeout=10), device(ctl)
        assert wait_until(lambda: rss(a) - base <= OVERHEAD, timeout=5), rss(a) - base
    finally:
        b.proc.send_signal(signal.SIGCONT)
    assert a.alive() and b.alive()
