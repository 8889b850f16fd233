"""An RC SEND/RECV channel between a client and a daemon: what rdma:// runs on.

One RC queue pair per connection, on a NIC shared (through a :class:`NicHub`, one per
device and event loop) by every connection of that loop: one completion queue, one
poller, one dispatcher.  Each message is one SEND into one of the receiver's posted
slots (``slot_len`` bytes: the server's max_message), received whole; the channel hands
it to ``on_message`` and reposts the slot once that returns.  Outgoing messages are
copied into registered send slots and sent only with a credit (:mod:`.credits`): a
receive the far side posted and we have not used.  Every message is a SEND_WITH_IMM
whose immediate returns the credits of the receives this end reposted; a zero-byte one
only returns credits.  A receiver that stops reposting (a paused protocol) makes the
sender wait, its messages queued, for at most CREDIT_STALL_S, then fail with Timeout;
an RNR (a peer that broke the credit rule) fails the queue pair after a few retries.

Set-up (``ChannelSetup``: QPN, PSN, GID, LID, MTU, receive depth, slot size) travels
over the TCP connection at HOST:PORT, which stays open for the connection's life.
Needs a device; its pure parts (framing, exchange, completions) are tested without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

from transferd.copies import COUNTING, count
from transferd.protocol.errors import BadRequest, PeerUnreachable, TransferdError

from .completions import Dispatcher, QpRole, WrIds, WrKind, wr_id
from .constants import WrOpcode
from .cqloop import CqPoller
from .credits import Credits
from .devices import discover
from .exchange import ChannelSetup
from .loader import VerbsUnavailable
from .resources import Nic, PyverbsError, PyverbsRDMAError
from .slots import Slots
from .wr import RecvSlots, build_send_wr
from .wrplan import WrSpec

log = logging.getLogger("transferd.verbs")

RECV_DEPTH = 32
TX_DEPTH = 32
# Credit-only messages in flight at once (they use no send slot, only a send WR).
CREDIT_SENDS = 2
# With credits a compliant peer never meets a missing receive: an RNR is a broken
# peer, failed after these retries (min_rnr_timer apart) instead of forever.
RNR_RETRY = 3
# Completion-queue entries a channel can need at once (its receives and sends).
_CQ_PER_CHANNEL = RECV_DEPTH + TX_DEPTH + CREDIT_SENDS
CQ_DEPTH = 16384


class NicHub:
    """One NIC's resources shared by the rdma:// channels of one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, device: str, port: int = 1,
                 gid_index: int | None = None) -> None:
        self.loop = loop
        self.nic = Nic(device, port, gid_index, cq_depth=CQ_DEPTH)
        self.sends: WrIds[tuple[RcChannel, int]] = WrIds(1 << 16)
        self.dispatcher: Dispatcher[tuple[RcChannel, int]] = Dispatcher(
            self.sends, on_send_done=self._sent, on_imm=self._unexpected_imm,
            on_message=self._received, repost=lambda qpn, slot: None,
            on_credits=lambda ch, n: ch._credited(n),
            on_broken=lambda ch, why: ch.fail(PeerUnreachable(f"rdma://: {why}")))
        self.poller = CqPoller(loop, self.nic.cq, self.nic.channel, self.dispatcher.dispatch,
                               fd=self.nic.channel_fd)
        self.channels: set[RcChannel] = set()
        self.max_channels = max(1, min(CQ_DEPTH, self.nic.choice.max_cqe) // _CQ_PER_CHANNEL)

    def _sent(self, item: tuple[RcChannel, int], err: TransferdError | None) -> None:
        ch, slot = item
        ch._sent(slot, err)

    def _received(self, ch: RcChannel, qpn: int, slot: int, nbytes: int) -> None:
        ch._received(slot, nbytes)

    def _unexpected_imm(self, ch: RcChannel, imm: int, n: int) -> None:
        ch.fail(PeerUnreachable("rdma://: a WRITE_WITH_IMM on a message channel"))


_hubs: dict[tuple[int, str], NicHub] = {}
_hubs_lock = threading.Lock()


def device_for(host: str) -> tuple[str, int, int | None]:
    """The (device, port, GID index) whose GID is this IPv4 address (RoCE), else the
    first ACTIVE port (InfiniBand: IPoIB addresses are not GIDs)."""
    report = discover()
    mapped = None
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host)
        if ip.version == 4:
            mapped = "0000:0000:0000:0000:0000:ffff:" + "{:02x}{:02x}:{:02x}{:02x}".format(
                *ip.packed)
    first = None
    for d in report.devices:
        for p in d.ports:
            if not p.active:
                continue
            first = first or (d.name, p.port, None)
            for g in p.gids:
                if mapped is not None and g.gid == mapped and g.type == "RoCE v2":
                    return d.name, p.port, g.index
    if first is None:
        raise VerbsUnavailable(f"rdma://{host}: no RDMA device with an ACTIVE port: "
                               f"{report.reason}")
    return first


