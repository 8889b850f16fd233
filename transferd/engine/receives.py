"""The receiving side of two-sided messages: posted receives, waiting messages, delivery.

Everything here runs on the daemon's loop (the Domains' workers hop here with
:meth:`Receives.arrive`), so nothing needs a lock.  The rules (docs/engine.md,
"Two-sided messages"):

- **Found without a scan.**  Posted receives are pools of ``count`` receives of
  one length, indexed by length (a sorted list of the lengths that have a free
  receive, bisected): a message goes to a free receive of the smallest length
  that holds it.  Pools are bounded per connection (``engine.max_recv_pools``)
  and in all (``engine.max_recv_pools_total``).
- **Delivered only to a connection that posted the receive.**  A message that
  finds every fitting receive busy waits on the connection of one of those
  receives, and only that connection can get it; with no receive posted that
  could hold it, it is refused at once (NOT_FOUND, or BAD_REQUEST when every
  posted receive is shorter).  A connection that closes takes nothing with it
  but its own messages, which fail.
- **Acknowledged once the receiving transport took it.**  The sender's SEND
  completes when the message is out of the daemon: written to a connection
  whose transport then had nothing left buffered.  Otherwise the receive stays
  busy, the ACK waits until that connection's write buffer has drained, and
  the connection gets no further message meanwhile; a reader that stops reading
  holds its senders back through their slots, not the daemon's memory.
- **Bounded, charged, expired.**  A waiting message (and one in a transport
  not yet drained) is charged to the host memory limit like a buffer
  (``memory.limit``; refused OUT_OF_MEMORY when it does not fit), at most
  ``engine.recv_waiting_max`` wait at once, and one that waited
  ``engine.recv_wait_s`` is dropped with its sender told (CANCELLED).  When the
  link it came in on dies, it is dropped (its sender's link is gone too).
- **In flight, findable.**  A message waiting for a receive, or delivered and still
  in its connection's transport, is listed by :meth:`Receives.listing` (``transferd
  inflight``: its peer, bytes, age, the sender's trace id when its SEND carried one,
  the connection it waits on) and so covered by the stall warnings.
- **No receive longer than a message can be.**  A SUBMIT_RECVS ``len`` over the
  largest message this daemon accepts (``max_length``: a SEND's 1 MiB) is clamped to
  it: such a receive takes every message that can arrive, as asked; nothing longer
  ever comes.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from transferd.domains.base import Ack
from transferd.protocol.errors import BadRequest, Cancelled, NotFound, OutOfMemory, OverLimit

from .inflight import Stage

log = logging.getLogger("transferd.engine")

# deliver(peer, msg) -> True once the connection's transport took the message
# (nothing left in its write buffer); False: it is buffered there, and
# Receives.drained(owner) follows once it is out (or closed(owner)).  A post made
# ``traced`` is called deliver(peer, msg, trace): the sender's trace id (26 bytes), or
# None when its SEND carried none.
Deliver = Callable[..., bool]
# charge(nbytes) -> release: the host memory limit's share of a waiting message
# (OutOfMemory when it does not fit); release() is idempotent.
Charge = Callable[[int], Callable[[], None]]
# What one waiting message costs beyond its bytes (the objects that hold it).
OVERHEAD = 256


@dataclass(eq=False)
class RecvPool:
    owner: Owner
    length: int
    count: int
    free: int
    # The SUBMIT_RECVS that posted it: a message goes to its pool's caller (each post
    # of a connection has its own callback, its own EVENT seq).
    deliver: Deliver
    # The post asked for each message's trace id (deliver gets it as a third argument).
    traced: bool = False


@dataclass(eq=False)
class Message:
    peer: tuple[int, int]
    data: bytes
    ack: Ack
    source: Hashable
    release: Callable[[], None]
    owner: Owner | None = None
    timer: asyncio.TimerHandle | None = None
    pool: RecvPool | None = None
    # Counted in Receives.waiting (waiting for a receive, or in a transport).
    counted: bool = False
    # The sender's trace id (its SEND's TX_EXT) and transfer number; when it came, and
    # when it was handed to its connection (time.monotonic: what is in flight).
    trace: bytes | None = None
    op: int = 0
    since: float = 0.0
    handed: float = 0.0


@dataclass(eq=False)
class Owner:
    """One client connection's receive state."""

    key: Hashable
    pools: list[RecvPool] = field(default_factory=list)
    # Messages assigned to this connection, waiting for one of its receives (in order).
    waiting: dict[Message, None] = field(default_factory=dict)
    # Delivered, in its transport's write buffer: acknowledged once that drained.
    held: list[Message] = field(default_factory=list)
    closed: bool = False

    @property
    def blocked(self) -> bool:
        return bool(self.held)


