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
that listener's host and port): the initiator's HELLO carries its two queue pairs'
:class:`~.exchange.RailSetup`, the responder creates its pair, connects them and answers
with its own, and the initiator connects.  The TCP connection stays open for the life of
the queue pairs: when it closes, they are torn down and every write in flight fails.

Completions: one completion queue per NIC, polled on the group's worker loop by a
:class:`~.cqloop.CqPoller` (busy-poll for a bounded time, then the completion channel).

This module needs a device; what it builds on (``sender``, ``counting``, ``completions``,
``wrplan``, ``exchange``) is pure and tested without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import mmap
import socket
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from transferd.engine.plan import SendPart, WritePart
from transferd.engine.transfer import Transfer
from transferd.protocol.errors import (
    BadRequest,
    PeerUnreachable,
    TransferdError,
    error_from_body,
)
from transferd.protocol.frames import Frame
from transferd.protocol.peer import PeerCommand
from transferd.protocol.values import NetAddr

from ..stream import FramedStream
from . import messages
from .completions import Dispatcher, QpRole, WrIds, WrKind, split_wr_id, wr_id
from .cqloop import CqPoller
from .exchange import RailSetup, check_pair
from .mrtable import Registration, address_of
from .resources import SINK_LEN, Nic, PyverbsError, PyverbsRDMAError
from .sender import Posted, Sender
from .sendq import SendQueue
from .wr import RecvSlots, ZeroWriteTemplate, build_chains

if TYPE_CHECKING:
    from ..group import DomainGroup

log = logging.getLogger("transferd.verbs")

SEND_DEPTH = 512  # send work requests in flight per queue pair
WRITE_RECV_DEPTH = 1024  # WRITE_WITH_IMMs towards us in flight per peer and rail
MSG_DEPTH = 32  # message slots per send/recv queue pair, each way
MSG_LEN = 64 * 1024  # one message slot: the largest two-sided frame on a verbs rail
WR_IDS = 1 << 16  # work requests in flight per NIC
CONNECT_TIMEOUT = 10.0
CLOSE_GRACE_S = 5.0


