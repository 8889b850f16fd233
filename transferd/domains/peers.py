"""Which addresses each known peer authenticated with: a link is bound to its peer.

A domain group's identity (node, group) is bound to the rail addresses it
proved (or, without a cluster secret, was reached at) the first time one of
its links finished the handshake, and to nothing else after: a link that
claims a known identity at other addresses is refused, and so is a client's
NetAddr that does (:meth:`PeerBook.check`).  This daemon's own identity is
bound from the start.  Shared by the worker (binds) and the daemon's loop
(checks); one lock.
"""

from __future__ import annotations

import threading

from transferd.protocol.errors import BadRequest
from transferd.protocol.peer_handshake import PeerIdentity

# Peers one daemon remembers; a cluster is far smaller.  Past it the book
# refuses new peers rather than forget a binding.
MAX_PEERS = 65536


class PeerBook:
    def __init__(self, me: PeerIdentity) -> None:
        self._lock = threading.Lock()
        self._addrs: dict[tuple[int, int], tuple[bytes, ...]] = {me.key: me.addrs}

    def bind(self, peer: PeerIdentity, show: str = "") -> None:
        """Remember ``peer`` (first binding wins); BadRequest if it contradicts one."""
        with self._lock:
            known = self._addrs.get(peer.key)
            if known is None:
                if len(self._addrs) >= MAX_PEERS:
                    raise BadRequest(f"this daemon knows {MAX_PEERS} peers already")
                self._addrs[peer.key] = peer.addrs
                return
        if known != peer.addrs:
            raise BadRequest(
                f"node {peer.node:016x}/{peer.group} is bound to {_show(known)}; "
                f"a link claims it at {_show(peer.addrs)}{show}")

    def get(self, key: tuple[int, int]) -> tuple[bytes, ...] | None:
        # One dict read is atomic (the writers hold the lock): every submit asks this.
        return self._addrs.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._addrs)


def _show(addrs: tuple[bytes, ...]) -> str:
    return ",".join(a.decode(errors="replace") for a in addrs)
