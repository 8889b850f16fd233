"""Completion.wait: a result, an error, a timeout, a cancelled waiter; the Completion
itself is never ended by its waiter."""

import asyncio

import pytest

from client.engine import Completion
from tests.helpers import async_test
from transferd.protocol.errors import PeerUnreachable


@async_test()
async def test_wait_ended_before_returns_result_and_raises_error() -> None:
    c = Completion("w")
    c._resolve({"ok": 1})
    assert await c.wait(1.0) == {"ok": 1}
    e = Completion("e")
    e._resolve(error=PeerUnreachable("gone"))
    with pytest.raises(PeerUnreachable):
        await e.wait(1.0)
    with pytest.raises(PeerUnreachable):
        await e.wait()


@async_test()
async def test_wait_pending_then_resolved() -> None:
    c = Completion("w")
    asyncio.get_running_loop().call_later(0.01, c._resolve, 7)
    assert await c.wait(5.0) == 7
    d = Completion("d")
    asyncio.get_running_loop().call_later(0.01, d._resolve, 8)
    assert await d.wait() == 8


@async_test()
async def test_wait_timeout_leaves_completion_pending() -> None:
    c = Completion("w")
    with pytest.raises(TimeoutError):
        await c.wait(0.01)
    assert not c.done()
    c._resolve(3)  # it still ends, and a later wait sees it
    assert await c.wait(0.01) == 3


@async_test()
async def test_cancelled_waiter_leaves_completion_pending() -> None:
    c = Completion("w")
    for timeout in (None, 5.0):
        t = asyncio.ensure_future(c.wait(timeout))
        await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert not c.done()
    c._resolve(4)
    assert await c.wait() == 4
