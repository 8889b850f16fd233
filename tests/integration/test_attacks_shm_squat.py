"""Another local user squats the watcher pages' lock file in /dev/shm.

/dev/shm is writable by every local user (sticky), and a daemon's lock there has a name
anyone can tell from its PID (``transferd-watch-PID.lock``, the sign its pages are in
use, judged by :func:`transferd.engine.watchers.claim` in the next daemon).  A squatter
needs no secret and no connection: one file planted under that name.
"""

from __future__ import annotations

import asyncio
import fcntl
import os

import pytest

from client import Client
from tests.conftest import DaemonFactory
from tests.helpers import async_test, wait_until

NOBODY = 65534


def _lock(pid: int) -> str:
    return f"/dev/shm/transferd-watch-{pid}.lock"


async def _works(url: str) -> str:
    """A word-page watcher made on the daemon at ``url`` and seen to change; its path."""
    async with await Client.connect(url) as c:
        got: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        w = await c.alloc_uvm_watcher(lambda o, n: got.put_nowait((o, n)))
        assert w.path is not None and os.path.exists(w.path)
        w.set(9)
        assert await asyncio.wait_for(got.get(), 5) == (0, 9)
        return w.path


@async_test(timeout=60)
async def test_a_symlink_at_the_daemons_lock_path_does_not_deny_its_watchers(
        daemon_factory: DaemonFactory) -> None:
    """Before: the lock is opened with O_NOFOLLOW, so a symlink planted there (by any
    user, before the daemon's first watcher) made every ``ALLOC_UVM_WATCHER {}`` of
    that daemon BAD_REQUEST ("Too many levels of symbolic links") for its whole life.
    Now the pages are made without that lock, with one WARNING naming the path."""
    d = daemon_factory()
    assert d.proc is not None
    lock = _lock(d.proc.pid)
    os.symlink("/nonexistent-transferd-target", lock)
    try:
        for _ in range(2):
            await _works(d.url)
        assert wait_until(lambda: "is not this daemon's" in d.stderr, 5), d.stderr[-2000:]
        assert d.stderr.count("is not this daemon's") == 1, d.stderr[-2000:]
        assert lock in d.stderr
        assert os.path.islink(lock)  # not followed, not replaced
    finally:
        os.unlink(lock)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file as another user (root only)")
@async_test(timeout=60)
async def test_another_users_lock_file_cannot_get_a_live_daemons_pages_removed(
        daemon_factory: DaemonFactory) -> None:
    """A squatter (uid nobody) makes ``transferd-watch-P.lock`` for daemon P, mode 0666,
    and holds its flock while P makes its first page, then lets go. Before: P took that
    file as its lock (root opens anyone's file) without holding it, so the next daemon
    of P's user judged P dead by that flock and removed P's live pages (a client then
    could not open the path P gave it). Now a lock file that is not P's own is none:
    neither P nor another daemon judges P by it, and P's pages stay."""
    p = daemon_factory()
    assert p.proc is not None
    lock = _lock(p.proc.pid)
    # The squatter's file (made here as root, then given to nobody) and its flock.
    held = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        async with await Client.connect(p.url) as c:  # its page lives with this connection
            try:
                os.fchown(held, NOBODY, NOBODY)
                os.fchmod(held, 0o666)
                fcntl.flock(held, fcntl.LOCK_EX)
                got: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
                w = await c.alloc_uvm_watcher(lambda o, n: got.put_nowait((o, n)))
                assert w.path is not None and os.path.exists(w.path)
            finally:
                os.close(held)  # lets go of the flock
                held = -1
            q = daemon_factory()
            await _works(q.url)  # Q's first page: it judges the pages of other PIDs
            assert os.path.exists(w.path), "a live daemon's page was removed"
            assert os.path.exists(lock)  # another user's file, left as it is
            w.set(4)  # and P's watcher works on
            assert await asyncio.wait_for(got.get(), 5) == (0, 4)
        await _works(p.url)
    finally:
        if held >= 0:
            os.close(held)
        os.unlink(lock)