class LinkState(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    CLOSED = "closed"


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(256)
    sock.setblocking(False)
    return sock


class _Slots:
    """Host memory in fixed slots, registered with the NIC (message buffers)."""

    def __init__(self, nic: Nic, count: int, length: int) -> None:
        self.length = length
        self.map = mmap.mmap(-1, count * length)
        self.view = memoryview(self.map)
        self.addr = address_of(self.view)
        self.reg: Registration = nic.register(self.addr, count * length)
        self.free = list(range(count - 1, -1, -1))

    def slot(self, i: int) -> memoryview:
        return self.view[i * self.length : (i + 1) * self.length]

    def close(self, nic: Nic) -> None:
        with contextlib.suppress(TransferdError, PyverbsError):
            nic.deregister(self.addr)
        self.view.release()
        self.map.close()


class QpEnd:
    """One of our RC queue pairs towards one peer: what the Sender posts on."""

    def __init__(self, domain: VerbsDomain, owner: Any, write: bool) -> None:
        nic = domain.nic
        self.domain = domain
        self.owner = owner
        self.write = write
        self.qp = nic.create_qp(SEND_DEPTH, WRITE_RECV_DEPTH if write else MSG_DEPTH)
        self.info = nic.qp_info(self.qp)
        self.max_msg = nic.choice.max_msg
        self.max_sge = nic.choice.max_sge
        self.queue: SendQueue[Posted] = SendQueue(SEND_DEPTH, self._post)
        self.template = ZeroWriteTemplate((nic.sink.buf, 0, nic.sink.lkey)) if write else None
        self.rx: _Slots | None = None
        self.tx: _Slots | None = None
        if write:
            # Every write receive names the same sink: WRITE_WITH_IMM writes nothing
            # into a receive buffer, and a stray SEND of more than SINK_LEN breaks the
            # queue pair instead of landing anywhere.
            self.recv = RecvSlots(int(WrKind.WRITE_RECV), nic.sink.buf, SINK_LEN,
                                  WRITE_RECV_DEPTH, nic.sink.lkey, stride=0)
        else:
            self.rx = _Slots(nic, MSG_DEPTH, MSG_LEN)
            self.tx = _Slots(nic, MSG_DEPTH, MSG_LEN)
            self.recv = RecvSlots(int(WrKind.RECV), self.rx.addr, MSG_LEN, MSG_DEPTH,
                                  self.rx.reg.lkey)
        self._tx_waiting: deque[tuple[int, dict[str, Any], bytes, Any]] = deque()
        domain.dispatcher.qps[self.info.qpn] = QpRole(self, write)
        domain.qps[self.info.qpn] = self
        for wr in self.recv.wrs:
            self.qp.post_recv(wr)

    def connect(self, theirs: Any) -> None:
        self.domain.nic.connect(self.qp, self.info, theirs)

    def repost(self, slot: int) -> None:
        try:
            self.qp.post_recv(self.recv.wrs[slot])
        except PyverbsRDMAError as exc:
            self.owner.close(PeerUnreachable(f"cannot repost a receive: {exc}"))

    # -- posting ----------------------------------------------------------------------

    def _post(self, batch: Sequence[Posted]) -> None:
        d = self.domain
        items = []
        for p in batch:
            items.append((p.spec, wr_id(WrKind.SEND, d.wrids.put(p))))
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

    def send_frame(self, cmd: int, body: dict[str, Any], payload: bytes,
                   on_done: Any) -> None:
        """One frame in one SEND, copied into a registered slot (waits for a free one)."""
        assert self.tx is not None
        if not self.tx.free:
            if len(self._tx_waiting) >= SEND_DEPTH * 4:
                raise BadRequest("too many messages waiting for a send slot")
            self._tx_waiting.append((cmd, body, payload, on_done))
            return
        i = self.tx.free.pop()
        try:
            n = messages.encode_into(self.tx.slot(i), cmd, body, payload)
        except TransferdError:
            self.tx.free.append(i)
            raise

        def sent(err: TransferdError | None) -> None:
            assert self.tx is not None
            self.tx.free.append(i)
            if on_done is not None:
                on_done(err)
            if self._tx_waiting and self.tx.free:
                self.send_frame(*self._tx_waiting.popleft())

        sge = (self.tx.addr + i * self.tx.length, n, self.tx.reg.lkey)
        self.domain.sender.send(self, sge, sent)

    def received(self, slot: int, nbytes: int) -> Frame:
        assert self.rx is not None
        try:
            return messages.parse(self.rx.slot(slot)[:nbytes])
        finally:
            self.repost(slot)  # the frame's bytes were copied out

    def close(self) -> None:
        d = self.domain
        d.dispatcher.qps.pop(self.info.qpn, None)
        d.qps.pop(self.info.qpn, None)
        for p in d.fail_wrs_of(self):
            d.sender.completed(p, PeerUnreachable("queue pair closed"))
        for _, _, _, on_done in self._tx_waiting:
            if on_done is not None:
                on_done(PeerUnreachable("queue pair closed"))
        self._tx_waiting.clear()
        for q in self.queue.drain():
            d.sender.completed(q, PeerUnreachable("queue pair closed"))
        with contextlib.suppress(PyverbsError):
            self.qp.close()
        self.recv.close()
        if self.template is not None:
            self.template.close()
        for s in (self.rx, self.tx):
            if s is not None:
                s.close(d.nic)


class VerbsDomain:
    """One rail: a NIC port, its set-up listener, and its links to peers."""

    def __init__(self, group: DomainGroup, rail: int, host: str, port: int = 0, *,
                 device: str, ib_port: int = 1, gid_index: int | None = None) -> None:
        self.group = group
        self.rail = rail
        self.host = host
        self.loop = group.loop
        self.nic = Nic(device, ib_port, gid_index)  # VerbsUnavailable names what is missing
        self.sender = shared_sender(group)
        self.wrids: WrIds[Posted] = WrIds(WR_IDS)
        self.qps: dict[int, QpEnd] = {}
        self.dispatcher: Dispatcher[Posted] = Dispatcher(
            self.wrids, on_send_done=self.sender.completed, on_imm=self._on_imm,
            on_message=self._on_message, repost=self._repost, on_broken=self._on_broken)
        self._listener = _listen(host, port)
        self.port = self._listener.getsockname()[1]
        self._links: dict[tuple[int, int], OutLink] = {}
        self._inbound: set[InLink] = set()
        self.poller = CqPoller(self.loop, self.nic.cq, self.nic.channel,
                               self.dispatcher.dispatch)
        self.loop.add_reader(self._listener.fileno(), self._accept)

    # -- memory -------------------------------------------------------------------------

    def register(self, addr: int, length: int, device: str = "cpu") -> int:
        """Register memory for remote writes on this NIC: the rkey for the MrDesc."""
        return self.nic.register(addr, length, device).rkey

    def deregister(self, addr: int) -> None:
        self.nic.deregister(addr)

    # -- outbound ---------------------------------------------------------------------

    def link_to(self, dst: NetAddr) -> OutLink:
        link = self._links.get(dst.key)
        if link is None or link.state is LinkState.CLOSED:
            link = OutLink(self, dst)
            self._links[dst.key] = link
        return link

    def post(self, part: WritePart | SendPart, transfer: Transfer) -> None:
        try:
            self.link_to(part.dst).submit(part, transfer)
        except TransferdError as exc:
            transfer.fail(exc)

    def forget(self, link: OutLink) -> None:
        if self._links.get(link.dst.key) is link:
            del self._links[link.dst.key]

    def fail_wrs_of(self, qp: QpEnd) -> list[Posted]:
        """Take back the work requests of a queue pair that is going away."""
        mine = [i for i, p in self.wrids._items.items() if p.link is qp]
        return [p for i in mine if (p := self.wrids.pop(i)) is not None]

    # -- inbound ----------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("verbs rail %d: accept failed: %s", self.rail, exc)
                return
            self._inbound.add(InLink(self, sock))

    def _on_imm(self, qp: QpEnd, imm: int, nbytes: int) -> None:
        owner = qp.owner
        if isinstance(owner, InLink) and owner.peer is not None:
            # One WRITE_WITH_IMM completion is one unit: it adds 1 (counting.py).
            self.group.landed_imm(owner.peer, imm, nbytes)

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


class _SetupLink:
    """What OutLink and InLink share: the TCP set-up connection and two queue pairs."""

    domain: VerbsDomain
    send: QpEnd | None = None
    write: QpEnd | None = None
    stream: FramedStream | None = None
    state = LinkState.CONNECTING

    def _make_qps(self) -> RailSetup:
        self.send = QpEnd(self.domain, self, write=False)
        self.write = QpEnd(self.domain, self, write=True)
        g = self.domain.group
        return RailSetup(g.node, g.index, self.domain.rail, len(g.domains), self.send.info,
                         self.write.info, MSG_DEPTH, WRITE_RECV_DEPTH, MSG_LEN,
                         self.domain.nic.choice.max_msg)

    def _connect_qps(self, mine: RailSetup, raw: Any) -> RailSetup:
        if not isinstance(raw, bytes):
            raise BadRequest("verbs HELLO without a rail set-up")
        theirs = RailSetup.from_bytes(raw)
        check_pair(mine, theirs)
        assert self.send is not None and self.write is not None
        self.send.connect(theirs.send_qp)
        self.write.connect(theirs.write_qp)
        return theirs

    def _close_qps(self) -> None:
        for qp in (self.send, self.write):
            if qp is not None:
                qp.close()
        self.send = self.write = None
        if self.stream is not None:
            self.stream.close()


class OutLink(_SetupLink):
    """Our queue pairs towards one peer's rail: our writes and messages go out here."""

    def __init__(self, domain: VerbsDomain, dst: NetAddr) -> None:
        self.domain = domain
        self.dst = dst
        self.state = LinkState.CONNECTING
        self._waiting: deque[tuple[WritePart | SendPart, Transfer]] = deque()
        self._pending: dict[tuple[int, int], Transfer] = {}
        self._setup = self._make_qps()
        self._task = domain.loop.create_task(self._connect())

    async def _connect(self) -> None:
        host, port = self.dst.rails[0]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self.domain.host, 0))
            sock.setblocking(False)
            await asyncio.wait_for(self.domain.loop.sock_connect(sock, (host, port)),
                                   CONNECT_TIMEOUT)
        except (TimeoutError, OSError) as exc:
            sock.close()
            self.close(PeerUnreachable(f"verbs rail {self.domain.rail}: cannot reach "
                                       f"{host}:{port} to set up: {exc or 'timed out'}"))
            return
        if self.state is LinkState.CLOSED:
            sock.close()
            return
        self.stream = FramedStream(self.domain.loop, sock, on_frame=self._on_frame,
                                   on_close=self._on_close, max_payload=0)
        body = self.domain.group.hello_body(self.domain.rail)
        body["verbs"] = self._setup.to_bytes()
        self.stream.send(PeerCommand.HELLO, 0, 0, body)

    def _on_frame(self, frame: Frame) -> None:
        if frame.cmd != PeerCommand.HELLO or self.state is not LinkState.CONNECTING:
            self.close(BadRequest(f"unexpected set-up frame 0x{frame.cmd:02x}"))
            return
        if frame.is_error:
            self.close(error_from_body(frame.body))
            return
        try:
            self._connect_qps(self._setup, frame.body.get("verbs"))
        except TransferdError as exc:
            self.close(exc)
            return
        self.state = LinkState.READY
        waiting, self._waiting = self._waiting, deque()
        for part, transfer in waiting:
            self._send(part, transfer)

    def submit(self, part: WritePart | SendPart, transfer: Transfer) -> None:
        if self.state is LinkState.READY:
            self._send(part, transfer)
        elif self.state is LinkState.CLOSED:
            transfer.fail(PeerUnreachable(f"verbs link to {self.dst} is closed"))
        else:
            self._waiting.append((part, transfer))

    def _send(self, part: WritePart | SendPart, transfer: Transfer) -> None:
        if transfer.finished:
            return
        assert self.write is not None and self.send is not None
        if isinstance(part, WritePart):
            self.domain.sender.write(self.write, part, transfer)
            return
        key = (part.op, part.index)
        self._pending[key] = transfer

        def sent(err: TransferdError | None) -> None:
            if err is not None and self._pending.pop(key, None) is transfer:
                transfer.fail(err)

        try:
            self.send.send_frame(PeerCommand.SEND, {"op": part.op, "part": part.index},
                                 part.msg, sent)
        except TransferdError as exc:
            self._pending.pop(key, None)
            transfer.fail(exc)

    def on_message(self, frame: Frame) -> None:
        """An ACK for one of our messages (the peer's client has it, or cannot)."""
        if frame.cmd != PeerCommand.ACK:
            self.close(BadRequest(f"unexpected message 0x{frame.cmd:02x} on a verbs link"))
            return
        key = (frame.body.get("op", -1), frame.body.get("part", -1))
        transfer = self._pending.pop(key, None)
        if transfer is not None:
            transfer.part_done(None if frame.body.get("ok") else error_from_body(frame.body))

    def _on_close(self, exc: BaseException | None) -> None:
        reason = f": {exc}" if exc else ""
        self.close(PeerUnreachable(f"verbs link to {self.dst} rail {self.domain.rail} "
                                   f"closed{reason}"))

    def close(self, error: TransferdError) -> None:
        if self.state is LinkState.CLOSED:
            return
        self.state = LinkState.CLOSED
        self.domain.forget(self)
        waiting, self._waiting = self._waiting, deque()
        pending, self._pending = self._pending, {}
        self._close_qps()
        for _, transfer in waiting:
            transfer.fail(error)
        for transfer in pending.values():
            transfer.fail(error)


