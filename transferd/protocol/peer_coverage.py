"""What a receiver counts: the bytes it placed, never a number a peer wrote.

A single write split over rails arrives as parts that each name the whole
write (its span) and their own range.  :class:`Coverage` reserves each
part's range before its bytes land (a part outside the span, overlapping
another, or disagreeing with the others about the span or the immediate is
refused then) and says when the parts have covered the span, each byte once:
that is when the write counts, once.  A part re-sent on another rail (rail
failover) names exactly the range of one taken before: it is taken again,
and whichever copy lands first covers the range (the other adds nothing).

:class:`Landed` remembers the parts that landed lately, by (peer, op, part),
so that a re-sent part whose first copy had in fact landed is acknowledged
without landing or counting again.  Pure bookkeeping, no I/O; bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .errors import BadRequest

# Split writes whose parts have not all landed (their sender may have died), per
# peer: that peer's oldest is forgotten past this many, so one peer cannot push
# another's writes out.  Peers with such writes at once: past this, refused.
MAX_PARTIAL = 4096
MAX_PEERS = 1024
# Parts one split write may arrive in (the engine splits into at most 8, chaos
# into at most 8 per part).
MAX_PIECES = 64
# Ranges taken, over every peer's split writes (each costs ~140 bytes): past this the
# oldest split write of the peer holding the most ranges is forgotten, so peers
# minted by the thousand (no cluster secret) cannot hold MAX_PEERS x MAX_PARTIAL x
# MAX_PIECES of them (35 GiB).
MAX_RANGES = 1 << 18

Key = tuple[int, int, int]  # (peer node, peer group, op)


@dataclass(slots=True)
class Partial:
    span: tuple[int, int]
    imm: int | None
    ranges: list[tuple[int, int]] = field(default_factory=list)
    landed: int = 0
    # Start addresses of the ranges that landed (a re-sent copy adds nothing).
    done: set[int] = field(default_factory=set)


# WriteHeader.partial of a part that landed already: discarded, acknowledged, not counted.
DUPLICATE = Partial((0, 0), None)
# Parts remembered as landed, over every peer (the oldest forgotten first): a re-send
# comes within engine.rail_timeout_s or so of its first copy.
MAX_LANDED = 65536


PartKey = tuple[int, int, int, int]  # (peer node, peer group, op, part)


def fingerprint(addrs: list[int], lens: list[int]) -> tuple[int, int, int, int]:
    """Where a part's pages go, in brief: a re-sent copy has the same (no lie matters:
    a copy taken for one is discarded, not applied)."""
    return (addrs[0] if addrs else 0, addrs[-1] if addrs else 0, len(addrs), sum(lens))


class Landed:
    """The parts that landed lately: (peer, op, part) and where their pages went."""

    def __init__(self, limit: int = MAX_LANDED) -> None:
        self.limit = limit
        self._keys: OrderedDict[PartKey, tuple[int, int, int, int]] = OrderedDict()
        self.duplicates = 0

    def __len__(self) -> int:
        return len(self._keys)

    def seen(self, key: PartKey, where: tuple[int, int, int, int]) -> bool:
        """Whether this very part (same op, part and pages) landed already."""
        return self._keys.get(key) == where

    def add(self, key: PartKey, where: tuple[int, int, int, int]) -> None:
        self._keys[key] = where
        if len(self._keys) > self.limit:
            self._keys.popitem(last=False)


class Coverage:
    def __init__(self, max_partial: int = MAX_PARTIAL, max_pieces: int = MAX_PIECES,
                 max_peers: int = MAX_PEERS, max_ranges: int = MAX_RANGES) -> None:
        self.max_partial = max_partial
        self.max_pieces = max_pieces
        self.max_peers = max_peers
        self.max_ranges = max_ranges
        self._by_peer: dict[tuple[int, int], OrderedDict[int, Partial]] = {}
        # Ranges held by the split writes in the table, in all and per peer.
        self.ranges = 0
        self._ranges: dict[tuple[int, int], int] = {}
        self.forgotten = 0  # split writes forgotten at a bound (their sender may be gone)

    def __len__(self) -> int:
        return sum(len(t) for t in list(self._by_peer.values()))

    def reserve(self, key: Key, span: tuple[int, int], addr: int, length: int,
                imm: int | None, again: bool = False) -> Partial:
        """Claim ``[addr, addr + length)`` of the write ``key``; BadRequest if it cannot be."""
        peer, op = (key[0], key[1]), key[2]
        table = self._by_peer.get(peer)
        p = table.get(op) if table is not None else None
        if p is None:
            p = Partial(span, imm)
        elif p.span != span or p.imm != imm:
            raise BadRequest(f"write {op}: a part names span {_r(span)} and immediate "
                             f"{imm}, an earlier one {_r(p.span)} and {p.imm}")
        base, total = span
        end = addr + length
        if addr < base or end > base + total:
            raise BadRequest(f"write {op}: [0x{addr:x}, +{length}) is outside its span "
                             f"{_r(span)}")
        for s, e in p.ranges:
            if again and s == addr and e == end:  # re-sent on another rail
                return p
            if addr < e and s < end:
                raise BadRequest(f"write {op}: [0x{addr:x}, +{length}) overlaps a part "
                                 f"already taken, [0x{s:x}, +{e - s})")
        if len(p.ranges) >= self.max_pieces:
            raise BadRequest(f"write {op}: more than {self.max_pieces} parts")
        if table is None:
            if len(self._by_peer) >= self.max_peers:
                raise BadRequest(f"{self.max_peers} peers have split writes in progress here")
            table = self._by_peer[peer] = OrderedDict()
        p.ranges.append((addr, end))
        if op not in table:
            table[op] = p
            while len(table) > self.max_partial:
                self._forget(peer, table, next(iter(table)))
        self._add(peer, 1)
        while self.ranges > self.max_ranges:
            busiest = max(self._ranges, key=self._ranges.__getitem__)
            t = self._by_peer[busiest]
            self._forget(busiest, t, next(iter(t)))
        return p

    def _add(self, peer: tuple[int, int], n: int) -> None:
        self.ranges += n
        left = self._ranges.get(peer, 0) + n
        if left:
            self._ranges[peer] = left
        else:
            self._ranges.pop(peer, None)

    def _forget(self, peer: tuple[int, int], table: OrderedDict[int, Partial],
                op: int) -> None:
        """Take the split write ``op`` of ``peer`` out of the table (its ranges too)."""
        p = table.pop(op)
        self._add(peer, -len(p.ranges))
        if not table:
            del self._by_peer[peer]

    def unreserve(self, key: Key, p: Partial, addr: int, length: int) -> None:
        """A reserved part did not land (refused, or its link closed mid-payload): its
        range is free again, for a retry of the same write (write ids)."""
        r = (addr, addr + length)
        if r in p.ranges:
            p.ranges.remove(r)
            peer = (key[0], key[1])
            table = self._by_peer.get(peer)
            if table is not None and table.get(key[2]) is p:
                self._add(peer, -1)

    def landed(self, key: Key, p: Partial, nbytes: int, addr: int | None = None) -> bool:
        """``nbytes`` of a reserved part (at ``addr``) are in place; True once the span
        is covered.  A range that landed before adds nothing."""
        if addr is not None:
            if addr in p.done:
                return False
            p.done.add(addr)
        p.landed += nbytes
        if p.landed < p.span[1]:
            return False
        peer = (key[0], key[1])
        table = self._by_peer.get(peer)
        if table is not None and table.get(key[2]) is p:
            self._forget(peer, table, key[2])
        return True


def _r(span: tuple[int, int]) -> str:
    return f"[0x{span[0]:x}, +{span[1]})"
