"""TransferEngine.when_finished: a started transfer's end calls its handler at once in
_finished (after the future ended); anything else is refused (the caller's done callback
does it); a handler that raises is logged and the transfer's end goes on."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from tests.helpers import async_test
from transferd.config import EngineConfig
from transferd.engine import TransferEngine
from transferd.memory import BufferTable
from transferd.protocol.errors import PeerUnreachable

_ENTRY = SimpleNamespace(trace=None)  # what _finished reads of a Transfer here


def _engine() -> TransferEngine:
    return TransferEngine(EngineConfig(), BufferTable(1 << 20), None)


@async_test()
async def test_only_a_started_transfers_future_is_taken() -> None:
    e, loop = _engine(), asyncio.get_running_loop()
    calls: list[object] = []
    loose = loop.create_future()
    assert not e.when_finished(loose, calls.append)  # not a started transfer
    started = loop.create_future()
    e._transfers[started] = (_ENTRY, None)  # type: ignore[assignment]
    assert e.when_finished(started, calls.append)
    assert not e.when_finished(started, calls.append)  # one handler per transfer
    done = loop.create_future()
    done.set_result(None)
    e._transfers[done] = (_ENTRY, None)  # type: ignore[assignment]
    assert not e.when_finished(done, calls.append)
    task = asyncio.ensure_future(asyncio.sleep(0))
    e._transfers[task] = (_ENTRY, None)  # type: ignore[index, assignment]
    assert not e.when_finished(task, calls.append)
    await task
    assert calls == []


@async_test()
async def test_the_handler_runs_in_finished_after_the_future_ended(
        caplog: pytest.LogCaptureFixture) -> None:
    e, loop = _engine(), asyncio.get_running_loop()
    seen: list[tuple[bool, object]] = []
    ok, bad = loop.create_future(), loop.create_future()
    for f in (ok, bad):
        e._transfers[f] = (_ENTRY, None)  # type: ignore[assignment]
        e.when_finished(f, lambda f: seen.append((f.done(), f.exception())))
    e.slots.take()
    e._finished(ok, None, 0, 1, ())
    err = PeerUnreachable("gone")
    e.slots.take()
    e._finished(bad, err, 0, 2, ())
    assert seen == [(True, None), (True, err)]  # at once: no turn of the loop
    assert not e._on_end and not e._transfers

    def boom(_: object) -> None:
        raise RuntimeError("a caller's bug")

    f = loop.create_future()
    e._transfers[f] = (_ENTRY, None)  # type: ignore[assignment]
    e.when_finished(f, boom)
    e.slots.take()
    with caplog.at_level(logging.ERROR, logger="transferd"):
        e._finished(f, None, 0, 3, ())  # does not raise
    assert f.done() and f.result() is None
    assert "end handler failed" in caplog.text
