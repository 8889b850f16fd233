"""The verbs Domain: one RDMA NIC (one rail) of a domain group, through pyverbs.

Per peer, per direction, two RC queue pairs:

* a **send/recv** queue pair for two-sided messages (SEND frames, and the ACK frames
  that tell a sender its message reached a client), each frame one message received
  whole into a posted receive slot;
* a **write** queue pair for RDMA WRITE and WRITE_WITH_IMM, whose posted receives are
  consumed only by WRITE_WITH_IMM (one per immediate counted).

Two, because a RECV and a WRITE_WITH_IMM both consume the receive queue's work requests
in the order they were posted (the article's reason): on one queue pair a
WRITE_WITH_IMM would take the receive a message was meant to land in, and message
receives could not be sized or reposted independently of the write traffic.

Set-up rides on a TCP connection per rail and peer (the rail's address in NetAddr is
that listener's host and port): the authenticated peer handshake first, then the two
sides' :class:`~.exchange.RailSetup` (``links.py``).  The TCP connection stays open for
the life of the queue pairs: when it closes, they are torn down and every write in
flight fails.

Completions: one completion queue per NIC, polled on the group's worker loop by a
:class:`~.cqloop.CqPoller` (busy-poll for a bounded time, then the completion channel).

This module needs a device; what it builds on (``sender``, ``counting``, ``completions``,
``wrplan``, ``exchange``) is pure and tested without one.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

from transferd.logs import peer_warning
from transferd.parts import ReadPart, RegionInfo, SendPart, Transfer, WritePart
from transferd.protocol.errors import (
    BadRequest,
    PeerUnreachable,
    TransferdError,
)
from transferd.protocol.peer_link import LinkState
from transferd.protocol.values import NetAddr
from transferd.rdma.completions import Dispatcher, QpRole, WrIds, WrKind, split_wr_id, wr_id
from transferd.rdma.cqloop import CqPoller
from transferd.rdma.mrtable import Registration, address_of
from transferd.rdma.resources import SINK_LEN, Nic, PyverbsError, PyverbsRDMAError
from transferd.rdma.slots import Slots
from transferd.rdma.staged import StagingRegistrations
from transferd.rdma.wr import RecvSlots, ZeroWriteTemplate, build_chains

from ..base import Capabilities, Domain, LinkStats, Port, count_links, link_key
from ..rails import parse_rail, rail_bytes
from ..strangers import RailStrangers
from . import messages
from .bind import create
from .links import InLink, OutLink
from .messages import MSG_LEN
from .reads import ReadWindow
from .sender import Posted, Sender
from .sendq import SendQueue
from .worker_calls import call_on_loop

CAPABILITIES: Capabilities = create.capabilities

log = logging.getLogger("transferd.verbs")

SEND_DEPTH = 512  # send work requests in flight per queue pair
WRITE_RECV_DEPTH = 1024  # WRITE_WITH_IMMs towards us in flight per peer and rail
MSG_DEPTH = 32  # message slots per send/recv queue pair, each way
WR_IDS = 1 << 16  # work requests in flight per NIC
CONNECT_TIMEOUT = 10.0
CLOSE_GRACE_S = 5.0
REGISTER_TIMEOUT = 10.0  # ibv_reg_mr pins the pages: large regions take a while


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(256)
    sock.setblocking(False)
    return sock


class QpEnd:
    """One of our RC queue pairs towards one peer: what the Sender posts on."""

    def __init__(self, domain: VerbsDomain, owner: Any, write: bool,
                 receives: bool = True) -> None:
        """``receives``: post receives (not on our own write queue pair towards a peer,
        which never has a WRITE_WITH_IMM sent to it)."""
        nic = domain.nic
        self.domain = domain
        self.owner = owner
        self.write = write
        self.closed = False
        depth = (WRITE_RECV_DEPTH if write else MSG_DEPTH) if receives else 1
        # Every work request of every queue pair may complete at once: the NIC's one
        # completion queue must hold them all, or it overruns.
        self.cqes = SEND_DEPTH + depth
        domain.reserve_cqes(self.cqes)
        try:
            # A write queue pair posts our READs and serves the peer's.
            self.qp = nic.create_qp(SEND_DEPTH, depth, reads=write)
        except BaseException:
            domain.reserve_cqes(-self.cqes)
            raise
        self.info = nic.qp_info(self.qp)
        self.max_msg = nic.choice.max_msg
        self.max_sge = nic.choice.max_sge
        self.queue: SendQueue[Posted] = SendQueue(SEND_DEPTH, self._post)
        # Our READs on this queue pair: at most max_rd_atomic in flight (reads.py).
        self.reads = ReadWindow(nic.choice.rd_atomic[0], domain.sender.post_read)
        self.template = ZeroWriteTemplate((nic.sink.buf, 0, nic.sink.lkey)) if write else None
        self.rx: Slots | None = None
        self.tx: Slots | None = None
        if write:
            # Every write receive names the same sink: WRITE_WITH_IMM writes nothing
            # into a receive buffer, and a stray SEND of more than SINK_LEN breaks the
            # queue pair instead of landing anywhere.
            self.recv = RecvSlots(int(WrKind.WRITE_RECV), nic.sink.buf, SINK_LEN,
                                  depth if receives else 0, nic.sink.lkey, stride=0)
        else:
            self.rx = Slots(nic, MSG_DEPTH, MSG_LEN)
            self.tx = Slots(nic, MSG_DEPTH, MSG_LEN)
            self.recv = RecvSlots(int(WrKind.RECV), self.rx.addr, MSG_LEN, MSG_DEPTH,
                                  self.rx.reg.lkey)
        self._tx_waiting: deque[tuple[bytes, bytes, Any]] = deque()
        domain.dispatcher.qps[self.info.qpn] = QpRole(self, write)
        domain.qps[self.info.qpn] = self
        for wr in self.recv.wrs:
            self.qp.post_recv(wr)

    def connect(self, theirs: Any, their_read_depth: int = 1) -> None:
        """``their_read_depth``: the READs the peer's end serves at once (its
        RailSetup): ours in flight stay within it and within our device's."""
        reads = None
        if self.write:
            ours, serve = self.domain.nic.choice.rd_atomic
            reads = (min(ours, their_read_depth), serve)
            self.reads.depth = reads[0]
        # A region may be read only where its own MR grants remote read (Nic.register).
        self.domain.nic.connect(self.qp, self.info, theirs, reads=reads)

    def repost(self, slot: int) -> None:
        try:
            self.qp.post_recv(self.recv.wrs[slot])
        except PyverbsRDMAError as exc:
            self.owner.close(PeerUnreachable(f"cannot repost a receive: {exc}"))

    # -- posting ----------------------------------------------------------------------

    def _post(self, batch: Sequence[Posted]) -> None:
        d = self.domain
        items = []
        for k, p in enumerate(batch):
            if self.closed:
                err: TransferdError = PeerUnreachable("queue pair closed")
            else:
                try:
                    items.append((p.spec, wr_id(WrKind.SEND, d.wrids.put(p))))
                    continue
                except OverflowError as exc:
                    err = BadRequest(f"verbs rail {d.rail}: {exc}")
            # Not posted: these fail here, in order, and nothing after them is posted.
            for q in batch[k:]:
                d.sender.completed(q, err)
            break
        chains = build_chains(items, self.template)
        failed: Exception | None = None
        pos = 0
        for chain in chains:
            n = len(chain.wrs)
            try:
                if failed is None:
                    self.qp.post_send(chain.head)
            except PyverbsRDMAError as exc:
                failed = exc
            finally:
                chain.close()
            if failed is not None:
                err = PeerUnreachable(f"ibv_post_send failed: {failed}")
                for _, ident in items[pos : pos + n]:
                    posted = d.wrids.pop(split_wr_id(ident)[1])
                    if posted is not None:
                        d.sender.completed(posted, err)
            pos += n
        d.kick()

    def send_frame(self, head: bytes, payload: bytes, on_done: Any) -> None:
        """One frame (``head``, then ``payload``) in one SEND, copied into a registered
        slot (waits for a free one)."""
        assert self.tx is not None
        if self.closed:
            raise PeerUnreachable("queue pair closed")
        if not self.tx.free:
            if len(self._tx_waiting) >= SEND_DEPTH * 4:
                raise BadRequest("too many messages waiting for a send slot")
            self._tx_waiting.append((head, payload, on_done))
            return
        i = self.tx.free.pop()
        try:
            n = messages.encode_into(self.tx.slot(i), head, payload)
        except TransferdError:
            self.tx.free.append(i)
            raise

        def sent(err: TransferdError | None) -> None:
            assert self.tx is not None
            self.tx.free.append(i)
            if on_done is not None:
                on_done(err)
            if self._tx_waiting and self.tx.free and not self.closed:
                self.send_frame(*self._tx_waiting.popleft())

        sge = (self.tx.addr + i * self.tx.length, n, self.tx.reg.lkey)
        self.domain.sender.send(self, sge, sent)

    def received(self, slot: int, nbytes: int) -> Any:
        assert self.rx is not None
        try:
            return messages.parse(self.rx.slot(slot)[:nbytes])
        finally:
            self.repost(slot)  # the frame's bytes were copied out

    def close(self) -> None:
        if self.closed:
            return
        # Closed first: whatever the failures below set off (a carrier released by a
        # unit on another rail, a waiting message) is failed, never posted.
        self.closed = True
        d = self.domain
        d.dispatcher.qps.pop(self.info.qpn, None)
        d.qps.pop(self.info.qpn, None)
        err = PeerUnreachable("queue pair closed")
        # Destroyed before anything it carried is failed: a READ's memory is let go when
        # its work request fails here, and from ibv_destroy_qp's return the NIC writes
        # nothing more into it.
        with contextlib.suppress(PyverbsError):
            self.qp.close()
        unread = self.reads.drain()
        waiting = self.queue.drain()
        tx_waiting, self._tx_waiting = self._tx_waiting, deque()
        for r in unread:
            d.sender.not_posted(r, err)
        for p in d.fail_wrs_of(self):
            d.sender.completed(p, err)
        for q in waiting:
            d.sender.completed(q, err)
        for _, _, on_done in tx_waiting:
            if on_done is not None:
                on_done(err)
        d.reserve_cqes(-self.cqes)
        self.recv.close()
        if self.template is not None:
            self.template.close()
        for s in (self.rx, self.tx):
            if s is not None:
                s.close(d.nic)


