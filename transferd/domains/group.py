"""A DomainGroup: the 1 to 4 rails of one GPU (or of host memory), on one worker.

It shards each transfer's parts over its rails (the plan already says which
rail), and on the receiving side checks every incoming write against the
region table, lands it, and counts its immediate.  Everything here runs on
the group's worker loop; the region table and the ImmCounter are the only
things shared with the daemon's loop, and both are thread safe.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transferd.engine.immcounter import ImmCounter
from transferd.engine.landing import Coverage
from transferd.engine.plan import SendPart, WritePart
from transferd.engine.regions import RegionTable
from transferd.engine.transfer import Transfer
from transferd.logs import peer_warning
from transferd.memory import Ref
from transferd.protocol.errors import BadRequest, Timeout, TransferdError
from transferd.protocol.peer import WriteHeader
from transferd.protocol.peer_handshake import DEFAULT_TIMEOUT as DEFAULT_HANDSHAKE_TIMEOUT
from transferd.protocol.peer_handshake import PeerIdentity
from transferd.protocol.values import NetAddr

from .peers import PeerBook
from .tcp import TcpDomain, check_rail, rail_bytes

# deliver(peer, message, ack): ``ack(None)`` once a client has the message,
# ``ack(error)`` if it cannot have it; ``ack`` may be called from any thread.
Ack = Callable[["TransferdError | None"], None]
Deliver = Callable[[tuple[int, int], bytes, Ack], None]


@dataclass(frozen=True)
class Chaos:
    """Deliver out of order on purpose: random delays, every write in pieces."""

    seed: int = 0
    max_delay_s: float = 0.005
    max_parts: int = 8


class DomainGroup:
    def __init__(
        self,
        index: int,
        node: int,
        loop: asyncio.AbstractEventLoop,
        regions: RegionTable,
        counter: ImmCounter,
        deliver: Deliver,
        *,
        timeout_s: float = 30.0,
        chaos: Chaos | None = None,
        secret: bytes | None = None,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT,
    ) -> None:
        self.index = index
        self.node = node
        self.loop = loop
        self.regions = regions
        self.counter = counter
        self.deliver = deliver
        self.timeout_s = timeout_s
        self.chaos = chaos
        # The cluster secret every link proves (None: links can only be held
        # to the addresses they claim; see peer_handshake).
        self.secret = secret or None
        self.handshake_timeout_s = handshake_timeout_s
        self._rng = random.Random(chaos.seed if chaos else 0)
        self.domains: list[TcpDomain] = []
        self.coverage = Coverage()
        self._book: PeerBook | None = None
        self.bytes_in = 0
        # Receiver-side tallies, read by the metrics when scraped (transferd.metrics).
        self.writes_in = 0
        self.imms_in = 0
        self.messages_in = 0
        self.refused: dict[str, int] = {}

    def bind(self, hosts: list[str], port: int = 0) -> NetAddr:
        """Open one rail per host; rail i of every peer connects to our rail i."""
        for i, host in enumerate(hosts):
            self.domains.append(TcpDomain(self, i, host, port if port and i == 0 else 0))
        return self.address

    @property
    def book(self) -> PeerBook:
        """Who authenticated with which addresses; made once the rails are bound."""
        if self._book is None:
            self._book = PeerBook(self.identity)
        return self._book

    @property
    def address(self) -> NetAddr:
        return NetAddr(self.node, self.index, tuple((d.host, d.port) for d in self.domains))

    @property
    def identity(self) -> PeerIdentity:
        return PeerIdentity(self.node, self.index,
                            tuple(rail_bytes(d.host, d.port) for d in self.domains))

    def bind_peer(self, peer: PeerIdentity) -> None:
        """A link authenticated ``peer``: bind it (BadRequest if it contradicts a binding)."""
        self.book.bind(peer)

    def hello_body(self, rail: int) -> dict[str, Any]:
        """The verbs Domain's set-up HELLO (tcp links run peer_handshake instead)."""
        return {"node": self.node, "group": self.index, "rail": rail, "rails": len(self.domains)}

    def rail_address(self, rail: int) -> NetAddr:
        return self.address.rail(rail)

    def check_address(self, addr: NetAddr, first_rail: int = 0) -> None:
        """Refuse a client's NetAddr that names a known peer at other addresses.

        ``addr`` lists rails ``first_rail``, ``first_rail + 1``, ... of its peer
        (a main address lists them all, an MrDesc's rkey entry one).  Called on
        the daemon's loop, before anything is planned.
        """
        rails = [rail_bytes(*check_rail(h, p)) for h, p in addr.rails]
        known = self.book.get(addr.key)
        if known is None:
            return
        want = known[first_rail:first_rail + len(rails)]
        if tuple(rails) != want:
            mine = " (this daemon)" if addr.key == (self.node, self.index) else ""
            raise BadRequest(
                f"node {addr.node:016x}/{addr.group}{mine} is at "
                f"{','.join(w.decode() for w in want)}, not at "
                f"{','.join(r.decode() for r in rails)}")

    # -- initiator side ---------------------------------------------------------

    def execute(self, transfer: Transfer, parts: list[WritePart | SendPart]) -> None:
        transfer.timer = self.loop.call_later(self.timeout_s, self._timed_out, transfer, parts)
        if not parts:
            transfer.part_done()
            return
        for part in parts:
            domain = self.domains[part.rail]
            if self.chaos is not None:
                delay = self._rng.uniform(0, self.chaos.max_delay_s)
                self.loop.call_later(delay, domain.post, part, transfer)
            else:
                domain.post(part, transfer)

    def _timed_out(self, transfer: Transfer, parts: list[WritePart | SendPart]) -> None:
        err = Timeout(f"transfer {transfer.op} not acknowledged in {self.timeout_s:g} s")
        rail = parts[0].rail if parts else 0
        dst = parts[0].dst if parts else None
        peer_warning("transfer timed out", dst.node if dst else None, rail,
                     dst.rails[0] if dst and dst.rails else None, err)
        transfer.fail(err)
        # A link still holding unsent bytes after that long has a peer that reads
        # nothing: closed, so the memory those bytes lie in can go back.
        for key in {(p.rail, p.dst.key): (p.rail, p.dst) for p in parts}.values():
            self.domains[key[0]].drop_stalled(key[1], err)

    def connect(self, addr: NetAddr) -> None:
        """Open every rail's link to a peer now, ahead of the first transfer."""
        for rail, domain in enumerate(self.domains):
            if rail < len(addr.rails):
                domain.link_to(addr.rail(rail))

    # -- receiver side ------------------------------------------------------------

    def write_views(self, rail: int, peer: tuple[int, int], w: WriteHeader,
                    payload_len: int) -> list[memoryview]:
        """Check a WRITE against its region, page by page, before any byte lands."""
        views, admitted = self.admit_write(rail, peer, w, payload_len)
        admitted.release()  # a check only: whoever lands bytes holds admit_write's Ref
        return views

    def admit_write(self, rail: int, peer: tuple[int, int], w: WriteHeader,
                    payload_len: int, abort: Callable[[], None] | None = None
                    ) -> tuple[list[memoryview], Ref]:
        """Check a WRITE, then admit it: the Ref holds the region until it has landed.

        Release the Ref once the bytes are in place or the write failed;
        DEREG_MR and FREE_BUFFER wait for it, and refuse writes admitted after.
        A part of a split single write also reserves its range of the write's
        span (refused if it is outside or overlaps a part already taken).
        """
        region = self.regions.by_rkey(w.rkey, rail)
        addrs, lens = w.addrs, w.lens
        if lens and min(lens) == max(lens):
            # Pages of one length (a paged write, or one part of a single write).
            views = region.views(addrs, lens[0])
            total = lens[0] * len(views)
        else:
            views = [region.view(a, n) for a, n in zip(addrs, lens, strict=True)]
            total = sum(map(len, views))
        if total != payload_len:
            raise BadRequest(f"pages hold {total} bytes but the payload has {payload_len}")
        admitted = region.admit(abort)
        if w.span is not None:
            try:
                w.partial = self.coverage.reserve((peer[0], peer[1], w.op), w.span,
                                                  addrs[0], lens[0], w.imm)
            except BaseException:
                admitted.release()
                raise
        return views, admitted

    def landed(self, peer: tuple[int, int], w: WriteHeader, nbytes: int) -> None:
        """A WRITE's bytes are in place: count what landed, by the counting rules.

        A frame of pages adds one per page placed (a barrier, no pages, one); a
        part of a split single write adds one when the parts covered the span.
        """
        self.bytes_in += nbytes
        self.writes_in += 1
        if w.span is not None:
            assert w.partial is not None
            if not self.coverage.landed((peer[0], peer[1], w.op), w.partial, nbytes):
                return
            n = 1
        else:
            n = max(1, len(w.addrs))
        if w.imm is not None:
            self.counter.add(w.imm, n)
            self.imms_in += n

    def landed_imm(self, peer: tuple[int, int], imm: int, nbytes: int) -> None:
        """One unit landed with its immediate (a verbs WRITE_WITH_IMM completion): one count."""
        self.bytes_in += nbytes
        self.writes_in += 1
        self.counter.add(imm & 0xFFFFFFFF, 1)
        self.imms_in += 1

    def close(self) -> None:
        for d in self.domains:
            d.close()
