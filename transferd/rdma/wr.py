"""Work requests as real pyverbs objects: SendWR chains, receive slots, templates.

This module imports pyverbs; only the device code and the tests that have pyverbs
import it.  What pyverbs does with the objects shapes it:

* ``SendWR(sg=[...])`` copies the SGEs into its own ``ibv_sge`` array, so a SendWR's
  local addresses are fixed when it is built, while ``wr_id``, ``imm_data`` and the
  remote address and rkey (``set_wr_rdma``) can be set again.  ``ibv_post_send`` copies
  work requests into the send queue, so a SendWR may be reused (or closed) as soon as
  the call returns.
* ``next_wr`` stores a pointer to the next SendWR's struct and cannot be cleared, so
  every SendWR of a chain stays alive until the post returned, and a reusable template
  is only ever the tail of a chain (its own ``next`` stays NULL).
* SGE and SendWR free their arrays in ``close()``; pyverbs 44 never calls it from the
  garbage collector (the method is misnamed there), so we call it once, ourselves.

Templates filled once: the receives of every queue pair (one RecvWR per slot, reposted
as is) and, per write queue pair, the zero-length WRITE_WITH_IMM of barriers (a valid
local descriptor fixed at set-up; only wr_id, imm and the destination change).  Data
writes get fresh SendWRs: their local addresses differ every time, and pyverbs gives no
way to change a built SendWR's SGEs.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from pyverbs.wr import SGE, RecvWR, SendWR

from .constants import CHAIN_MAX, IBV_SEND_SIGNALED, WrOpcode
from .wrplan import Sge, WrSpec

# Opcodes that name a remote range (ibv_send_wr.wr.rdma): a READ reads from it.
_RDMA = (WrOpcode.RDMA_WRITE, WrOpcode.RDMA_WRITE_WITH_IMM, WrOpcode.RDMA_READ)


def build_send_wr(spec: WrSpec, wr_id: int) -> SendWR:
    sges = [SGE(a, n, k) for a, n, k in spec.sges]
    try:
        wr = SendWR(wr_id=wr_id, opcode=int(spec.opcode), num_sge=len(sges), sg=sges,
                    imm_data=socket.htonl(spec.imm) if spec.imm is not None else 0,
                    send_flags=IBV_SEND_SIGNALED)
    finally:
        for s in sges:  # copied into the SendWR
            s.close()
    if spec.opcode in _RDMA:
        wr.set_wr_rdma(spec.rkey, spec.remote_addr)
    return wr


class ZeroWriteTemplate:
    """The zero-length WRITE_WITH_IMM of one write queue pair, built once.

    Its SGE is a registered local address with length 0 (a valid descriptor, as the
    article requires for EFA and we keep everywhere)."""

    def __init__(self, sink: Sge) -> None:
        self.sink = sink
        self.wr = SendWR(opcode=int(WrOpcode.RDMA_WRITE_WITH_IMM), num_sge=1,
                         sg=[SGE(sink[0], 0, sink[2])], send_flags=IBV_SEND_SIGNALED)
        self.busy = False

    def fill(self, spec: WrSpec, wr_id: int) -> SendWR:
        assert spec.imm is not None
        self.wr.wr_id = wr_id
        self.wr.imm_data = socket.htonl(spec.imm)
        self.wr.set_wr_rdma(spec.rkey, spec.remote_addr)
        return self.wr

    def close(self) -> None:
        self.wr.close()


def is_zero_carrier(spec: WrSpec, sink: Sge) -> bool:
    return (spec.opcode == WrOpcode.RDMA_WRITE_WITH_IMM and len(spec.sges) == 1
            and spec.sges[0][1] == 0)


@dataclass
class Chain:
    """Up to CHAIN_MAX SendWRs linked through ``next``: one ibv_post_send."""

    wrs: list[SendWR] = field(default_factory=list)
    owned: list[SendWR] = field(default_factory=list)  # closed after the post

    @property
    def head(self) -> SendWR:
        return self.wrs[0]

    def close(self) -> None:
        for wr in self.owned:
            wr.close()
        self.owned.clear()


def build_chains(items: Sequence[tuple[WrSpec, int]],
                 template: ZeroWriteTemplate | None = None) -> list[Chain]:
    """Link ``(spec, wr_id)`` into chains of at most CHAIN_MAX, a template only at a tail."""
    chains: list[Chain] = []
    cur = Chain()
    # The template is one object: filled twice before the post, the first would be lost.
    spare = template
    for spec, ident in items:
        use_template = spare is not None and is_zero_carrier(spec, spare.sink)
        if use_template:
            spare = None
        wr = template.fill(spec, ident) if use_template and template else build_send_wr(
            spec, ident)
        if cur.wrs:
            cur.wrs[-1].next_wr = wr
        cur.wrs.append(wr)
        if not use_template:
            cur.owned.append(wr)
        if use_template or len(cur.wrs) == CHAIN_MAX:
            chains.append(cur)
            cur = Chain()
    if cur.wrs:
        chains.append(cur)
    return chains


class RecvSlots:
    """The receives of one queue pair: ``count`` slots of ``length`` bytes over one
    registered buffer at ``addr`` (lkey ``lkey``), one RecvWR each, built once."""

    def __init__(self, kind_id: int, addr: int, length: int, count: int, lkey: int,
                 *, stride: int | None = None) -> None:
        from .completions import WrKind, wr_id

        self.addr = addr
        self.length = length
        self.stride = length if stride is None else stride
        self.wrs: list[RecvWR] = []
        kind = WrKind(kind_id)
        for i in range(count):
            sge = SGE(addr + i * self.stride, length, lkey)
            try:
                self.wrs.append(RecvWR(wr_id=wr_id(kind, i), num_sge=1, sg=[sge]))
            finally:
                sge.close()

    def __len__(self) -> int:
        return len(self.wrs)

    def offset(self, slot: int) -> int:
        return slot * self.stride

    def close(self) -> None:
        for wr in self.wrs:
            wr.close()
        self.wrs.clear()
