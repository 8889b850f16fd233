"""A DomainGroup: the 1 to 4 Domains (rails, NICs) of one device, on one worker.

It holds Domains of one kind, made by name from the registry, and shards each
transfer's parts over them (the plan already says which rail).  It is their
:class:`~transferd.domains.base.Receiver`: on the receiving side it checks
every incoming write against its region before a byte lands, counts what
landed, hands messages on, and knows which peers authenticated with which
addresses.  Everything here runs on the group's worker loop; the region
table, the ImmCounter and the peer book are the only things shared with the
daemon's loop, and all three are thread safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from transferd.fds import LinkBudget, link_budget
from transferd.logs import peer_warning
from transferd.parts import SendPart, Transfer, WritePart
from transferd.protocol.errors import BadRequest, OutOfBounds, Timeout, TransferdError
from transferd.protocol.frames import DISCARD
from transferd.protocol.keyring import Keyring
from transferd.protocol.peer import WriteHeader
from transferd.protocol.peer_handshake import DEFAULT_TIMEOUT as DEFAULT_HANDSHAKE_TIMEOUT
from transferd.protocol.peer_handshake import PeerIdentity
from transferd.protocol.values import NetAddr

from . import registry
from .base import Ack, Domain, DomainOptions
from .coverage import DUPLICATE, Coverage, Landed, fingerprint
from .failover import RailHealth, Resend, move
from .peers import PeerBook
from .writeids import Seen, WriteIds

if TYPE_CHECKING:
    from transferd.engine.immcounter import ImmCounter
    from transferd.engine.regions import Region, RegionTable
    from transferd.memory import Ref

# deliver(peer, message, ack, source): ``ack(None)`` once a client has the
# message, ``ack(error)`` if it cannot have it; ``ack`` may be called from any
# thread.  ``source`` is the inbound link it came in on: sender_gone(source)
# says that link closed (its messages still waiting for a receive are dropped).
Deliver = Callable[[tuple[int, int], bytes, Ack, Hashable], None]

__all__ = ["Ack", "Deliver", "DomainGroup", "DomainOptions"]


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
        sender_gone: Callable[[Hashable], None] | None = None,
        timeout_s: float = 30.0,
        domain: str = "tcp",
        options: DomainOptions | None = None,
        secret: bytes | Keyring | None = None,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT,
    ) -> None:
        self.index = index
        self.node = node
        self.loop = loop
        self.regions = regions
        self.counter = counter
        self.deliver = deliver
        self.sender_gone: Callable[[Hashable], None] = sender_gone or (lambda _source: None)
        self.timeout_s = timeout_s
        # The registry name of this group's Domains (all of one kind) and their settings.
        self.domain = domain
        self.options = options or DomainOptions()
        # The cluster secret every link proves (None: links can only be held
        # to the addresses they claim; see peer_handshake).  The engine swaps it on a
        # reload; each handshake keeps the one it started with.
        self.secret: Keyring | None = Keyring.of(secret) or None
        self.handshake_timeout_s = handshake_timeout_s
        self.domains: list[Domain] = []
        # One descriptor per peer link, every rail's and group's together (transferd.fds).
        self.link_budget: LinkBudget = self.options.link_budget or LinkBudget(
            link_budget(self.options.max_links, self.options.fd_reserve))
        self.coverage = Coverage()
        # Writes with a client's write id applied here (a retry lands at most once).
        self.write_ids = WriteIds()
        # Parts that landed lately, by (peer, op, part): a re-sent one is not applied twice.
        self.landed_parts = Landed()
        self.health = RailHealth(1)
        self._book: PeerBook | None = None
        self.bytes_in = 0
        # Receiver-side tallies, read by the metrics when scraped (transferd.metrics).
        self.writes_in = 0
        self.imms_in = 0
        self.messages_in = 0
        self.refused_by: dict[str, int] = {}

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
        return self.address

    @property
    def book(self) -> PeerBook:
        """Who authenticated with which addresses; made once the rails are bound."""
        if self._book is None:
            self._book = PeerBook(self.identity)
        return self._book

    @property
    def address(self) -> NetAddr:
        return NetAddr(self.node, self.index, self.identity.addrs)

    @property
    def identity(self) -> PeerIdentity:
        return PeerIdentity(self.node, self.index, tuple(d.address for d in self.domains))

    def bind_peer(self, peer: PeerIdentity) -> None:
        """A link authenticated ``peer``: bind it (BadRequest if it contradicts a binding)."""
        self.book.bind(peer)

    def rail_address(self, rail: int) -> NetAddr:
        return self.address.rail(rail)

    def check_address(self, addr: NetAddr, first_rail: int = 0) -> None:
        """Refuse a client's NetAddr that names a known peer at other addresses.

        ``addr`` lists rails ``first_rail``, ``first_rail + 1``, ... of its peer
        (a main address lists them all, an MrDesc's rkey entry one).  Called on
        the daemon's loop, before anything is planned.
        """
        rails = list(addr.rails)
        for i, raw in enumerate(rails):
            # Each Domain reads (and checks) only its own kind of address.
            self.domains[min(first_rail + i, len(self.domains) - 1)].check_address(raw)
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
        if len(self.domains) == 1:
            for part in parts:
                self.domains[part.rail].post(part, transfer)
            return
        now = self.loop.time()
        for part in parts:
            if not isinstance(part, WritePart) or part.alts is None:
                self.domains[part.rail].post(part, transfer)
                continue
            # A rail that failed lately is skipped until its probe is due (failover.py).
            rail = self.health.pick(part.dst.key, part.rail, now)
            if rail is not None and rail != part.rail:
                move(part, rail)
            self.domains[part.rail].post(part, Resend(self, transfer, part))  # type: ignore[arg-type]

    def _timed_out(self, transfer: Transfer, parts: list[WritePart | SendPart]) -> None:
        err = Timeout(f"transfer {transfer.op} not acknowledged in {self.timeout_s:g} s")
        rail = parts[0].rail if parts else 0
        dst = parts[0].dst if parts else None
        peer_warning("transfer timed out", dst.node if dst else None, rail,
                     dst.rails[0].decode(errors="replace") if dst and dst.rails else None,
                     err)
        transfer.fail(err)
        # A link still holding unsent bytes after that long has a peer that reads
        # nothing: closed, so the memory those bytes lie in can go back.
        for key in {(p.rail, p.dst.key): (p.rail, p.dst) for p in parts}.values():
            drop = getattr(self.domains[key[0]], "drop_stalled", None)  # (verbs: not yet)
            if drop is not None:
                drop(key[1], err)

    def connect(self, addr: NetAddr) -> None:
        """Open every rail's link to a peer now, ahead of the first transfer."""
        for rail, domain in enumerate(self.domains):
            if rail < len(addr.rails):
                domain.connect(addr.rail(rail))

    # -- memory ---------------------------------------------------------------------

    def register(self, region: Region) -> tuple[int, ...]:
        """Register ``region`` with every Domain (on the worker): its rkey on each rail."""
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

    def deregister(self, region: Region) -> None:
        for d in self.domains:
            d.deregister(region)

    # -- receiver side (what the Domains call) --------------------------------------

    def region(self, rkey: int, rail: int) -> Region:
        return self.regions.by_rkey(rkey, rail)

    def refused(self, error: TransferdError) -> None:
        self.refused_by[error.code.value] = self.refused_by.get(error.code.value, 0) + 1

    def delivered(self) -> None:
        self.messages_in += 1

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
        return self.check_write(self.region(w.rkey, rail), peer, w, payload_len, abort)

    @staticmethod
    def device_io(region: Region) -> Any:
        """The staging path (DeviceIO) of a region of device memory, else None."""
        return region.buffer.staging

    def check_write(self, region: Region, peer: tuple[int, int], w: WriteHeader,
                    payload_len: int, abort: Callable[[], None] | None = None
                    ) -> tuple[list[memoryview], Ref]:
        """Bounds, payload and span checks of a WRITE into ``region``, then admission.

        A part marked ``again`` (re-sent on another rail after its own failed)
        whose first copy landed is admitted with DISCARD for its payload:
        nothing lands or counts again, and it is acknowledged.  (Frames not
        marked are never taken for copies: a peer may repeat a frame.)
        """
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
        if w.again and self.landed_parts.seen((peer[0], peer[1], w.op, w.part),
                                              fingerprint(addrs, lens)):
            w.partial = DUPLICATE
            self.landed_parts.duplicates += 1
            return DISCARD, admitted  # type: ignore[return-value]
        if w.span is not None:
            try:
                w.partial = self.coverage.reserve(_cover_key(peer, w), w.span,
                                                  addrs[0], lens[0], w.imm, w.again)
            except BaseException:
                admitted.release()
                raise
        return views, admitted

    def check_device_write(self, region: Region, peer: tuple[int, int], w: WriteHeader,
                           payload_len: int, abort: Callable[[], None] | None = None
                           ) -> tuple[list[tuple[int, int]], Ref]:
        """:meth:`check_write` for a region of device memory (no host view).

        The same bounds, payload and span checks, page by page, then admission;
        gives each page's device address and length instead of host views (the
        bytes go through staging, see tcp.py's inbound link).
        """
        device_address = region.buffer.device_address  # bounds checked
        pages: list[tuple[int, int]] = []
        total = 0
        for a, n in zip(w.addrs, w.lens, strict=True):
            off = a - region.ptr
            if off < 0 or n < 0 or off + n > region.size:
                raise OutOfBounds(f"[0x{a:x}, +{n}) is outside region {region.id} "
                                  f"[0x{region.ptr:x}, +{region.size})")
            pages.append((device_address(off, n), n))
            total += n
        if total != payload_len:
            raise BadRequest(f"pages hold {total} bytes but the payload has {payload_len}")
        admitted = region.admit(abort)
        if w.span is not None:
            try:
                w.partial = self.coverage.reserve(_cover_key(peer, w), w.span,
                                                  w.addrs[0], w.lens[0], w.imm, w.again)
            except BaseException:
                admitted.release()
                raise
        return pages, admitted

    def landed(self, peer: tuple[int, int], w: WriteHeader, nbytes: int) -> None:
        """A WRITE's bytes are in place: count what landed, by the counting rules.

        A frame of pages adds one per page placed (a barrier, no pages, one); a
        part of a split single write adds one when the parts covered the span.
        """
        if w.partial is DUPLICATE:
            return
        self.landed_parts.add((peer[0], peer[1], w.op, w.part), fingerprint(w.addrs, w.lens))
        self.bytes_in += nbytes
        self.writes_in += 1
        if w.span is not None:
            assert w.partial is not None
            if not self.coverage.landed(_cover_key(peer, w), w.partial, nbytes,
                                        w.addrs[0]):
                return
            n = 1
        else:
            n = max(1, len(w.addrs))
        if w.imm is not None:
            self.counter.add(w.imm, n)
            self.imms_in += n

    def landed_once(self, peer: tuple[int, int], w: WriteHeader, nbytes: int) -> None:
        """:meth:`landed`, and a frame with a write id remembered as applied."""
        try:
            self.landed(peer, w, nbytes)
        except BaseException:
            self.write_failed(peer, w)
            raise
        if w.wid is not None:
            self.write_ids.applied(peer, w)

    def claim_write(self, peer: tuple[int, int], w: WriteHeader) -> bool:
        """Before a WRITE is checked: True if it carries a write id already applied
        here (acknowledge it ok, place and count nothing).  Else a frame with an id
        is claimed: :meth:`landed_once` or :meth:`write_failed` must follow."""
        return w.wid is not None and self.write_ids.claim(peer, w) is Seen.APPLIED

    def write_failed(self, peer: tuple[int, int], w: WriteHeader) -> None:
        """A claimed WRITE did not land: a retry of it may (its span range freed)."""
        if w.wid is None:
            return
        self.write_ids.failed(peer, w)
        if w.partial is not None and w.span is not None:
            self.coverage.unreserve(_cover_key(peer, w), w.partial, w.addrs[0], w.lens[0])

    def landed_imm(self, peer: tuple[int, int], imm: int, nbytes: int) -> None:
        """One unit landed with its immediate (a verbs WRITE_WITH_IMM completion): one count."""
        self.bytes_in += nbytes
        self.writes_in += 1
        self.counter.add(imm & 0xFFFFFFFF, 1)
        self.imms_in += 1

    def close(self) -> None:
        for d in self.domains:
            d.close()


def _cover_key(peer: tuple[int, int], w: WriteHeader) -> tuple[int, int, int]:
    """A split write's coverage key: by op, or by write id (negative, so never an op)
    when it has one, so a first attempt's parts and a retry's cover one span."""
    return (peer[0], peer[1], w.op if w.wid is None else -1 - w.wid)
