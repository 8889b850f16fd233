"""A completion queue's loop on an asyncio event loop: busy-poll for a bounded time,
then wait on the completion channel.

After work is posted (:meth:`CqPoller.kick`) or a completion event arrives, the poller
drains the queue and keeps polling until nothing has come for BUSY_POLL_S (never more than
BURST_MAX_S at once, so other callbacks run), then arms the channel (``req_notify``),
polls once more (a completion between the last poll and the arm raises no event) and
waits for the channel's descriptor to become readable: idle, it takes no CPU at all.
The descriptor comes from :mod:`.chanfd` (``CompChannel.fd`` from pyverbs 57 on, found in
/proc/self/fd before); only where it cannot be found does the poller poll every
IDLE_POLL_S instead (about a fifth of a core while idle: BUSY_POLL_S of every ms).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from .completions import Completion

BUSY_POLL_S = 200e-6
BURST_MAX_S = 2e-3
IDLE_POLL_S = 1e-3
POLL_BATCH = 64


class CqPoller:
    def __init__(self, loop: asyncio.AbstractEventLoop, cq: Any, channel: Any,
                 dispatch: Callable[[Completion], None], *, fd: int | None,
                 error: Callable[[BaseException], None] | None = None) -> None:
        """``fd``: the completion channel's descriptor (:func:`.chanfd.open_channel`),
        None to poll on a timer."""
        self.loop = loop
        self.cq = cq
        self.channel = channel
        self._dispatch = dispatch
        self._error = error
        self._kicked = False
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None
        self.fd = fd
        self.polls = 0  # ibv_poll_cq calls (the idle test counts them)
        if self.fd is not None:
            os.set_blocking(self.fd, False)
            loop.add_reader(self.fd, self._on_channel)
        else:
            self._timer = loop.call_later(IDLE_POLL_S, self._on_timer)

    def kick(self) -> None:
        """Work was posted: busy-poll soon."""
        if not self._kicked and not self._closed:
            self._kicked = True
            self.loop.call_soon(self._burst)

    def _drain(self) -> int:
        self.polls += 1
        n, wcs = self.cq.poll(POLL_BATCH)
        for wc in wcs:
            self._dispatch(Completion.from_wc(wc))
        return int(n)

    def _burst(self) -> None:
        self._kicked = False
        if self._closed:
            return
        try:
            start = now = idle_since = time.perf_counter()
            while now - idle_since < BUSY_POLL_S:
                if self._drain():
                    idle_since = time.perf_counter()
                now = time.perf_counter()
                if now - start > BURST_MAX_S:
                    self.kick()  # let other callbacks run, then go on
                    return
            if self.fd is not None:
                self.cq.req_notify()
                if self._drain():
                    self.kick()
        except Exception as exc:  # a failed poll: the device is gone
            if self._error is None:
                raise
            self._error(exc)

    def _on_channel(self) -> None:
        try:
            self.channel.get_cq_event(self.cq)
        except Exception:
            return  # EAGAIN: nothing yet
        self.cq.ack_events(1)
        self._burst()

    def _on_timer(self) -> None:
        self._burst()
        if not self._closed:
            self._timer = self.loop.call_later(IDLE_POLL_S, self._on_timer)

    def close(self) -> None:
        self._closed = True
        if self.fd is not None:
            self.loop.remove_reader(self.fd)
        if self._timer is not None:
            self._timer.cancel()