def hub_for(loop: asyncio.AbstractEventLoop, host: str) -> NicHub:
    device, port, gid = device_for(host)
    with _hubs_lock:
        hub = _hubs.get((id(loop), device))
        if hub is None or hub.loop is not loop:
            hub = _hubs[(id(loop), device)] = NicHub(loop, device, port, gid)
    return hub


class RcChannel:
    def __init__(self, hub: NicHub, slot_len: int, *,
                 on_message: Callable[[memoryview], None],
                 on_close: Callable[[TransferdError | None], None]) -> None:
        if len(hub.channels) >= hub.max_channels:
            raise BadRequest(f"rdma://: {len(hub.channels)} connections already on "
                             f"{hub.nic.choice.name} (its completion queue holds no more)")
        self.hub = hub
        nic = hub.nic
        self.slot_len = slot_len
        self.on_message = on_message
        self.on_close = on_close
        self.on_drain: Callable[[], None] | None = None
        self.closed = False
        self.qp = nic.create_qp(TX_DEPTH + CREDIT_SENDS, RECV_DEPTH)
        self.info = nic.qp_info(self.qp)
        self.rx = Slots(nic, RECV_DEPTH, slot_len)
        self.recv = RecvSlots(int(WrKind.RECV), self.rx.addr, slot_len, RECV_DEPTH,
                              self.rx.reg.lkey)
        self.tx: Slots | None = None
        self.peer_slot = 0
        self._out: deque[list[memoryview]] = deque()
        self.queued = 0  # bytes waiting for a send slot
        self._paused = False
        self._held: deque[tuple[int, int]] = deque()
        self.flow: Credits | None = None  # from connect: the far side's receive depth
        self._credit_sends = 0
        self._stall: asyncio.TimerHandle | None = None
        hub.dispatcher.qps[self.info.qpn] = QpRole(self, write=False)
        hub.channels.add(self)
        for wr in self.recv.wrs:
            self.qp.post_recv(wr)

    @property
    def setup(self) -> ChannelSetup:
        return ChannelSetup(self.info, RECV_DEPTH, self.slot_len)

    def connect(self, theirs: ChannelSetup) -> None:
        self.flow = Credits(theirs.recv_depth, RECV_DEPTH)
        self.hub.nic.connect(self.qp, self.info, theirs.qp, rnr_retry=RNR_RETRY)
        self.peer_slot = theirs.slot_len
        self.tx = Slots(self.hub.nic, min(TX_DEPTH, theirs.recv_depth), theirs.slot_len)

    # -- sending ----------------------------------------------------------------------

    def send(self, views: Sequence[memoryview]) -> None:
        """One message (gathered from ``views``); waits for a free send slot."""
        n = sum(map(len, views))
        if n > self.peer_slot:
            raise BadRequest(f"rdma://: a message of {n} bytes is over the peer's "
                             f"{self.peer_slot}")
        self._out.append(list(views))
        self.queued += n
        self._pump()

    def _pump(self) -> None:
        tx, flow = self.tx, self.flow
        if tx is None or flow is None or self.closed:
            return
        while tx.free and self._out and flow.can_send():
            views = self._out.popleft()
            i = tx.free.pop()
            slot = tx.slot(i)
            pos = 0
            for v in views:  # the one copy: into registered memory
                slot[pos : pos + len(v)] = v
                pos += len(v)
            if COUNTING:
                count("verbs.send_slot", pos)
            self.queued -= pos
            if not self._post(i, (tx.addr + i * tx.length, pos, tx.reg.lkey), flow.send()):
                return
        if self._out and not flow.can_send():
            flow.waiting(self.hub.loop.time())
            if self._stall is None:
                self._stall = self.hub.loop.call_later(flow.stall_s, self._stalled)
        if flow.credit_due() and self._credit_sends < CREDIT_SENDS:
            # Zero bytes: the immediate alone (a valid, registered descriptor).
            self._credit_sends += 1
            if not self._post(-1, (tx.addr, 0, tx.reg.lkey), flow.send_credits()):
                return
        self.hub.poller.kick()

    def _post(self, slot: int, sge: tuple[int, int, int], imm: int) -> bool:
        """One SEND_WITH_IMM from ``slot`` (-1: a credit return); False when it failed
        (and the channel with it)."""
        ident = wr_id(WrKind.SEND, self.hub.sends.put((self, slot)))
        wr = build_send_wr(WrSpec(WrOpcode.SEND_WITH_IMM, [sge], imm=imm), ident)
        try:
            self.qp.post_send(wr)
        except PyverbsRDMAError as exc:
            self.fail(PeerUnreachable(f"rdma://: ibv_post_send failed: {exc}"))
            return False
        finally:
            wr.close()
        return True

    def _stalled(self) -> None:
        self._stall = None
        flow = self.flow
        if flow is None or self.closed:
            return
        err = flow.check(self.hub.loop.time())
        if err is not None:
            self.fail(err)
        elif flow.stalled_since is not None:  # stalled again since: wait the rest
            left = flow.stalled_since + flow.stall_s - self.hub.loop.time()
            self._stall = self.hub.loop.call_later(max(0.0, left), self._stalled)

    def _sent(self, slot: int, err: TransferdError | None) -> None:
        if err is not None:
            self.fail(err)
            return
        if slot < 0:
            self._credit_sends -= 1
        elif self.tx is not None:
            self.tx.free.append(slot)
        self._pump()
        if self.on_drain is not None:
            self.on_drain()

    def _credited(self, n: int) -> None:
        """A message from the far side returned ``n`` credits."""
        if self.flow is None or self.closed:
            return
        try:
            self.flow.returned(n)
        except TransferdError as exc:
            self.fail(exc)
            return
        if n:
            self._pump()

    # -- receiving ----------------------------------------------------------------------

    def _received(self, slot: int, nbytes: int) -> None:
        if nbytes == 0:
            # A credit return (its credits were taken by _credited): no message for
            # the protocol, so its receive goes back at once, paused or not.
            self._repost(slot)
            return
        if self._paused:
            self._held.append((slot, nbytes))
            return
        self._deliver(slot, nbytes)

    def _deliver(self, slot: int, nbytes: int) -> None:
        try:
            self.on_message(self.rx.slot(slot)[:nbytes])
        except TransferdError as exc:
            self.fail(exc)
            return
        self._repost(slot)

    def _repost(self, slot: int) -> None:
        if self.closed:
            return
        try:
            self.qp.post_recv(self.recv.wrs[slot])
        except PyverbsRDMAError as exc:
            self.fail(PeerUnreachable(f"rdma://: cannot repost a receive: {exc}"))
            return
        if self.flow is not None:
            self.flow.reposted()
            self._pump()  # the credit goes back with the next message, or on its own

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        while self._held and not self._paused and not self.closed:
            self._deliver(*self._held.popleft())

    # -- the end ----------------------------------------------------------------------

    def fail(self, err: TransferdError | None) -> None:
        if self.closed:
            return
        self.closed = True
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        hub = self.hub
        hub.channels.discard(self)
        hub.dispatcher.qps.pop(self.info.qpn, None)
        for i, item in list(hub.sends._items.items()):
            if item[0] is self:
                hub.sends.pop(i)
        with contextlib.suppress(PyverbsError):
            self.qp.close()
        self.recv.close()
        for s in (self.rx, self.tx):
            if s is not None:
                s.close(hub.nic)
        self._out.clear()
        # As asyncio's transports do: connection_lost comes from the loop, not from
        # inside the call that closed (the protocol may be mid-callback).
        hub.loop.call_soon(self.on_close, err)

    def close(self) -> None:
        self.fail(None)
