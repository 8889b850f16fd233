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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transferd.engine.immcounter import ImmCounter
from transferd.engine.plan import SendPart, WritePart
from transferd.engine.regions import RegionTable
from transferd.engine.transfer import Transfer
from transferd.logs import peer_warning
from transferd.memory import Ref
from transferd.protocol.errors import BadRequest, Timeout, TransferdError
from transferd.protocol.values import NetAddr

from .tcp import TcpDomain

# Single writes split over rails are counted when their last part lands; a
# part that never comes (its sender died) must not grow this table forever.
MAX_PARTIAL = 65536

_INT = {int}


def _all_int(xs: list[Any]) -> bool:
    return set(map(type, xs)) <= _INT


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
    ) -> None:
        self.index = index
        self.node = node
        self.loop = loop
        self.regions = regions
        self.counter = counter
        self.deliver = deliver
        self.timeout_s = timeout_s
        self.chaos = chaos
        self._rng = random.Random(chaos.seed if chaos else 0)
        self.domains: list[TcpDomain] = []
        self._partial: OrderedDict[tuple[int, int, int], int] = OrderedDict()
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
    def address(self) -> NetAddr:
        return NetAddr(self.node, self.index, tuple((d.host, d.port) for d in self.domains))

    def rail_address(self, rail: int) -> NetAddr:
        return self.address.rail(rail)

    def hello_body(self, rail: int) -> dict[str, Any]:
        return {"node": self.node, "group": self.index, "rail": rail, "rails": len(self.domains)}

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

    def connect(self, addr: NetAddr) -> None:
        """Open every rail's link to a peer now, ahead of the first transfer."""
        for rail, domain in enumerate(self.domains):
            if rail < len(addr.rails):
                domain.link_to(addr.rail(rail))

    # -- receiver side ------------------------------------------------------------

    def write_views(self, rail: int, body: dict[str, Any], payload_len: int) -> list[memoryview]:
        """Check a WRITE against its region, page by page, before any byte lands."""
        views, admitted = self.admit_write(rail, body, payload_len)
        admitted.release()  # a check only: whoever lands bytes holds admit_write's Ref
        return views

    def admit_write(self, rail: int, body: dict[str, Any], payload_len: int,
                    abort: Callable[[], None] | None = None) -> tuple[list[memoryview], Ref]:
        """Check a WRITE, then admit it: the Ref holds the region until it has landed.

        Release the Ref once the bytes are in place or the write failed;
        DEREG_MR and FREE_BUFFER wait for it, and refuse writes admitted after.
        """
        try:
            rkey = int(body["rkey"])
            addrs = body["addrs"]
            lens = body["lens"]
        except (KeyError, TypeError, ValueError):
            raise BadRequest("WRITE needs rkey, addrs and lens") from None
        if not isinstance(addrs, list) or not isinstance(lens, list) or len(addrs) != len(lens):
            raise BadRequest("WRITE addrs and lens must be lists of equal length")
        region = self.regions.by_rkey(rkey, rail)
        if lens and _all_int(addrs) and _all_int(lens) and min(lens) == max(lens):
            # Pages of one length (a paged write, or one part of a single write).
            views = region.views(addrs, lens[0])
            total = lens[0] * len(views)
        else:
            views = [region.view(int(a), int(n)) for a, n in zip(addrs, lens, strict=True)]
            total = sum(map(len, views))
        if total != payload_len:
            raise BadRequest(f"pages hold {sum(lens)} bytes but the payload has {payload_len}")
        return views, region.admit(abort)

    def landed(self, peer: tuple[int, int], body: dict[str, Any], nbytes: int) -> None:
        """A WRITE's bytes are in place: count its immediate, by the counting rules."""
        self.bytes_in += nbytes
        self.writes_in += 1
        imm = body.get("imm")
        if imm is None:
            return
        count = int(body.get("count", 1))
        parts = int(body.get("parts", 1))
        if parts > 1:
            key = (peer[0], peer[1], int(body.get("op", 0)))
            left = self._partial.pop(key, parts) - 1
            if left > 0:
                self._partial[key] = left
                while len(self._partial) > MAX_PARTIAL:
                    self._partial.popitem(last=False)
                return
        self.counter.add(int(imm) & 0xFFFFFFFF, count)
        self.imms_in += count

    def close(self) -> None:
        for d in self.domains:
            d.close()
