"""One NIC's verbs resources through pyverbs: context, protection domain, completion
queue and channel, RC queue pairs, memory registration.

Imports pyverbs (through :func:`~.loader.load_pyverbs`); built on the group's worker
thread, after it was pinned, so the queues' memory comes from its NUMA node.
"""

from __future__ import annotations

import errno
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from transferd.protocol.errors import BadRequest

from . import dmabuf
from .access import mr_access, qp_access, rd_atomic
from .chanfd import EVENT_FILES_LOCK, open_channel
from .devices import ZERO_GID, discover, peer_memory_loaded
from .dmabuf import CudaDriver
from .exchange import MTU_BYTES, QpInfo, path_mtu
from .loader import VerbsUnavailable, load_pyverbs
from .mrtable import MrTable, Registration

log = logging.getLogger("transferd.verbs")

load_pyverbs()  # raises VerbsUnavailable naming what is missing

import pyverbs.enums as e  # noqa: E402
from pyverbs.addr import GID, AHAttr, GlobalRoute  # noqa: E402
from pyverbs.cq import CQ, CompChannel  # noqa: E402
from pyverbs.device import Context  # noqa: E402
from pyverbs.mr import MR  # noqa: E402
from pyverbs.pd import PD  # noqa: E402
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError  # noqa: E402
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr  # noqa: E402

# RC set-up, as rdma-core's tests and ibv_rc_pingpong use them.
MIN_RNR_TIMER = 12
TIMEOUT = 14  # 4.096 us * 2^14: 67 ms per try
RETRY_CNT = 7
RNR_RETRY = 7  # 7 = retry forever while the receiver has no receive posted
HOP_LIMIT = 64
SINK_LEN = 64

ACCESS = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
          # An optional flag: libibverbs and the kernel drop it where the device
          # cannot honour it, so it is set "where supported" by always asking.
          | e.IBV_ACCESS_RELAXED_ORDERING)
# What the NIC only reads locally (the source of writes: staging).
LOCAL_ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_RELAXED_ORDERING


@dataclass(frozen=True)
class NicChoice:
    name: str
    port: int
    gid_index: int
    link_layer: int
    lid: int
    mtu: int  # ibv_mtu enum
    max_msg: int
    max_sge: int
    max_qp_wr: int
    max_cqe: int
    # READs a queue pair may have in flight as initiator / serve as responder.
    max_qp_init_rd_atom: int = 1
    max_qp_rd_atom: int = 1

    @property
    def rd_atomic(self) -> tuple[int, int]:
        """(max_rd_atomic, max_dest_rd_atomic) of our queue pairs on this device."""
        return rd_atomic(self.max_qp_init_rd_atom, self.max_qp_rd_atom)


def choose(ctx: Any, name: str, port: int, gid_index: int | None) -> NicChoice:
    """Check the port and pick the GID: RoCE v2 IPv4-mapped first on Ethernet."""
    dattr = ctx.query_device()
    if not 1 <= port <= dattr.phys_port_cnt:
        raise VerbsUnavailable(f"{name} has {dattr.phys_port_cnt} port(s), not port {port}")
    pattr = ctx.query_port(port)
    if pattr.state != e.IBV_PORT_ACTIVE:
        raise VerbsUnavailable(f"{name} port {port} is not ACTIVE (state {pattr.state})")
    if gid_index is None:
        gid_index = 0
        if pattr.link_layer == e.IBV_LINK_LAYER_ETHERNET:
            best = None
            for i in range(pattr.gid_tbl_len):
                try:
                    gid = ctx.query_gid(port, i).gid
                    kind = ctx.query_gid_type(port, i)
                except PyverbsError:
                    continue
                if gid == ZERO_GID:
                    continue
                v4 = gid.startswith("0000:0000:0000:0000:0000:ffff:")
                rank = (kind == e.IBV_GID_TYPE_SYSFS_ROCE_V2, v4)
                if best is None or rank > best[0]:
                    best = (rank, i)
            if best is None:
                raise VerbsUnavailable(f"{name} port {port} has no GID: give its netdev an "
                                       "IP address")
            gid_index = best[1]
    return NicChoice(name, port, gid_index, pattr.link_layer, pattr.lid, pattr.active_mtu,
                     pattr.max_msg_sz, max(1, min(dattr.max_sge, 30)), dattr.max_qp_wr,
                     dattr.max_cqe, dattr.max_qp_init_rd_atom, dattr.max_qp_rd_atom)


def init_attr(port: int, reads: bool) -> QPAttr:
    """The attributes a new RC queue pair is taken to INIT with.  Its access flags are
    set here and only here: pyverbs' to_rtr / to_rts masks carry no
    IBV_QP_ACCESS_FLAGS (rdma-core pyverbs/qp.pyx ``_get_comp_mask``, 44 to 64), so a
    queue pair that serves READs (``reads``: a write queue pair) gets REMOTE_READ now."""
    attr = QPAttr(port_num=port)
    attr.qp_access_flags = qp_access(reads)
    return attr


