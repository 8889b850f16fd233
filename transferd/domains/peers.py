"""Which addresses each known peer authenticated with: a link is bound to its peer.

A domain group's identity (node, group) is bound to the rail addresses it proved (or,
without a cluster secret, was reached at: its node id is then those addresses',
peer_handshake.node_of) when one of its links finished the handshake, and to nothing
else while the binding lasts: a link that claims a known identity at other addresses is
refused, and so is a client's NetAddr that does (:meth:`PeerBook.get`, the group's
check_address).  This daemon's own identity is bound from the start and for good.

Bounded and expiring: at most ``limit`` peers (engine.max_peers), the least recently
bound forgotten first, and a binding not renewed by a handshake for ``ttl_s`` goes.  A
forgotten peer binds again at its next handshake, proving itself as it did the first
time: with a secret only a member of the cluster can, without one only the daemon
whose addresses its id is.  Shared by the worker (binds) and the daemon's loop
(reads); one lock for changes, reads of one entry need none.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from transferd.protocol.errors import BadRequest
from transferd.protocol.peer_handshake import PeerIdentity

# Peers one daemon remembers (engine.max_peers), and for how long after their last
# handshake.
MAX_PEERS = 16384
TTL_S = 3600.0

Key = tuple[int, int]


class PeerBook:
    def __init__(self, me: PeerIdentity, limit: int = MAX_PEERS, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._me = me
        self.limit = max(1, limit)
        self.ttl_s = ttl_s
        self._clock = clock
        # Peers by when they last bound, oldest first: key -> addresses.
        self._addrs: OrderedDict[Key, tuple[bytes, ...]] = OrderedDict()
        self._when: dict[Key, float] = {}
        self.forgotten = 0  # bindings dropped for the bound or the age (metrics, tests)

    def bind(self, peer: PeerIdentity, show: str = "") -> None:
        """Bind ``peer`` (or renew its binding); BadRequest if it contradicts one."""
        if peer.key == self._me.key:
            if peer.addrs != self._me.addrs:
                raise BadRequest(f"node {peer.node:016x}/{peer.group} is this daemon, at "
                                 f"{_show(self._me.addrs)}; a link claims it at "
                                 f"{_show(peer.addrs)}{show}")
            return
        now = self._clock()
        with self._lock:
            self._expire(now)
            known = self._addrs.get(peer.key)
            if known is not None and known != peer.addrs:
                raise BadRequest(
                    f"node {peer.node:016x}/{peer.group} is bound to {_show(known)}; "
                    f"a link claims it at {_show(peer.addrs)}{show}")
            self._addrs[peer.key] = peer.addrs
            self._addrs.move_to_end(peer.key)
            self._when[peer.key] = now
            while len(self._addrs) > self.limit:
                key, _ = self._addrs.popitem(last=False)
                del self._when[key]
                self.forgotten += 1

    def _expire(self, now: float) -> None:
        cut = now - self.ttl_s
        while self._addrs:
            key = next(iter(self._addrs))
            if self._when[key] >= cut:
                return
            del self._addrs[key], self._when[key]
            self.forgotten += 1

    def get(self, key: Key) -> tuple[bytes, ...] | None:
        if key == self._me.key:
            return self._me.addrs
        # One dict read is atomic (the writers hold the lock): every submit asks this.
        return self._addrs.get(key)

    def __len__(self) -> int:
        return len(self._addrs) + 1  # (this daemon's own binding too)


def _show(addrs: tuple[bytes, ...]) -> str:
    return ",".join(a.decode(errors="replace") for a in addrs)
