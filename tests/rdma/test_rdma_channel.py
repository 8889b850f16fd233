"""The rdma:// RC channel over a real NIC, in one process: two RcChannels of one NicHub
connected to each other (``make rdma-check``; skipped with the reason elsewhere).

Credits (#24, the rdma:// item): a paused receiver stops its sender at the receives it
posted, with no RNR, and the sender fails with Timeout after its bound; one that
resumes in time gets every message in order.  The completion-queue loop (#24.4) waits on
the channel's descriptor: no polls while idle."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tests.helpers import async_test
from transferd.protocol.errors import Timeout, TransferdError

from .conftest import DEVICES, needs_rdma

pytestmark = [pytest.mark.rdma, needs_rdma]

SLOT = 64 * 1024


class End:
    def __init__(self, hub: object) -> None:
        from transferd.rdma.channel import RcChannel

        self.got: list[bytes] = []
        self.closed: asyncio.Future[TransferdError | None] = \
            asyncio.get_running_loop().create_future()
        self.ch = RcChannel(hub, SLOT, on_message=lambda m: self.got.append(bytes(m)),  # type: ignore[arg-type]
                            on_close=self._closed)

    def _closed(self, err: TransferdError | None) -> None:
        if not self.closed.done():
            self.closed.set_result(err)


@contextlib.asynccontextmanager
async def pair() -> AsyncIterator[tuple[End, End]]:
    from transferd.rdma.channel import NicHub

    hub = NicHub(asyncio.get_running_loop(), DEVICES[0])
    a, b = End(hub), End(hub)
    a.ch.connect(b.ch.setup)
    b.ch.connect(a.ch.setup)
    try:
        yield a, b
    finally:
        a.ch.close()
        b.ch.close()
        hub.poller.close()
        hub.nic.close()


async def _settle(s: float) -> None:
    await asyncio.sleep(s)


@async_test(timeout=30, loop="asyncio")
async def test_a_paused_receiver_bounds_the_sender_and_fails_it_typed() -> None:
    async with pair() as (a, b):
        assert a.ch.flow is not None
        a.ch.flow.stall_s = 1.0
        b.ch.pause()
        for i in range(100):
            a.ch.send([memoryview(i.to_bytes(4, "big") * 256)])
        await _settle(0.3)
        assert b.got == [] and a.ch.flow.credits == 1 and not a.closed.done()
        err = await asyncio.wait_for(a.closed, 5)
        assert isinstance(err, Timeout), err


@async_test(timeout=30, loop="asyncio")
async def test_a_receiver_that_resumes_gets_every_message_in_order() -> None:
    async with pair() as (a, b):
        b.ch.pause()
        for i in range(200):
            a.ch.send([memoryview(i.to_bytes(4, "big") * 256)])
        await _settle(0.3)
        b.ch.resume()
        for _ in range(100):
            if len(b.got) == 200:
                break
            await _settle(0.05)
        assert [int.from_bytes(m[:4], "big") for m in b.got] == list(range(200))
        assert not a.closed.done() and not b.closed.done()


@async_test(timeout=30, loop="asyncio")
async def test_an_idle_nic_is_not_polled() -> None:
    async with pair() as (a, _):
        poller = a.ch.hub.poller
        assert poller.fd is not None, a.ch.hub.nic.wakeup
        await _settle(0.3)
        polls = poller.polls
        await _settle(1.0)
        assert poller.polls == polls

