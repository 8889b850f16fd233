"""From a write part to work requests: pure, no pyverbs, no device.

A :class:`~transferd.engine.plan.WritePart` names destination ranges (``addrs`` /
``lens``, absolute addresses in the peer's region) and source bytes (``src``, views
whose concatenation is the payload).  One RDMA WRITE writes one contiguous remote
range, gathered from up to ``max_sge`` local pieces, at most ``max_msg`` bytes; so a
part becomes one or more work requests per destination range.  Which of them carries
the immediate follows ``counting.py``:

* ``part.parts == 1`` (a paged write's frame, a whole single write, a scatter
  destination, a barrier): every destination range is its own unit, counting 1 (the
  receiver counts what landed; no count travels).
* ``part.parts > 1`` (a single write split over rails): the whole op is one unit; the
  part with the last index holds its carrier.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from transferd.parts import WritePart
from transferd.protocol.errors import BadRequest

from .constants import WrOpcode
from .mrtable import address_of

# (address, length, lkey) of one local scatter/gather entry.
Sge = tuple[int, int, int]
LkeyOf = Callable[[int, int], int]


@dataclass(slots=True)
class WrSpec:
    """One work request, before it is a pyverbs SendWR."""

    opcode: WrOpcode
    sges: list[Sge]
    remote_addr: int = 0
    rkey: int = 0
    imm: int | None = None  # host order; htonl'ed when the SendWR is built
    unit: Hashable = None  # the counting unit this WR belongs to (None: none)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self.sges)


@dataclass(slots=True)
class Unit:
    key: Hashable
    parts: int  # parts of the op that share this unit (1 unless split over rails)
    plain: list[WrSpec] = field(default_factory=list)
    carrier: WrSpec | None = None


@dataclass(slots=True)
class PartWrs:
    """A part's work requests: the plain ones (post now) and the units they count in."""

    plain: list[WrSpec]
    units: list[Unit]

    @property
    def count(self) -> int:
        return len(self.plain) + sum(u.carrier is not None for u in self.units)


def _chunks(src: list[memoryview], lens: list[int], max_msg: int, max_sge: int,
            lkey_of: LkeyOf) -> list[list[list[Sge]]]:
    """For each destination range, its WRs' scatter/gather lists, in order.

    Walks the source bytes once; a WR ends at ``max_msg`` bytes or ``max_sge`` entries.
    A zero-length range gets one WR with no entry (the caller gives it a valid one).
    """
    out: list[list[list[Sge]]] = []
    views = iter(src)
    cur: memoryview | None = None
    cur_addr = cur_left = cur_lkey = 0
    for length in lens:
        wrs: list[list[Sge]] = []
        sges: list[Sge] = []
        in_wr = 0
        left = length
        if left == 0:
            out.append([[]])
            continue
        while left:
            while cur_left == 0:
                cur = next(views, None)
                if cur is None:
                    raise BadRequest("write part has fewer source bytes than its ranges")
                cur_addr, cur_left = address_of(cur), len(cur)
                if cur_left:
                    cur_lkey = lkey_of(cur_addr, cur_left)
            take = min(left, cur_left, max_msg - in_wr)
            sges.append((cur_addr, take, cur_lkey))
            cur_addr += take
            cur_left -= take
            left -= take
            in_wr += take
            if in_wr == max_msg or len(sges) == max_sge or not left:
                wrs.append(sges)
                sges, in_wr = [], 0
        out.append(wrs)
    if cur_left or any(len(v) for v in views):
        raise BadRequest("write part has more source bytes than its ranges")
    return out


def plan_part(part: WritePart, lkey_of: LkeyOf, *, max_msg: int, max_sge: int,
              zero_sge: Sge, unit_key: Callable[[int], Hashable]) -> PartWrs:
    """The work requests of ``part``; ``unit_key(i)`` names the unit of range ``i`` of a
    part with ``parts == 1`` (a split write's unit is named by its op)."""
    if len(part.addrs) != len(part.lens):
        raise BadRequest("write part: addrs and lens differ in length")
    if not 0 <= part.rkey <= 0xFFFF_FFFF:
        # A descriptor from a tcp daemon (64-bit rkeys), or made up: refused before it
        # reaches a work request's 32-bit field.
        raise BadRequest(f"rkey 0x{part.rkey:x} is not a verbs rkey (32-bit): is the "
                         "destination a daemon with RDMA rails?")
    if part.addrs and (min(part.addrs) < 0
                       or max(map(sum, zip(part.addrs, part.lens, strict=True))) > 1 << 64):
        raise BadRequest("write part: a destination range is outside the 64-bit space")
    imm = part.imm
    if imm is not None and part.parts > 1 and len(part.addrs) != 1:
        raise BadRequest("a single write split over rails is one range per part")
    if imm is not None and not part.addrs:
        raise BadRequest("a zero-length write needs a destination descriptor "
                         "(address and rkey), even on verbs")
    ranges = _chunks(part.src, part.lens, max_msg, max_sge, lkey_of)
    plain: list[WrSpec] = []
    units: list[Unit] = []
    split = part.parts > 1
    split_unit = Unit(("op", part.op), part.parts) if split and imm is not None else None
    for i, (addr, wr_sges) in enumerate(zip(part.addrs, ranges, strict=True)):
        specs: list[WrSpec] = []
        pos = addr
        for sges in wr_sges:
            spec = WrSpec(WrOpcode.RDMA_WRITE, sges or [zero_sge], pos, part.rkey)
            pos += sum(n for _, n, _ in sges)
            specs.append(spec)
        if imm is None:
            plain += specs
            continue
        unit = split_unit if split_unit is not None else Unit(unit_key(i), 1)
        carrier_here = not split or part.index == part.parts - 1
        if carrier_here:
            carrier = specs.pop()
            carrier.opcode = WrOpcode.RDMA_WRITE_WITH_IMM
            carrier.imm = imm
            carrier.unit = unit.key
            unit.carrier = carrier
        for s in specs:
            s.unit = unit.key
        unit.plain = specs
        plain += specs
        if split_unit is None:
            units.append(unit)
    if split_unit is not None:
        units.append(split_unit)
    return PartWrs(plain, units)