class InLink(_SetupLink):
    """A peer's queue pairs towards us: its writes land and its messages arrive here."""

    def __init__(self, domain: VerbsDomain, sock: socket.socket) -> None:
        self.domain = domain
        self.peer: tuple[int, int] | None = None
        self.state = LinkState.CONNECTING
        self.stream = FramedStream(domain.loop, sock, on_frame=self._on_frame,
                                   on_close=self._on_close, max_payload=0)

    def _on_frame(self, frame: Frame) -> None:
        g = self.domain.group
        if frame.cmd != PeerCommand.HELLO or self.peer is not None:
            self.close(BadRequest(f"unexpected set-up frame 0x{frame.cmd:02x}"))
            return
        body = frame.body
        assert self.stream is not None
        try:
            if body.get("rails") != len(g.domains):
                raise BadRequest(f"rail count mismatch: peer has {body.get('rails')} "
                                 f"rail(s), this daemon {len(g.domains)}")
            mine = self._make_qps()
            self._connect_qps(mine, body.get("verbs"))
        except TransferdError as exc:
            self.stream.send(PeerCommand.HELLO, 0x02, 0, exc.to_body())
            self.close(exc)
            return
        self.peer = (int(body.get("node", 0)), int(body.get("group", 0)))
        self.state = LinkState.READY
        reply = g.hello_body(self.domain.rail)
        reply["verbs"] = mine.to_bytes()
        self.stream.send(PeerCommand.HELLO, 0, 0, reply)

    def on_message(self, frame: Frame) -> None:
        """A two-sided message: acknowledged once a client has it."""
        if frame.cmd != PeerCommand.SEND or self.peer is None:
            self.close(BadRequest(f"unexpected message 0x{frame.cmd:02x} on a verbs link"))
            return
        ref = {"op": frame.body.get("op"), "part": frame.body.get("part")}
        loop = self.domain.loop

        def ack(err: TransferdError | None) -> None:
            loop.call_soon_threadsafe(self._ack, ref, err)

        self.domain.group.deliver(self.peer, bytes(frame.payload or b""), ack)

    def _ack(self, ref: dict[str, Any], error: TransferdError | None) -> None:
        if self.send is None or self.state is LinkState.CLOSED:
            return
        body = dict(ref)
        body.update({"ok": True} if error is None else error.to_body())
        try:
            self.send.send_frame(PeerCommand.ACK, body, b"", None)
        except TransferdError as exc:
            self.close(exc)

    def _on_close(self, exc: BaseException | None) -> None:
        self.close(PeerUnreachable("set-up connection closed"))

    def close(self, error: TransferdError) -> None:
        if self.state is LinkState.CLOSED:
            return
        self.state = LinkState.CLOSED
        self.domain._inbound.discard(self)
        self._close_qps()


def shared_sender(group: Any) -> Sender:
    """The group's Sender (its carrier gate spans the group's rails)."""
    sender = getattr(group, "_verbs_sender", None)
    if sender is None:
        sender = Sender(lambda link: lambda a, n: link.domain.nic.mrs.find(a, n).lkey,
                        lambda link: (link.domain.nic.sink.buf, 0, link.domain.nic.sink.lkey))
        group._verbs_sender = sender
    return sender

