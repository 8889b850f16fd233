"""transferd/fds.py: the link budget, the rate-limited log line, the accept back-off."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import time

import pytest

from tests.helpers import async_test
from transferd import fds


def test_link_budget_leaves_the_reserve_and_counts_what_is_open() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert fds.link_budget(10, 0) == min(10, soft - fds.open_fds())
    assert fds.link_budget(1 << 30, soft) == 0  # a reserve of the whole limit: no links
    b = fds.LinkBudget(2)
    assert b.take() and b.take() and not b.take()
    assert (b.used, b.refused) == (2, 1)
    b.release()
    assert b.take()
    for _ in range(5):
        b.release()
    assert b.used == 0  # never below zero


def test_log_every_says_how_many_it_held_back(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("transferd.test.fds")
    say = fds.LogEvery(logger, interval_s=0.05)
    with caplog.at_level(logging.INFO, logger="transferd.test.fds"):
        for i in range(1000):
            say(logging.INFO, "flood %d", i)
        assert len(caplog.records) == 1
        time.sleep(0.06)
        say(logging.INFO, "flood %d", 1000)
    assert len(caplog.records) == 2
    assert "999 more like it" in caplog.records[1].getMessage()


@async_test()
async def test_accept_guard_pauses_on_emfile_and_resumes() -> None:
    loop = asyncio.get_running_loop()
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    lsock.setblocking(False)
    got: list[socket.socket] = []

    def ready() -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except BlockingIOError:
                return
            guard.accepted()
            got.append(conn)

    guard = fds.AcceptGuard(loop, lsock, ready, "test listener", logging.getLogger("t"))
    try:
        # What the accept loop does with an accept() out of descriptors: pause, then resume.
        assert guard.failed(OSError(errno.EMFILE, "Too many open files")) is True
        assert guard.paused and guard.delay == 2 * fds.BACKOFF_MIN_S
        c = socket.create_connection(lsock.getsockname())
        await asyncio.sleep(fds.BACKOFF_MIN_S / 2)
        assert got == []  # not watched while paused: it waits in the backlog
        for _ in range(100):
            await asyncio.sleep(0.01)
            if got:
                break
        assert len(got) == 1 and not guard.paused
        assert guard.delay == fds.BACKOFF_MIN_S and guard.failures == 0
        # One connection that went wrong does not pause the listener.
        assert guard.failed(OSError(errno.ECONNABORTED, "aborted")) is False
        assert not guard.paused
        for _ in range(10):  # the pause doubles, to a bound
            guard.failed(OSError(errno.ENFILE, "File table overflow"))
            guard._resume()
        assert guard.delay == fds.BACKOFF_MAX_S
        c.close()
    finally:
        guard.close()
        guard.close()  # twice is fine
        lsock.close()
        for s in got:
            s.close()
