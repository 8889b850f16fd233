"""File descriptors: the share peer links may take, and accept loops that back off.

Every peer link (outbound or inbound, any rail) is one descriptor.  The
engine's links take at most :func:`link_budget` of them: ``engine.max_links``,
and never so many that fewer than ``engine.fd_reserve`` are left below the
process's RLIMIT_NOFILE (counting what is open when the engine starts): those
stay for client connections and files.  So a flood of peer
addresses (an ADD_PEER_GROUP of forged ones) cannot leave the daemon unable
to accept its clients.

A listener whose ``accept()`` fails for lack of descriptors or memory
(EMFILE, ENFILE, ENOBUFS, ENOMEM) would be ready again at once and spin: an
:class:`AcceptGuard` stops watching it for a while instead (50 ms, doubling up
to 2 s, back to 50 ms once an accept succeeds), and says so at most once per
10 s with the count of lines it held back.  What waits meanwhile stays in the
kernel's listen backlog.

No imports beyond the standard library: the RPC transports and the peer
rails both use it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

# accept() errors that say "the process or the system is out of something",
# not "this one connection went wrong".
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
LOG_EVERY_S = 10.0


def nofile_limit() -> int:
    """The process's soft RLIMIT_NOFILE (a large number where it is unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def open_fds() -> int:
    """Descriptors this process has open now (0 where /proc is not there to say)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir opened
    except OSError:
        return 0


def link_budget(max_links: int, reserve: int) -> int:
    """How many peer links (one descriptor each) the engine may hold at once.

    ``max_links``, and never so many that, with what is open at the start (the
    listeners, the loops), fewer than ``reserve`` would be left under the limit.
    """
    return max(0, min(max_links, nofile_limit() - reserve - open_fds()))


class LogEvery:
    """A log line at most once per ``interval_s``; the next one says how many it held."""

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_EVERY_S) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.suppressed = 0
        self._next = 0.0

    def __call__(self, level: int, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self.suppressed += 1
            return
        if self.suppressed:
            msg += f" ({self.suppressed} more like it in the last {self.interval_s:g} s)"
        self.logger.log(level, msg, *args)
        self.suppressed = 0
        self._next = now + self.interval_s


class LinkBudget:
    """Peer links held now, against :func:`link_budget` (one per group, all rails)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.refused = 0

    def take(self) -> bool:
        if self.used >= self.limit:
            self.refused += 1
            return False
        self.used += 1
        return True

    def release(self) -> None:
        self.used = max(0, self.used - 1)


class AcceptGuard:
    """Watches a listening socket; backs off when accept() runs out of resources.

    ``on_ready`` is the accept loop: it calls :meth:`accepted` after each
    socket it got and :meth:`failed` with the OSError it got otherwise (True:
    stop the loop now).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 on_ready: Callable[[], None], label: str, logger: logging.Logger) -> None:
        self.loop = loop
        self.sock = sock
        self.fd = sock.fileno()
        self.on_ready = on_ready
        self.label = label
        self.log = LogEvery(logger)
        self.log_again = LogEvery(logger)  # its own: a recovery is never hidden by failures
        self.delay = BACKOFF_MIN_S
        self.failures = 0  # since the last accept that worked
        self.pauses = 0  # in all (tests and metrics)
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        loop.add_reader(self.fd, on_ready)

    @property
    def paused(self) -> bool:
        return self._timer is not None

    def accepted(self) -> None:
        if self.failures:
            self.log_again(logging.WARNING, "%s: accepting again after %d failed "
                           "accept(s)", self.label, self.failures)
            self.failures = 0
        self.delay = BACKOFF_MIN_S

    def accept_burst(self, limit: int = 64) -> Iterator[tuple[socket.socket, Any]]:
        """Up to ``limit`` accepted (socket, address) pairs, then let others run.

        Stops early when nothing is waiting, or when an accept() error paused the
        listener (out of descriptors: see :meth:`failed`); skips one that failed alone.
        """
        for _ in range(limit):
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self.failed(exc):
                    return
                continue
            self.accepted()
            yield conn, addr

    def failed(self, exc: OSError) -> bool:
        """Handle an accept() error; True if the loop must stop (the guard paused it)."""
        self.failures += 1
        if exc.errno not in RESOURCE_ERRNOS:
            # One connection that went wrong (ECONNABORTED, EPERM from a firewall):
            # the next may be fine.
            self.log(logging.INFO, "%s: accept failed: %s", self.label, exc)
            return False
        self.log(logging.WARNING, "%s: accept failed: %s; not accepting for %.2f s "
                 "(connections wait in the listen backlog)", self.label,
                 exc.strerror or exc, self.delay)
        self.pauses += 1
        self.loop.remove_reader(self.fd)
        self._timer = self.loop.call_later(self.delay, self._resume)
        self.delay = min(self.delay * 2, BACKOFF_MAX_S)
        return True

    def _resume(self) -> None:
        self._timer = None
        if not self._closed:
            self.loop.add_reader(self.fd, self.on_ready)

    def close(self) -> None:
        """Stop watching (the caller closes the socket)."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        else:
            self.loop.remove_reader(self.fd)
