"""Write ids, at the initiator: an id's scope is the connection that submitted it.

A client names a write with an id of its own (``wid``) so that a retry lands once
(the receiver remembers each frame it applied by (initiator, id, part):
:mod:`transferd.protocol.peer_writeids`).  Ids are the clients' choice, so two
clients of one daemon may choose the same: on the wire an id is therefore the
submitting connection's own, a keyed 64-bit hash of (its connection, its id) with a
key only this daemon knows, and another client's write under the same id is another
write (it lands, and counts).  And an id names one write: a retry on the same
connection whose destination, ranges, immediate or source are not what the id first
named is refused at once (BAD_REQUEST), never taken for the first.

Bounded: at most ``window * 4`` ids remembered, each for ``ttl_s``; a retry past
either is a new write (as at the receiver).  Runs on the daemon's loop.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
import struct
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from transferd.protocol.errors import BadRequest
from transferd.protocol.peer_writeids import PEERS_WINDOWS, TTL_S, WINDOW

_pack = struct.Struct("<QQ").pack


class WriteIdScope:
    def __init__(self, clock: Callable[[], float], window: int = WINDOW,
                 ttl_s: float = TTL_S) -> None:
        self._clock = clock
        self.window = window
        self.ttl_s = ttl_s
        self._key = secrets.token_bytes(16)
        self._serials = itertools.count(1)
        self._owners: dict[Hashable, int] = {}
        # (connection serial, client's id) -> (when, what it named)
        self._named: OrderedDict[tuple[int, int], tuple[float, int]] = OrderedDict()

    def configure(self, window: int, ttl_s: float, clock: Callable[[], float]) -> None:
        self.window, self.ttl_s, self._clock = window, ttl_s, clock

    def __len__(self) -> int:
        return len(self._named)

    def wire_id(self, owner: Hashable, wid: int, what: Any) -> int:
        """The id the frames of ``owner``'s write ``wid`` carry; BadRequest if ``wid``
        named another write (``what``: its destination, ranges, immediate, source)."""
        serial = self._owners.get(owner)
        if serial is None:
            serial = self._owners[owner] = next(self._serials)
        now = self._clock()
        named = self._named
        cut = now - self.ttl_s
        while named:
            first = next(iter(named.values()))
            if first[0] >= cut:
                break
            named.popitem(last=False)
        key = (serial, wid)
        digest = hash(what)
        seen = named.get(key)
        if seen is not None and seen[1] != digest:
            raise BadRequest(f"write id {wid} named another write on this connection (other "
                             "destination, ranges, immediate or source): a write id names "
                             "one write")
        named[key] = (now, digest)
        named.move_to_end(key)
        while len(named) > self.window * PEERS_WINDOWS:
            named.popitem(last=False)
        return int.from_bytes(hashlib.blake2b(_pack(serial, wid), digest_size=8,
                                              key=self._key).digest(), "little")

    def closed(self, owner: Hashable) -> None:
        """``owner``'s connection is gone: a new connection is a new scope.  (Its ids'
        records expire with the rest: a serial is never given again.)"""
        self._owners.pop(owner, None)
