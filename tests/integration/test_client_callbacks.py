"""The client library's callbacks, run as EVENTs arrive: what the caller's own code does
in them (raise, post again) must not break the connection or grow the client's tables.
One daemon sending to itself (its main address), real sockets."""

from __future__ import annotations

import asyncio

import pytest

from client import Client
from tests.helpers import DaemonProcess, async_test
from transferd.protocol.errors import BadRequest


@async_test(timeout=30)
async def test_a_receive_callback_that_raises_does_not_break_the_connection(
        daemon: DaemonProcess) -> None:
    # As a watcher's callback (client/engine.py) and the inproc client's receive callback:
    # the user's exception is logged; it used to escape the protocol's buffer_updated, and
    # the transport closed (ConnectionLost for every request, "user bug" as the reason).
    async with await Client.connect(daemon.url) as c:
        addr = await c.main_address()
        got: list[bytes] = []

        def cb(msg: bytes) -> None:
            got.append(msg)
            raise RuntimeError("user bug")

        c.submit_recvs(64, 2, cb)
        for msg in (b"one", b"two"):
            await asyncio.wait_for(await c.submit_send(addr, msg), 5)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while len(got) < 2 and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert got == [b"one", b"two"], got
        assert c.conn.lost is None, c.conn.lost
        buf = await c.alloc_buffer(4096)  # the connection goes on
        await c.free_buffer(buf)


@async_test(timeout=60)
async def test_a_refused_receive_post_is_forgotten(daemon: DaemonProcess) -> None:
    # Posted receives stay until the connection closes (bounded by the daemon's
    # engine.max_recv_pools), but a post the daemon refused kept its callback for good:
    # a client retrying refused posts grew the table by one entry each.
    async with await Client.connect(daemon.url) as c:
        for _ in range(20):
            c.submit_recvs(64, 0, lambda msg: None)  # count 0: BAD_REQUEST
            with pytest.raises(BadRequest):
                for _ in range(250):
                    await c.synchronize()
                    await asyncio.sleep(0.02)
        assert len(c._events.receivers) == 0, len(c._events.receivers)
        buf = await c.alloc_buffer(4096)
        await c.free_buffer(buf)