def rtr_rts_attr(port: int, mine: QpInfo, theirs: QpInfo, rnr_retry: int = RNR_RETRY,
                 *, reads: tuple[int, int] | None = None) -> QPAttr:
    """The attributes that take our RC queue pair to RTR then RTS, connected to theirs.

    ``reads``: (max_rd_atomic, max_dest_rd_atomic) of a queue pair that posts and serves
    RDMA READs (a write queue pair); None: one that does neither (send/recv), no remote
    read access.  Which regions a READ may read is still each MR's own flags."""
    attr = QPAttr(port_num=port, path_mtu=path_mtu(mine, theirs))
    # As at INIT (init_attr), for a reader of this attr: pyverbs does not apply it here.
    attr.qp_access_flags = qp_access(reads is not None)
    attr.dest_qp_num = theirs.qpn
    attr.rq_psn = theirs.psn  # what they will send first
    attr.sq_psn = mine.psn  # what we send first
    attr.max_rd_atomic, attr.max_dest_rd_atomic = reads or (1, 1)
    attr.min_rnr_timer = MIN_RNR_TIMER
    attr.timeout = TIMEOUT
    attr.retry_cnt = RETRY_CNT
    attr.rnr_retry = rnr_retry
    if any(theirs.gid):
        gr = GlobalRoute(dgid=GID(theirs.gid_text), sgid_index=mine.gid_index,
                         hop_limit=HOP_LIMIT)
        attr.ah_attr = AHAttr(port_num=port, is_global=1, gr=gr, dlid=theirs.lid)
    else:  # InfiniBand inside one subnet: the LID routes
        attr.ah_attr = AHAttr(port_num=port, is_global=0, dlid=theirs.lid)
    return attr


