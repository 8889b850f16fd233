"""A DomainGroup: the 1 to 4 Domains (rails, NICs) of one device, on one worker.

It holds Domains of one kind, made by name from the registry, and shards each
transfer's parts over them (the plan already says which rail; a part whose rail
fails is re-sent on another, :mod:`.failover`).  It is their :class:`~.base.Port`:
who we are and how links are made (:class:`~.links.LinkContext`, with the peer book
of which peers authenticated with which addresses), the landing rules every inbound
link applies (:class:`~transferd.protocol.peer_landing.Landing`) over the engine's
memory, and where messages go.  The engine is behind an
:class:`~transferd.parts.EnginePort`: this package never sees its regions or its
counter.  Everything here runs on the group's worker loop; the engine's port and
the peer book are what is shared with the daemon's loop, and both are thread safe.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transferd import tracing
from transferd.fds import LinkBudget, link_budget
from transferd.logs import peer_warning
from transferd.parts import (
    MAX_MESSAGE,
    EnginePort,
    ReadPart,
    RegionInfo,
    SendPart,
    Transfer,
    WritePart,
)
from transferd.protocol.errors import BadRequest, Timeout, TransferdError
from transferd.protocol.keyring import Keyring
from transferd.protocol.peer_coverage import Coverage, Landed
from transferd.protocol.peer_handshake import DEFAULT_TIMEOUT as DEFAULT_HANDSHAKE_TIMEOUT
from transferd.protocol.peer_handshake import PeerIdentity
from transferd.protocol.peer_landing import Landing
from transferd.protocol.peer_writeids import WriteIds
from transferd.protocol.values import NetAddr

from . import registry
from .base import Ack, Capabilities, Domain, DomainOptions, LinkStats
from .failover import RailHealth, Resend, move
from .inbound_room import InboundRoom
from .links import LinkContext
from .peers import PeerBook
from .probes import Probes

__all__ = ["DomainGroup", "DomainOptions", "GroupStats"]

# Deadlines kept at most (transfers that ended early behind one that has not are
# dropped all at once past this).
DEADLINES_COMPACT = 65536
# Rail address lists a group remembers as well formed (cleared when full).
WELL_FORMED_MAX = 4096


@dataclass(frozen=True)
class GroupStats:
    """What the metrics read of a group when scraped (receiver and initiator sides)."""

    writes_in: int = 0
    bytes_in: int = 0
    imms_in: int = 0
    messages_in: int = 0
    refused_by: dict[str, int] = field(default_factory=dict)
    partial_writes: int = 0
    failovers: int = 0
    duplicate_parts: int = 0
    write_id_duplicates: int = 0
    integrity_failures: dict[tuple[int, int], int] = field(default_factory=dict)
    integrity_resends: int = 0
    peers_known: int = 0
    links: tuple[LinkStats, ...] = ()
    # Peers' READs of this daemon's regions: answered, their bytes, refused by code.
    reads_out: int = 0
    read_bytes_out: int = 0
    reads_refused_by: dict[str, int] = field(default_factory=dict)


class DomainGroup:
    def __init__(
        self,
        index: int,
        node: int,
        loop: asyncio.AbstractEventLoop,
        port: EnginePort,
        *,
        timeout_s: float = 30.0,
        domain: str = "tcp",
        options: DomainOptions | None = None,
        secret: bytes | Keyring | None = None,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT,
        max_message: int = MAX_MESSAGE,
    ) -> None:
        self.index = index
        self.node = node
        self.loop = loop
        self.engine = port
        self.timeout_s = timeout_s
        # The registry name of this group's Domains (all of one kind) and their settings.
        self.domain = domain
        self.options = options or DomainOptions()
        self.domains: list[Domain] = []
        # One descriptor per peer link, every rail's and group's together (transferd.fds).
        self.link_budget: LinkBudget = self.options.link_budget or LinkBudget(
            link_budget(self.options.max_links, self.options.fd_reserve))
        # At the budget's cap the busiest source's oldest proved inbound link makes
        # room for a newcomer (a stranger's links cannot hold every descriptor).
        self.room = InboundRoom(self.link_budget)
        self.probes = Probes(loop, self.link_budget, self.room.take)
        # The cluster secret every link proves (None: links can only be held to the
        # addresses they claim; see peer_handshake).  The engine swaps it on a reload
        # (``secret``); each handshake keeps the one it started with.
        self.links = LinkContext(lambda: self.identity, Keyring.of(secret) or None,
                                 handshake_timeout_s,
                                 self.link_budget, lambda: self.book, self.probes, max_message,
                                 self.room)
        # Writes with a client's write id applied here (a retry lands at most once).
        self.write_ids = WriteIds()
        self.landing = Landing(port, 1, self.write_ids, Coverage(), Landed(),
                               require_crc=self.options.verify)
        self.health = RailHealth(1)
        # Parts re-sent after a checksum mismatch (failover.Resend).
        self.integrity_resends = 0
        self._book: PeerBook | None = None
        # (first rail, rail addresses) its Domains found well formed (check_address).
        self._well_formed: set[tuple[int, tuple[bytes, ...]]] = set()
        self.messages_in = 0
        # Transfers by deadline, earliest first: (when, transfer, its destinations).
        self._deadlines: deque[tuple[float, Transfer, tuple[tuple[int, NetAddr], ...]]] = \
            deque()
        self._deadline_timer: asyncio.TimerHandle | None = None

    @property
    def secret(self) -> Keyring | None:
        return self.links.secret

    @secret.setter
    def secret(self, secret: Keyring | None) -> None:
        self.links.secret = secret or None

    # -- what the Domains ask (the Port) ---------------------------------------------

    def deliver(self, peer: tuple[int, int], msg: bytes, ack: Ack, source: Hashable, *,
                trace: bytes | None = None, op: int = 0) -> None:
        loop = self.loop

        def counted(err: TransferdError | None) -> None:  # any thread
            if err is None:
                loop.call_soon_threadsafe(self._delivered)
            ack(err)

        self.engine.deliver(peer, msg, counted, source, trace=trace, op=op)

    def _delivered(self) -> None:
        self.messages_in += 1

    def sender_gone(self, source: Hashable) -> None:
        self.engine.sender_gone(source)

    # -- set-up ---------------------------------------------------------------------------

    def bind(self, hosts: list[str], port: int = 0) -> NetAddr:
        """One Domain per host, made by name; rail i of every peer talks to our rail i."""
        try:
            for i, host in enumerate(hosts):
                self.domains.append(registry.create(self.domain, self, i, host,
                                                    port if port and i == 0 else 0,
                                                    self.options))
        except BaseException:
            self.close()
            self.domains.clear()
            raise
        self.health = RailHealth(len(self.domains))
        # A part is re-sent only on another rail: with one, none is remembered landed.
        self.landing.remember = len(self.domains) > 1
        return self.address

    @property
    def capabilities(self) -> Capabilities:
        """What this group's Domains (all of one kind) can do."""
        if self.domains:
            return self.domains[0].capabilities
        return registry.capabilities(self.domain)

    @property
    def book(self) -> PeerBook:
        """Who authenticated with which addresses; made once the rails are bound."""
        if self._book is None:
            self._book = PeerBook(self.identity, self.options.max_peers)
        return self._book

    @property
    def address(self) -> NetAddr:
        return NetAddr(self.node, self.index, self.identity.addrs)

    @property
    def identity(self) -> PeerIdentity:
        return PeerIdentity(self.node, self.index, tuple(d.address for d in self.domains))

    def set_node(self, node: int, everyone: tuple[tuple[bytes, ...], ...]) -> None:
        """The daemon's node id, once every group is bound (without a cluster secret it is
        ``everyone``'s, the addresses of every group: peer_handshake.node_of)."""
        self.node = node
        self.links.everyone = everyone
        self._book = None  # bound to our own identity anew

    def bind_peer(self, peer: PeerIdentity) -> None:
        """A link authenticated ``peer``: bind it (BadRequest if it contradicts a binding)."""
        self.links.bind_peer(peer)

    def rail_address(self, rail: int) -> NetAddr:
        return self.address.rail(rail)

    def check_address(self, addr: NetAddr, first_rail: int = 0) -> None:
        """Refuse a client's NetAddr that names a known peer at other addresses.

        ``addr`` lists rails ``first_rail``, ``first_rail + 1``, ... of its peer (a
        main address lists them all, an MrDesc's rkey entry one).  Called on the
        daemon's loop, before anything is planned.
        """
        rails = addr.rails
        seen = self._well_formed
        if (first_rail, rails) not in seen:
            if not rails:
                # (A Domain would index its first address: refused here, typed.)
                raise BadRequest(f"node {addr.node:016x}/{addr.group}: a destination with "
                                 f"no rail address (rail {first_rail})")
            domains = self.domains
            for i, raw in enumerate(rails):
                # Each Domain reads (and checks) only its own kind of address.
                domains[min(first_rail + i, len(domains) - 1)].check_address(raw)
            # Every submit names the same few: what parsed once is not parsed again.
            if len(seen) >= WELL_FORMED_MAX:
                seen.clear()
            seen.add((first_rail, rails))
        book = self._book if self._book is not None else self.book
        known = book.get((addr.node, addr.group))
        if known is None:
            return
        want = known[first_rail:first_rail + len(rails)]
        if rails != want:
            mine = " (this daemon)" if addr.key == (self.node, self.index) else ""
            raise BadRequest(
                f"node {addr.node:016x}/{addr.group}{mine} is at "
                f"{','.join(w.decode() for w in want)}, not at "
                f"{','.join(r.decode() for r in rails)}")

    # -- initiator side -------------------------------------------------------------------

    def execute(self, transfer: Transfer,
                parts: Sequence[WritePart | SendPart | ReadPart]) -> None:
        self._deadline(transfer, parts)
        if not parts:
            transfer.part_done()
            return
        transfer.ended = functools.partial(self._let_go, parts)
        domains = self.domains
        # A traced transfer where spans are on: a span per part (transferd.tracing), which
        # its answer ends on its way to the transfer.
        spans = tracing.SPANS if transfer.span is not None else None
        if len(domains) == 1:
            post = domains[0].post
            for part in parts:
                t: Any = transfer if spans is None else spans.part(transfer, part,
                                                                    transfer.span)
                if not isinstance(part, SendPart) and part.verify:
                    # A checksum mismatch re-sends (re-reads) it once (failover.Resend).
                    post(part, Resend(self, t, part))  # type: ignore[arg-type]
                else:
                    post(part, t)
            return
        now = self.loop.time()
        for part in parts:
            if isinstance(part, SendPart) or part.alts is None:
                t = transfer if spans is None else spans.part(transfer, part, transfer.span)
                domains[part.rail].post(part, t)
                continue
            # A rail that failed lately is skipped until its probe is due (failover.py).
            rail = self.health.pick(part.dst.key, part.rail, now)
            if rail is not None and rail != part.rail:
                move(part, rail)
            t = transfer if spans is None else spans.part(transfer, part, transfer.span)
            domains[part.rail].post(part, Resend(self, t, part))  # type: ignore[arg-type]

    def _deadline(self, transfer: Transfer,
                  parts: Sequence[WritePart | SendPart | ReadPart]) -> None:
        """The transfer fails with TIMEOUT engine.peer_timeout_s from now unless it ended.

        One timeout for every transfer of the group, so deadlines come in the order
        transfers start: one timer, for the earliest, instead of one per transfer
        (what a transfer that ends early leaves behind is dropped as it reaches the
        front, and all of it, bounded, past :data:`DEADLINES_COMPACT`)."""
        dl = self._deadlines
        while dl and dl[0][1].finished:
            dl.popleft()
        if len(parts) == 1:
            where: tuple[tuple[int, NetAddr], ...] = ((parts[0].rail, parts[0].dst),)
        else:
            where = tuple({(p.rail, p.dst.key): (p.rail, p.dst) for p in parts}.values())
        dl.append((self.loop.time() + self.timeout_s, transfer, where))
        if len(dl) > DEADLINES_COMPACT:
            self._deadlines = dl = deque(e for e in dl if not e[1].finished)
        if self._deadline_timer is None:
            self._deadline_timer = self.loop.call_at(dl[0][0], self._expire)

    def _expire(self) -> None:
        self._deadline_timer = None
        dl, now = self._deadlines, self.loop.time()
        while dl and (dl[0][1].finished or dl[0][0] <= now):
            _, transfer, where = dl.popleft()
            if not transfer.finished:
                self._timed_out(transfer, where)
        if dl and self._deadline_timer is None:
            self._deadline_timer = self.loop.call_at(dl[0][0], self._expire)

    def _timed_out(self, transfer: Transfer, where: tuple[tuple[int, NetAddr], ...]) -> None:
        err = Timeout(f"transfer {transfer.op} not acknowledged in {self.timeout_s:g} s")
        rail, dst = where[0] if where else (0, None)
        peer_warning("transfer timed out", dst.node if dst else None, rail,
                     dst.rails[0].decode(errors="replace") if dst and dst.rails else None,
                     err, getattr(transfer, "trace", None))
        transfer.fail(err)  # (its links let go of its parts: _let_go)

    def _let_go(self, parts: Sequence[WritePart | SendPart | ReadPart],
                error: TransferdError) -> None:
        """A transfer failed (timed out, cancelled, refused): the links its parts are on
        now (a failover moved some) drop what they hold of it, its views and bytes."""
        if len(parts) == 1:
            self.domains[parts[0].rail].drop_stalled(parts[0].dst, error)
            return
        for rail, dst in {(p.rail, p.dst.key): (p.rail, p.dst) for p in parts}.values():
            self.domains[rail].drop_stalled(dst, error)

    def connect(self, addr: NetAddr) -> None:
        """Open every rail's link to a peer now, ahead of the first transfer."""
        for rail, domain in enumerate(self.domains):
            if rail < len(addr.rails):
                domain.connect(addr.rail(rail))

    # -- memory -----------------------------------------------------------------------------

    def register(self, region: RegionInfo) -> tuple[int, ...]:
        """Register ``region`` with every Domain: its rkey on each rail."""
        rkeys: list[int] = []
        try:
            for d in self.domains:
                # Once per Domain: a NIC registers (and pins) the memory each time.
                rkeys.append(d.register(region))
        except BaseException:
            for d in self.domains[:len(rkeys)]:
                d.deregister(region)
            raise
        return tuple(rkeys)

    def deregister(self, region: RegionInfo) -> None:
        for d in self.domains:
            d.deregister(region)

    # -- what the metrics read --------------------------------------------------------------

    def stats(self) -> GroupStats:
        lg = self.landing
        return GroupStats(
            writes_in=lg.writes_in, bytes_in=lg.bytes_in, imms_in=lg.imms_in,
            messages_in=self.messages_in, refused_by=dict(lg.refused_by),
            partial_writes=len(lg.coverage), failovers=self.health.failovers,
            duplicate_parts=lg.duplicates, write_id_duplicates=self.write_ids.duplicates,
            integrity_failures=dict(lg.integrity_failures),
            integrity_resends=self.integrity_resends,
            peers_known=len(self._book) if self._book is not None else 0,
            links=tuple(d.link_stats() for d in self.domains),
            reads_out=lg.reads_out, read_bytes_out=lg.read_bytes_out,
            reads_refused_by=dict(lg.reads_refused_by))

    def incoming(self) -> list[Any]:
        """The peer writes being received now, every rail's (a snapshot, any thread)."""
        return [w for d in list(self.domains) for w in d.incoming()]

    def close(self) -> None:
        for d in self.domains:
            d.close()
        self.probes.close()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