class VerbsDomain(Domain):
    """One rail: a NIC port, its set-up listener, and its links to peers.

    Made by the registry (``verbs``, :func:`~.bind.create`), which reads the device,
    port and GID index from the Domain's own settings.
    """

    name = "verbs"
    # The NIC places writes (no receiver code sees them), counts immediates and serves
    # READs; it does not take device memory yet (docs/rdma.md).
    capabilities = CAPABILITIES

    def __init__(self, port: Port, rail: int, host: str, port_number: int = 0, *,
                 device: str, ib_port: int = 1, gid_index: int | None = None) -> None:
        self.port = port
        self.rail = rail
        self.host = host
        self.loop = port.loop
        self.nic = Nic(device, ib_port, gid_index)  # VerbsUnavailable names what is missing
        self.sender = shared_sender(port)
        self.wrids: WrIds[Posted] = WrIds(WR_IDS)
        self.qps: dict[int, QpEnd] = {}
        self.dispatcher: Dispatcher[Posted] = Dispatcher(
            self.wrids, on_send_done=self._send_done, on_imm=self._on_imm,
            on_message=self._on_message, repost=self._repost, on_broken=self._on_broken)
        self._listener = _listen(host, port_number)
        self.port_number = self._listener.getsockname()[1]
        # Keyed by the peer and the address dialled, as the tcp rails' links.
        self._links: dict[tuple[int, int, bytes], OutLink] = {}
        self._inbound: set[InLink] = set()
        self.strangers = RailStrangers(f"verbs rail {rail} ({host}:{self.port_number})",
                                       port.links.handshake_timeout_s)
        self._cqes = 0
        # Region id -> its registration here and its staging path (device memory).
        self._regions: dict[int, tuple[Registration, Any]] = {}
        self.staged = StagingRegistrations(
            lambda addr, n: self.nic.register(addr, n, remote=False), self.nic.deregister)
        self.poller = CqPoller(self.loop, self.nic.cq, self.nic.channel,
                               self.dispatcher.dispatch, fd=self.nic.channel_fd)
        self.loop.add_reader(self._listener.fileno(), self._accept)

    def reserve_cqes(self, n: int) -> None:
        """Completion-queue entries a new queue pair may need (negative: given back)."""
        if n > 0 and self._cqes + n > self.nic.cq_depth:
            raise BadRequest(
                f"verbs rail {self.rail}: {self.nic.choice.name}'s completion queue "
                f"({self.nic.cq_depth} entries) cannot take another peer's queue pairs")
        self._cqes += n

    # -- memory -------------------------------------------------------------------------

    def register(self, region: RegionInfo) -> int:
        """ibv_reg_mr of the region on this NIC: its rkey for the MrDesc.  The NIC checks
        rkey and bounds of every write that arrives; the region table's own rkeys are
        not used on verbs.  The same buffer may be registered again (its own rkey, as on
        tcp).  Device memory also holds its staging pool's registration here (writes from
        it go through staging: ``transferd.rdma.staged``).  Past REGISTER_TIMEOUT the
        caller gets Timeout and a registration that completes later is undone."""
        device, staging = region.device, region.staging

        def reg() -> Registration:
            if region.id in self._regions:
                raise BadRequest(f"region {region.id} is already registered on verbs "
                                 f"rail {self.rail}")
            # Remote read only for a region granted "r" (reads.mr_access): the NIC refuses
            # any other READ of it.
            r = self.nic.register(region.ptr, region.size, device, access=region.access)
            try:
                if staging is not None:
                    self.staged.hold(staging.pool)
            except BaseException:
                self.nic.deregister(r)
                raise
            self._regions[region.id] = (r, staging)
            return r

        return call_on_loop(
            self.loop, reg, timeout=REGISTER_TIMEOUT, undo=lambda r: self._drop(region.id),
            what=f"registering {region.size} bytes with {self.nic.choice.name}").rkey

    def deregister(self, region: RegionInfo) -> None:
        """ibv_dereg_mr: from its return no remote write lands in the region (one in
        flight fails at its initiator with a remote access error)."""
        call_on_loop(self.loop, lambda: self._drop(region.id), timeout=REGISTER_TIMEOUT,
                     what=f"deregistering region {region.id} from {self.nic.choice.name}")

    def _drop(self, region_id: int) -> None:
        """On the worker: a region's registration (and its hold on staging) goes."""
        held = self._regions.pop(region_id, None)
        if held is None:
            return  # never registered here, or undone already
        reg, staging = held
        # The region is gone for the engine either way: a failure is logged, and the
        # staging (and the other rails) still let go of theirs.
        steps = [lambda: self.nic.deregister(reg)]
        if staging is not None:
            steps.append(lambda: self.staged.let_go(staging.pool))
        for step in steps:
            try:
                step()
            except TransferdError as exc:
                log.warning("verbs rail %d: %s", self.rail, exc.message)

    # -- outbound ---------------------------------------------------------------------

    @property
    def address(self) -> bytes:
        return rail_bytes(self.host, self.port_number)

    def check_address(self, raw: bytes) -> None:
        """A verbs rail's address is its TCP set-up address (the Domain interface's check)."""
        parse_rail(raw)

    def connect(self, dst: NetAddr) -> None:
        self.link_to(dst)

    def link_to(self, dst: NetAddr) -> OutLink:
        key = link_key(dst)
        link = self._links.get(key)
        if link is None or link.state is LinkState.CLOSED:
            link = OutLink(self, dst)
            self._links[key] = link
        return link

    def post(self, part: WritePart | SendPart | ReadPart, transfer: Transfer) -> None:
        if type(part) is ReadPart and part.into and self.staged.covers(address_of(part.into[0])):
            # A READ on the NIC cannot be recalled, and the engine hands staging chunks
            # to the next operation as soon as a read ends, early or not: a late READ
            # would land in someone else's bytes.  Refused until the engine waits for
            # the Domain (docs/rdma.md).
            transfer.fail(BadRequest(f"verbs rail {self.rail}: a READ into device memory "
                                     "(through staging) is not served on verbs; read into "
                                     "host memory, or use tcp"))
            return
        try:
            self.link_to(part.dst).submit(part, transfer)
        except TransferdError as exc:
            transfer.fail(exc)

    def forget(self, link: OutLink) -> None:
        key = link_key(link.dst)
        if self._links.get(key) is link:
            del self._links[key]

    def link_stats(self) -> LinkStats:
        return count_links([(lk.state.value, len(lk._waiting)) for lk in self._links.values()],
                           len(self._inbound))

    def fail_wrs_of(self, qp: QpEnd) -> list[Posted]:
        """Take back the work requests of a queue pair that is going away."""
        mine = [i for i, p in self.wrids._items.items() if p.link is qp]
        return [p for i in mine if (p := self.wrids.pop(i)) is not None]

    # -- inbound ----------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("verbs rail %d: accept failed: %s", self.rail, exc)
                return
            link = InLink(self, sock)
            self._inbound.add(link)
            # Strangers in their handshake: a bounded number, a share per source, each
            # for the handshake timeout (as on a tcp rail: ..strangers).
            link.ticket = self.strangers.admit(str(addr[0]), self.loop.time(), link)
            if link.ticket is None:
                link.close(PeerUnreachable("no handshake slot"))

    def handshake_done(self, link: InLink) -> None:
        self.strangers.done(link.ticket)

    def inbound_closed(self, link: InLink) -> None:
        self._inbound.discard(link)
        self.strangers.done(link.ticket)

    def _on_imm(self, qp: QpEnd, imm: int, nbytes: int) -> None:
        owner = qp.owner
        if isinstance(owner, InLink) and owner.peer is not None:
            # One WRITE_WITH_IMM completion is one unit: it adds 1 (counting.py).
            try:
                self.port.landing.landed_imm(imm, nbytes)
            except TransferdError as exc:  # (the counts table is full: see landed_imm)
                peer_warning("peer write refused", owner.peer[0], self.rail,
                             owner.io.peername() if owner.io is not None else None, exc)
                owner.close(exc)

    def _on_message(self, qp: QpEnd, qpn: int, slot: int, nbytes: int) -> None:
        try:
            frame = qp.received(slot, nbytes)
        except TransferdError as exc:
            qp.owner.close(exc)
            return
        qp.owner.on_message(frame)

    def _repost(self, qpn: int, slot: int) -> None:
        qp = self.qps.get(qpn)
        if qp is not None:
            qp.repost(slot)

    def _send_done(self, posted: Posted, error: TransferdError | None) -> None:
        """A work request of ours completed.  A failed one left its queue pair in the
        error state (RC: everything after it is flushed, nothing more is carried): the
        link is closed, so the next part to this peer gets new queue pairs rather than a
        dead one (a READ of a region without "r" breaks only the reader's link)."""
        self.sender.completed(posted, error)
        qp = posted.link
        if error is not None and not qp.closed:
            qp.owner.close(PeerUnreachable(f"verbs rail {self.rail}: queue pair in the "
                                           f"error state ({error.message})"))

    def _on_broken(self, qp: QpEnd, why: str) -> None:
        qp.owner.close(PeerUnreachable(f"verbs rail {self.rail}: {why}"))

    # -- the completion-queue loop (cqloop.py) ---------------------------------------

    def kick(self) -> None:
        """Work was posted: busy-poll soon."""
        self.poller.kick()

    def close(self) -> None:
        self.loop.remove_reader(self._listener.fileno())
        self._listener.close()
        self.poller.close()
        for link in list(self._links.values()):
            link.close(PeerUnreachable("engine is shutting down"))
        for inbound in list(self._inbound):
            inbound.close(PeerUnreachable("engine is shutting down"))
        self.sender.close()
        self.nic.close()


# One Sender per group, kept here rather than on the group (which knows no Domain kind).
_SENDERS: weakref.WeakKeyDictionary[Any, Sender] = weakref.WeakKeyDictionary()


def shared_sender(group: Any) -> Sender:
    """The group's Sender (its carrier gate spans the group's rails); ``group`` is the
    group's port, which every rail of it shares."""
    sender = _SENDERS.get(group)
    if sender is None:
        sender = Sender(lambda link: lambda a, n: link.domain.nic.mrs.find(a, n).lkey,
                        lambda link: (link.domain.nic.sink.buf, 0, link.domain.nic.sink.lkey))
        _SENDERS[group] = sender
    return sender