class Nic:
    """One rail's device port: the resources every peer's queue pairs share."""

    def __init__(self, name: str, port: int = 1, gid_index: int | None = None,
                 cq_depth: int = 1 << 16) -> None:
        report = discover()
        names = [d.name for d in report.devices]
        if name not in names:
            why = report.reason or f"the devices here are {', '.join(names)}"
            raise VerbsUnavailable(f"RDMA device {name!r} not found: {why}")
        try:
            with EVENT_FILES_LOCK:  # its async-event file: see chanfd
                self.ctx = Context(name=name)
        except PyverbsError as exc:
            raise VerbsUnavailable(f"cannot open RDMA device {name!r}: {exc}") from None
        self.choice = choose(self.ctx, name, port, gid_index)
        c = self.choice
        self.gid = QpInfo.gid_from_text(self.ctx.query_gid(c.port, c.gid_index).gid)
        self.pd = PD(self.ctx)
        opened = open_channel(lambda: CompChannel(self.ctx))
        self.channel = opened.channel
        # What the completion-queue loop waits on (None: it polls on a timer).
        self.channel_fd = opened.fd
        self.wakeup = opened.how
        if opened.fd is None:
            log.warning("%s: no completion channel descriptor (%s)", name, opened.how)
        self.cq_depth = min(cq_depth, c.max_cqe)
        self.cq = CQ(self.ctx, self.cq_depth, None, self.channel, 0)
        self.cq.req_notify()
        self.mrs = MrTable()
        # The local end of every zero-length write, and the buffer the write queue
        # pairs' receives name (a WRITE_WITH_IMM consumes a receive but writes nothing
        # into it).
        self.sink = MR(self.pd, SINK_LEN, e.IBV_ACCESS_LOCAL_WRITE)
        self.mrs.add(Registration(self.sink.buf, SINK_LEN, self.sink.lkey, self.sink.rkey,
                                  self.sink))

    @property
    def sink_sge(self) -> tuple[int, int, int]:
        return (self.sink.buf, SINK_LEN, self.sink.lkey)

    # -- memory ---------------------------------------------------------------------------

    def register(self, addr: int, length: int, device: str = "cpu", *,
                 remote: bool = True, access: str = "w") -> Registration:
        """Register [addr, addr + length) for local use and (``remote``) the remote
        rights ``access`` grants ("w": writes into it, "r": READs of it, "rw": both;
        ``reads.mr_access``), staging local only (nobody gets its rkey).  The same
        memory may be registered again (its own rkey, deregistered on its own); every
        failure is a TransferdError and leaves nothing registered."""
        try:
            if device.startswith("cuda"):
                mr = self._register_cuda(addr, length, mr_access(access))
            else:
                flags = mr_access(access) if remote else LOCAL_ACCESS
                mr = MR(self.pd, length, flags, address=addr)
        except PyverbsRDMAError as exc:
            if exc.error_code in (errno.ENOMEM, errno.EPERM):
                raise VerbsUnavailable(
                    f"ibv_reg_mr of {length} bytes failed ({exc}): raise RLIMIT_MEMLOCK "
                    "(docs/rdma.md)") from None
            raise BadRequest(f"ibv_reg_mr of {length} bytes on {self.choice.name} failed: "
                             f"{exc}") from None
        except PyverbsError as exc:  # pyverbs' own checks (arguments, a closed PD)
            raise BadRequest(f"cannot register {length} bytes on {self.choice.name}: "
                             f"{exc}") from None
        reg = Registration(addr, length, mr.lkey, mr.rkey, mr)
        try:
            self.mrs.add(reg)
        except BaseException:
            mr.close()  # refused by the table: not left pinned
            raise
        return reg

    def _register_cuda(self, addr: int, length: int, flags: int) -> Any:
        if peer_memory_loaded():
            # nvidia-peermem: the NIC reads and writes GPU memory by its virtual address,
            # so the region's rkey works with the addresses its MrDesc names.
            return MR(self.pd, length, flags, address=addr)
        # dma-buf (register_dmabuf below) registers with iova = offset in pyverbs, so
        # the NIC would address the region from 0, while an MrDesc names every rail's
        # memory by one address, the buffer's.  Refused with the reason until the
        # descriptor carries a base per rail.
        raise VerbsUnavailable(
            "CUDA memory on this NIC needs nvidia-peermem (modprobe nvidia-peermem): "
            "without it only dma-buf is possible, which pyverbs registers with iova = "
            "offset, not the buffer's address (docs/rdma.md)")

    def register_dmabuf(self, addr: int, length: int, ordinal: int,
                        driver: CudaDriver | None = None) -> tuple[Any, int]:
        """Register CUDA memory of device ``ordinal`` through dma-buf: (the MR, the iova
        the NIC expects: the range's offset in its page-aligned dma-buf, as pyverbs
        registers with iova = offset).  The export runs with that device's context
        current; the dma-buf fd is closed on every path."""
        from pyverbs.mr import DmaBufMR

        fd, offset = dmabuf.export(driver or CudaDriver.load(), addr, length, ordinal)

        def reg(fd: int) -> Any:
            try:
                return DmaBufMR(self.pd, length, ACCESS, dmabuf=fd, offset=offset)
            except PyverbsError as exc:
                raise BadRequest(f"ibv_reg_dmabuf_mr of {length} bytes on "
                                 f"{self.choice.name} failed: {exc}") from None

        return dmabuf.register_closing(fd, reg), offset

    def deregister(self, reg: Registration) -> None:
        self.mrs.remove(reg)
        # ibv_dereg_mr revokes the rkey in the NIC: a write in flight to it fails at the
        # initiator with REM_ACCESS_ERR, and none lands after this returns.
        try:
            reg.handle.close()
        except PyverbsError as exc:
            raise BadRequest(f"ibv_dereg_mr of [0x{reg.addr:x}, +{reg.length}) on "
                             f"{self.choice.name} failed: {exc}") from None

    # -- queue pairs ------------------------------------------------------------------------

    def create_qp(self, send_depth: int, recv_depth: int, *, reads: bool = False) -> Any:
        """An RC queue pair left in INIT; ``reads``: it posts and serves RDMA READs."""
        c = self.choice
        cap = QPCap(max_send_wr=min(send_depth, c.max_qp_wr),
                    max_recv_wr=min(recv_depth, c.max_qp_wr),
                    max_send_sge=c.max_sge, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap,
                          sq_sig_all=0)
        try:
            return QP(self.pd, init, init_attr(c.port, reads))  # RC: left in INIT
        except PyverbsRDMAError as exc:
            raise VerbsUnavailable(f"cannot create an RC queue pair on {c.name}: {exc}") \
                from None

    def qp_info(self, qp: Any, psn: int | None = None) -> QpInfo:
        c = self.choice
        return QpInfo(qp.qp_num, secrets.randbits(24) if psn is None else psn, c.lid,
                      c.port, self.gid, c.gid_index, c.mtu)

    def connect(self, qp: Any, mine: QpInfo, theirs: QpInfo,
                rnr_retry: int = RNR_RETRY, *, reads: tuple[int, int] | None = None) -> None:
        """``reads``: (max_rd_atomic, max_dest_rd_atomic) of a queue pair that posts and
        serves RDMA READs (a write queue pair)."""
        c = self.choice
        try:
            qp.to_rts(rtr_rts_attr(c.port, mine, theirs, rnr_retry, reads=reads))
        except PyverbsRDMAError as exc:
            raise BadRequest(f"cannot connect queue pair {mine.qpn} to the peer's "
                             f"{theirs.qpn} (MTU {MTU_BYTES[path_mtu(mine, theirs)]}): "
                             f"{exc}") from None

    def close(self) -> None:
        # Closing the context closes what was made from it, in order.
        self.ctx.close()
