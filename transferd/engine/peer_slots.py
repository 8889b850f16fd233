"""Engine slots per destination peer: one silent peer cannot starve the others.

The worker's slots (4,096) are shared by every client and every peer, and a
client's own share (engine.max_inflight_per_client) bounds what one client
takes.  Neither stops writes to one dead or stopped peer from holding slots
until the peer timeout while writes to healthy peers wait behind them.  So
each destination peer (a domain group: ``NetAddr.key``) may have at most
``engine.max_inflight_per_peer`` transfers in flight; a transfer to a peer at
its bound *waits here*, off the worker and without a worker slot, in that
peer's FIFO queue, and starts when one of the peer's own finishes.  The
submitting connection is not held back: its next frames (writes to other
peers included) go on at once.  A waiting transfer keeps its source memory
and counts against its client's max_inflight_per_client, so waiting is
bounded per client, and in all by :data:`MAX_WAITING`.

A transfer that waited ``timeout_s`` (the peer timeout) without starting
fails with TIMEOUT; it was never sent, so nothing of it landed.  A transfer
to several peers (a scatter, a barrier) takes a slot of each, and waits in
the queue of the first of them that is full.

Runs on the daemon's loop only (no locks).
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from transferd.protocol.errors import OverLimit, Timeout

PeerKey = tuple[int, int]
# start(releases) starts the transfer and returns its future; it calls each of
# ``releases`` once that transfer has ended (the peers' slots, the source's memory).
Start = Callable[[tuple[Callable[[], None], ...]], "asyncio.Future[None]"]

# Transfers waiting for a peer's slot, over every peer: past it a submit is
# refused (TOO_LARGE) rather than queued.
MAX_WAITING = 65536


class _Waiter:
    __slots__ = ("held", "keys", "outer", "start", "timer")

    def __init__(self, keys: frozenset[PeerKey], start: Start,
                 outer: asyncio.Future[None], held: Callable[[], None] | None) -> None:
        self.keys = keys
        self.start = start
        self.outer = outer
        self.held = held
        self.timer: asyncio.TimerHandle | None = None


class PeerSlots:
    def __init__(self, loop: asyncio.AbstractEventLoop, per_peer: int, timeout_s: float,
                 max_waiting: int = MAX_WAITING) -> None:
        self.loop = loop
        self.per_peer = per_peer
        self.timeout_s = timeout_s
        self.max_waiting = max_waiting
        self._busy: dict[PeerKey, int] = {}
        self._queues: dict[PeerKey, deque[_Waiter]] = {}
        # A waiting transfer's future -> its waiter; once started -> the transfer's own.
        self._waiters: dict[asyncio.Future[None], _Waiter] = {}
        self._started: dict[asyncio.Future[None], asyncio.Future[None]] = {}
        self.waiting = 0
        # Entries in all the queues: the waiting, and those that ended while they waited
        # (cancelled, expired), which a queue forgets only when they reach its head.
        # Past max_waiting of the latter the queues are swept (_sweep): a peer that
        # finishes nothing never brings its queue's head round, and a client cancelling
        # writes to it would otherwise grow the queue by one waiter (and what its start
        # holds: the parts, views of their source) per write.
        self._queued = 0
        # Transfers that waited for a slot, and those that gave up waiting (metrics).
        self.waited = 0
        self.expired = 0

    def in_flight(self, key: PeerKey) -> int:
        return self._busy.get(key, 0)

    def run(self, peers: Iterable[PeerKey], start: Start,
            held: Callable[[], None] | None = None) -> asyncio.Future[None]:
        """``start(releases)`` now if every peer has a slot (and nobody waits for it),
        else later.  ``held`` (the source's memory) goes once the transfer ended, or
        once it gave up waiting.

        Returns the transfer's future (``start()``'s own, or one that follows it).
        """
        keys = frozenset(peers)
        busy = self._busy
        for blocked in keys:  # _blocked(keys, queued=True), inlined: it runs per submit
            if busy.get(blocked, 0) >= self.per_peer or self._queues.get(blocked):
                break
        else:
            return self._start(keys, start, held)
        if self._queued - self.waiting >= self.max_waiting:
            self._sweep()
        if self.waiting >= self.max_waiting:
            raise OverLimit(f"{self.waiting} transfers already wait for a slot of a busy peer "
                            f"(each peer takes engine.max_inflight_per_peer = "
                            f"{self.per_peer} at a time)")
        w = _Waiter(keys, start, self.loop.create_future(), held)
        w.timer = self.loop.call_later(self.timeout_s, self._expire, w, blocked)
        self._queues.setdefault(blocked, deque()).append(w)
        self._queued += 1
        self._waiters[w.outer] = w
        w.outer.add_done_callback(self._forget)
        self.waiting += 1
        self.waited += 1
        return w.outer

    def _forget(self, outer: asyncio.Future[None]) -> None:
        w = self._waiters.pop(outer, None)
        if w is not None and w.held is not None:
            w.held()  # it never started: its source's memory goes now
        self._started.pop(outer, None)

    def started(self, fut: asyncio.Future[None]) -> asyncio.Future[None]:
        """The transfer's own future for ``fut`` (``fut`` itself unless it waited here)."""
        return self._started.get(fut, fut)

    def cancel(self, fut: asyncio.Future[None], error: BaseException) -> bool:
        """End a transfer still waiting for a slot with ``error``; False if it is not.

        Nothing of it was sent.  (The queue forgets it when it reaches the head.)
        """
        w = self._waiters.get(fut)
        if w is None or fut.done():
            return False
        self.waiting -= 1
        if w.timer is not None:
            w.timer.cancel()
        fut.set_exception(error)
        return True

    def _blocked(self, keys: frozenset[PeerKey], queued: bool) -> PeerKey | None:
        """The first peer of ``keys`` with no slot free (or, ``queued``, with a queue)."""
        for k in keys:
            if self._busy.get(k, 0) >= self.per_peer or (queued and self._queues.get(k)):
                return k
        return None

    def _start(self, keys: frozenset[PeerKey], start: Start,
               held: Callable[[], None] | None) -> asyncio.Future[None]:
        busy = self._busy
        for k in keys:
            busy[k] = busy.get(k, 0) + 1
        release = functools.partial(self._release, keys)
        try:
            # One callback for all that goes when it ends (each done callback is a
            # turn of the loop).
            return start((release,) if held is None else (release, held))
        except BaseException:
            self._release(keys)
            if held is not None:
                held()
            raise

    def _release(self, keys: frozenset[PeerKey]) -> None:
        for k in keys:
            n = self._busy.get(k, 0) - 1
            if n > 0:
                self._busy[k] = n
            else:
                self._busy.pop(k, None)
        queues = self._queues
        for k in keys:
            if queues.get(k):
                # Started on a turn of its own, never inside the end of the transfer
                # that freed the slot: that end may be a link closing, and a part
                # started there would land on the dying link and fail with its reason.
                self.loop.call_soon(self._pump, k)

    def _pump(self, key: PeerKey) -> None:
        """Start what waits for ``key`` while it has slots free (bounded by its queue)."""
        q = self._queues.get(key)
        while q and self._busy.get(key, 0) < self.per_peer:
            w = q.popleft()
            self._queued -= 1
            if w.outer.done():  # expired, or its client went away
                continue
            if w.timer is not None and w.timer.when() <= self.loop.time():
                # Its wait is over though its timer has not run yet (a slot freed by a
                # transfer timing out at the same moment): it expires, never sent.
                w.timer.cancel()
                self._expire(w, key)
                continue
            other = self._blocked(w.keys - {key}, queued=False)
            if other is not None:  # a scatter whose other peer is full: wait there
                self._queues.setdefault(other, deque()).append(w)
                self._queued += 1
                continue
            self.waiting -= 1
            self._waiters.pop(w.outer, None)
            if w.timer is not None:
                w.timer.cancel()
            held, w.held = w.held, None  # the transfer's from now on
            try:
                inner = self._start(w.keys, w.start, held)
            except Exception as exc:  # a typed error from the submit: the transfer's
                w.outer.set_exception(exc)
                continue
            self._started[w.outer] = inner
            inner.add_done_callback(functools.partial(_follow, outer=w.outer))
        if q is not None and not q and self._queues.get(key) is q:
            del self._queues[key]  # (a start that failed may have pumped it empty first)

    def _sweep(self) -> None:
        """Every queue without the waiters that ended (O(entries), run once per
        max_waiting of them: O(1) per waiter)."""
        for key, q in list(self._queues.items()):
            live = [w for w in q if not w.outer.done()]
            q.clear()  # in place: a _pump may hold this deque
            q.extend(live)
            if not q:
                del self._queues[key]
        self._queued = sum(map(len, self._queues.values()))

    def _expire(self, w: _Waiter, key: PeerKey) -> None:
        if w.outer.done():
            return
        self.waiting -= 1
        self.expired += 1
        w.outer.set_exception(Timeout(
            f"not sent: waited {self.timeout_s:g} s for one of the {self.per_peer} slots of a "
            f"peer (node {key[0]:016x}/{key[1]}) that finishes nothing "
            "(engine.max_inflight_per_peer)"))
        # The queue forgets it when it reaches the head (O(1) here).


def _follow(inner: asyncio.Future[Any], outer: asyncio.Future[None]) -> None:
    if outer.done():
        return
    if inner.cancelled():
        outer.cancel()
    elif inner.exception() is not None:
        outer.set_exception(inner.exception())  # type: ignore[arg-type]
    else:
        outer.set_result(None)