class _Index:
    """Pools by length: the smallest length >= n with a pool, in O(log n)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.by_len: dict[int, dict[RecvPool, None]] = {}

    def add(self, p: RecvPool) -> None:
        at = self.by_len.get(p.length)
        if at is None:
            at = self.by_len[p.length] = {}
            bisect.insort(self.lengths, p.length)
        at[p] = None

    def remove(self, p: RecvPool) -> None:
        at = self.by_len.get(p.length)
        if at is None or p not in at:
            return
        del at[p]
        if not at:
            del self.by_len[p.length]
            del self.lengths[bisect.bisect_left(self.lengths, p.length)]

    def __contains__(self, p: RecvPool) -> bool:
        return p in self.by_len.get(p.length, ())

    def fitting(self, n: int) -> RecvPool | None:
        """A pool of the smallest length >= n (taken in turn among pools of that length)."""
        i = bisect.bisect_left(self.lengths, n)
        if i == len(self.lengths):
            return None
        at = self.by_len[self.lengths[i]]
        p = next(iter(at))
        del at[p]  # to the back: the next message of this length goes to the next pool
        at[p] = None
        return p

    @property
    def longest(self) -> int:
        return self.lengths[-1] if self.lengths else 0


class Receives:
    def __init__(self, charge: Charge, *, max_pools: int, max_pools_total: int,
                 max_waiting: int, wait_s: float, max_length: int | None = None) -> None:
        self.charge = charge
        # The largest message that can arrive (a SEND's limit): longer receives are cut
        # to it (None: no bound, as for a unit's own tests).
        self.max_length = max_length
        self.max_pools = max_pools
        self.max_pools_total = max_pools_total
        self.max_waiting = max_waiting
        self.wait_s = wait_s
        self._owners: dict[Hashable, Owner] = {}
        self._posted = _Index()  # every pool
        self._free = _Index()  # pools with a free receive, of connections not blocked
        self._by_source: dict[Hashable, dict[Message, None]] = {}
        self.pools = 0
        # Messages waiting for a receive or for a transport to drain, and their bytes.
        self.waiting = 0
        self.waiting_bytes = 0
        self.expired = 0

    def free_receives(self) -> int:
        """Receives posted and free now, all connections together (for the metrics)."""
        return sum(p.free for o in list(self._owners.values()) for p in list(o.pools))

    # -- what clients do -------------------------------------------------------------

    def post(self, key: Hashable, length: int, count: int, deliver: Deliver,
             traced: bool = False) -> None:
        if length <= 0 or count <= 0:
            raise BadRequest("submit_recvs needs a positive length and count")
        if self.max_length is not None and length > self.max_length:
            length = self.max_length  # (no message longer than that can come)
        owner = self._owners.get(key)
        mine = len(owner.pools) if owner is not None else 0
        if mine >= self.max_pools:
            raise OverLimit(f"{mine} receive pools already posted on this connection "
                            f"(engine.max_recv_pools = {self.max_pools}): post fewer, "
                            "larger ones")
        if self.pools >= self.max_pools_total:
            raise OverLimit(f"{self.pools} receive pools are posted on this daemon "
                            f"(engine.max_recv_pools_total = {self.max_pools_total})")
        if owner is None:
            owner = self._owners[key] = Owner(key)
        pool = RecvPool(owner, length, count, count, deliver, traced)
        owner.pools.append(pool)
        self.pools += 1
        self._posted.add(pool)
        if not owner.blocked:
            self._free.add(pool)
        self._pump(owner)

    def drained(self, key: Hashable) -> None:
        """The connection's write buffer is empty: its held messages are out."""
        owner = self._owners.get(key)
        if owner is None or not owner.held:
            return
        held, owner.held = owner.held, []
        for m in held:
            self._done(m, None, pump=False)
        if not owner.blocked:
            for p in owner.pools:
                if p.free:
                    self._free.add(p)
            self._pump(owner)

    def closed(self, key: Hashable) -> None:
        """The connection is gone: its receives go, and its messages fail."""
        owner = self._owners.pop(key, None)
        if owner is None:
            return
        owner.closed = True
        for p in owner.pools:
            self._posted.remove(p)
            self._free.remove(p)
        self.pools -= len(owner.pools)
        owner.pools.clear()
        held, owner.held = owner.held, []
        for m in held:
            self._done(m, Cancelled("the receiving connection closed before the message was "
                                    "out of its daemon"))
        for m in list(owner.waiting):
            self._done(m, Cancelled("the receiving connection closed while the message "
                                    "waited for one of its receives"))

    # -- what peers do -----------------------------------------------------------------

    def arrive(self, peer: tuple[int, int], data: bytes, ack: Ack,
               source: Hashable = None, trace: bytes | None = None, op: int = 0) -> None:
        """A message from ``peer`` (on link ``source``); ``ack`` tells its sender;
        ``trace`` the sender's trace id, ``op`` its transfer (what is in flight)."""
        n = len(data)
        now = time.monotonic()
        pool = self._free.fitting(n)
        if pool is not None:
            self._hand(pool, Message(peer, data, ack, source, _nothing, trace=trace, op=op,
                                     since=now))
            return
        pool = self._posted.fitting(n)
        if pool is None:
            if self._posted.lengths:
                ack(BadRequest(f"message of {n} bytes is larger than every posted receive "
                               f"buffer (at most {self._posted.longest})"))
            else:
                ack(NotFound(f"no receive is posted on this daemon for a message of {n} "
                             "bytes (post SUBMIT_RECVS before the sender sends)"))
            return
        # Every receive that could hold it is busy: it waits for one of them.
        if self.waiting >= self.max_waiting:
            ack(OverLimit(f"{self.waiting} messages already wait for a receive here "
                          f"(engine.recv_waiting_max = {self.max_waiting})"))
            return
        try:
            release = self.charge(n + OVERHEAD)
        except OutOfMemory as exc:
            ack(OutOfMemory(f"a message of {n} bytes cannot wait for a receive: "
                            f"{exc.message}"))
            return
        m = Message(peer, data, ack, source, release, owner=pool.owner, trace=trace, op=op,
                    since=now)
        self._count(m)
        pool.owner.waiting[m] = None
        m.timer = asyncio.get_running_loop().call_later(self.wait_s, self._expire, m)

    def sender_gone(self, source: Hashable) -> None:
        """The link ``source`` closed: the messages that came in on it and wait go."""
        for m in list(self._by_source.get(source, ())):
            if m.pool is None:  # (one already in a transport stays until it drained)
                self._done(m, Cancelled("the sender's link closed"))

    def listing(self) -> Iterator[tuple[Hashable, dict[str, Any]]]:
        """What is in flight here (an :class:`~.inflight.InFlight` source): each message
        waiting for a receive, and each handed to a connection whose transport has not
        drained ("delivering"), with its peer, bytes, age and trace id."""
        for owner in list(self._owners.values()):
            for m in list(owner.waiting):
                yield ("recv", m), _entry(m, owner, Stage.WAITING_RECV, m.since)
            for m in list(owner.held):
                yield ("recv", m), _entry(m, owner, Stage.DELIVERING, m.handed)

    # -- internals ---------------------------------------------------------------------

    def _count(self, m: Message) -> None:
        m.counted = True
        self.waiting += 1
        self.waiting_bytes += len(m.data)
        self._by_source.setdefault(m.source, {})[m] = None

    def _uncount(self, m: Message) -> None:
        m.counted = False
        self.waiting -= 1
        self.waiting_bytes -= len(m.data)
        by = self._by_source.get(m.source)
        if by is not None:
            by.pop(m, None)
            if not by:
                del self._by_source[m.source]

    def _hand(self, pool: RecvPool, m: Message) -> None:
        """Give ``m`` to one receive of ``pool`` (free, its connection not blocked)."""
        owner = pool.owner
        pool.free -= 1
        if not pool.free:
            self._free.remove(pool)
        owner.waiting.pop(m, None)
        if m.timer is not None:
            m.timer.cancel()
            m.timer = None
        m.owner, m.pool = owner, pool
        try:
            taken = (pool.deliver(m.peer, m.data, m.trace) if pool.traced
                     else pool.deliver(m.peer, m.data))
        except Exception as exc:  # the connection's write failed: this one is lost
            log.exception("delivering a message failed")
            self._done(m, Cancelled(f"the receiving connection failed: {exc!r}"))
            return
        if taken:
            self._done(m, None)
            return
        m.handed = time.monotonic()
        if not m.counted:  # in the transport now: counted and charged until it drained
            # (Already written: over the limit it is not taken back, only not charged.)
            with contextlib.suppress(OutOfMemory):
                m.release = self.charge(len(m.data) + OVERHEAD)
            self._count(m)
        owner.held.append(m)
        # Nothing more for this connection until its transport drained.
        for p in owner.pools:
            self._free.remove(p)

    def _done(self, m: Message, error: Exception | None, pump: bool = True) -> None:
        """``m`` leaves: its sender is told, its charge and its receive go back."""
        if m.timer is not None:
            m.timer.cancel()
            m.timer = None
        owner = m.owner
        if owner is not None:
            owner.waiting.pop(m, None)
        if m.counted:
            self._uncount(m)
        release, m.release = m.release, _nothing
        release()
        pool, m.pool = m.pool, None
        if pool is not None:
            pool.free += 1
            if not pool.owner.blocked and not pool.owner.closed:
                self._free.add(pool)
        m.ack(error)  # type: ignore[arg-type]
        if pump and pool is not None and error is None:
            self._pump(pool.owner)

    def _pump(self, owner: Owner) -> None:
        """Hand ``owner``'s waiting messages to its free receives, in order, while it can."""
        for _ in range(len(owner.waiting)):
            if owner.blocked or owner.closed or not owner.waiting:
                return
            m = next(iter(owner.waiting))
            pool = _free_fit(owner, len(m.data))
            if pool is None:
                return  # the first waits for a receive long enough; the rest after it
            self._hand(pool, m)

    def _expire(self, m: Message) -> None:
        m.timer = None
        if m.owner is None or m not in m.owner.waiting:
            return
        self.expired += 1
        self._done(m, Cancelled(f"no receive became free within {self.wait_s:g} s "
                                "(engine.recv_wait_s): the message was dropped undelivered"))


def _free_fit(owner: Owner, n: int) -> RecvPool | None:
    best: RecvPool | None = None
    for p in owner.pools:  # at most engine.max_recv_pools
        if p.free and p.length >= n and (best is None or p.length < best.length):
            best = p
    return best


def _entry(m: Message, owner: Owner, stage: Stage, since: float) -> dict[str, Any]:
    # (Two-sided messages go on rail 0, on both daemons: Engine.submit_send.)
    return {"kind": "incoming send", "op": m.op, "trace": m.trace, "started": m.since,
            "since": since, "stage": stage, "peer": m.peer[0], "rails": (0,),
            "progress": (len(m.data) if stage is Stage.DELIVERING else 0, len(m.data)),
            "owner": owner.key}


def _nothing() -> None:
    pass
