"""Peer groups (ADD_PEER_GROUP): named sets of peers a scatter or barrier must stay in.

Each group belongs to the connection that made it and goes with it; both the number of
groups per connection (engine.max_peer_groups) and the peers per group
(engine.max_group_peers) are bounded.  Membership is by node: a peer daemon's regions
may be in any of its host groups.  Runs on the daemon's loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

from transferd.protocol.errors import BadRequest, NotFound, OverLimit
from transferd.protocol.values import MrDesc, NetAddr


class PeerGroups:
    def __init__(self, max_groups: int, max_peers: int, max_total: int = 1 << 18) -> None:
        self.max_groups = max_groups  # per connection
        self.max_peers = max_peers  # per group
        # Addresses of every connection's groups together: the per-connection bounds times
        # as many connections as a client opens was no bound.
        self.max_total = max_total
        self._total = 0
        self._groups: dict[int, tuple[NetAddr, ...]] = {}
        self._of: dict[Hashable, set[int]] = {}  # by the connection that made them
        self._ids = itertools.count(1)

    def room(self, peers: int, owner: Hashable) -> None:
        """OverLimit unless ``owner`` may make one more group of ``peers`` peers."""
        if peers > self.max_peers:
            raise OverLimit(f"a peer group of {peers} addresses is over "
                            f"engine.max_group_peers = {self.max_peers}")
        mine = self._of.get(owner, ())
        if len(mine) >= self.max_groups:
            raise OverLimit(f"{len(mine)} peer groups already made on this connection "
                            f"(engine.max_peer_groups = {self.max_groups})")
        if self._total + peers > self.max_total:
            raise OverLimit(f"a peer group of {peers} addresses would make this daemon's "
                            f"groups name {self._total + peers}, all connections together, "
                            f"over engine.max_group_peers_total = {self.max_total}")

    def add(self, addrs: Sequence[NetAddr], owner: Hashable) -> int:
        """A new group of ``addrs`` (already checked) for ``owner``: its id."""
        self.room(len(addrs), owner)
        mine = self._of.setdefault(owner, set())
        gid = next(self._ids)
        self._groups[gid] = tuple(addrs)
        self._total += len(addrs)
        mine.add(gid)
        return gid

    def check(self, gid: int | None, descs: Sequence[MrDesc]) -> None:
        """Every destination of ``descs`` on a peer of group ``gid`` (None: no group)."""
        if gid is None:
            return
        peers = self._groups.get(gid)
        if peers is None:
            raise NotFound(f"no peer group {gid}")
        nodes = {p.node for p in peers}
        for d in descs:
            if d.node[0] not in nodes:
                raise BadRequest(f"destination 0x{d.ptr:x} is not on a peer of group {gid}")

    def closed(self, owner: Hashable) -> None:
        """``owner``'s connection is gone: its groups go."""
        for gid in self._of.pop(owner, ()):
            gone = self._groups.pop(gid, None)
            if gone is not None:
                self._total -= len(gone)
