"""Turning a submit into wire parts, sharded over the rails of a domain group.

Pure functions, no I/O: given what the client asked for and how many rails
there are, produce :class:`WritePart` s.  The counting rules of DESIGN.md are
the receiver's, from what lands (no count travels): a single write adds
exactly 1 to its immediate however many parts carried it (a split write's
parts each name its whole ``span``, and the receiver counts once the parts
covered it); a paged write adds 1 per page placed; a scatter 1 per
destination; a barrier (a frame of no pages) 1 per peer.

Each part also carries its destination's address and rkey on every rail
(``alts``), so that the group can re-send it on another rail if its own fails
(rail failover, :mod:`transferd.domains.group`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from transferd.parts import SPLIT_ALIGN, SendPart, WritePart, split_sizes
from transferd.protocol.errors import BadRequest, OutOfBounds
from transferd.protocol.values import MrDesc, Pages

# Below this a single write goes whole over one rail: splitting a small write
# buys no bandwidth and costs a frame per rail.
SPLIT_MIN = 1 << 20
# Pages per WRITE frame: bounds the iovec list and the frame body.
PAGES_PER_FRAME = 256
# A verified single write (or read) goes in parts of at most this many bytes: each
# part's checksum is taken just before it goes and checked as it lands, while the parts
# before and after it are on the wire (one checksum of a whole gigabyte would be a
# pause of its own at each end: docs/integrity.md, "What it costs").
VERIFY_PART = 8 << 20


@dataclass
class Plan:
    parts: list[WritePart | SendPart] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts if isinstance(p, WritePart))


def check_rails(desc_rails: int, rails: int, who: str) -> None:
    if desc_rails != rails:
        raise BadRequest(
            f"rail count mismatch: this daemon has {rails} rail(s) per domain group, "
            f"{who} has {desc_rails}; every peer must have the same number of NICs"
        )


# The highest address a peer frame carries (its struct packs a u64).
U64 = (1 << 64) - 1


def check_space(desc: MrDesc, end: int) -> None:
    """A peer range ``[.., end)`` relative to ``desc`` (whose ``size`` is 0, unknown: no
    region bound checked it) ends inside the 64-bit address space."""
    if desc.ptr + end > U64:
        raise OutOfBounds(f"[0x{desc.ptr:x} + {end}) runs past the end of the 64-bit "
                          "address space")


def _check_dst(desc: MrDesc, off: int, length: int) -> None:
    # The receiver checks authoritatively; failing early here saves a round trip.
    if desc.size and (off < 0 or off + length > desc.size):
        raise OutOfBounds(f"[{off}, {off + length}) is outside the remote region of {desc.size}")


def plan_single(
    op: int, length: int, imm: int | None, src: memoryview, desc: MrDesc, dst_off: int,
    rails: int, *, split_min: int = SPLIT_MIN, max_parts: int | None = None,
) -> list[WritePart]:
    rkeys = desc.rkeys
    if len(rkeys) != rails:
        check_rails(len(rkeys), rails, f"region at 0x{desc.ptr:x}")
    if len(src) != length:
        raise OutOfBounds(f"source holds {len(src)} bytes for a write of {length}")
    if desc.size:
        if dst_off < 0 or dst_off + length > desc.size:
            _check_dst(desc, dst_off, length)
    else:
        check_space(desc, dst_off + length)
    if length < split_min and max_parts is None:
        # The small write: whole, on one rail.
        rail = op % rails
        addr, rkey = rkeys[rail]
        return [WritePart(rail, addr, rkey, [desc.ptr + dst_off], [length], [src], imm, None,
                          0, op, 1, alts=rkeys)]
    n = rails if length >= split_min else 1
    if max_parts is not None:
        n = max(n, min(max_parts, max(1, length // SPLIT_ALIGN)))
    sizes = split_sizes(length, n)
    parts: list[WritePart] = []
    pos = 0
    span = [desc.ptr + dst_off, length] if len(sizes) > 1 else None
    for i, size in enumerate(sizes):
        rail = (op + i) % rails
        addr, rkey = desc.rkeys[rail]
        parts.append(WritePart(
            rail, addr, rkey, [desc.ptr + dst_off + pos], [size], [src[pos : pos + size]],
            imm, span, i, op, len(sizes), alts=desc.rkeys,
        ))
        pos += size
    return parts


def plan_paged(
    op: int, page_len: int, imm: int | None, src_views: Sequence[memoryview], desc: MrDesc,
    dst: Pages, rails: int, *, pages_per_frame: int = PAGES_PER_FRAME,
) -> list[WritePart]:
    check_rails(len(desc.rkeys), rails, f"region at 0x{desc.ptr:x}")
    if len(src_views) != len(dst.indices):
        raise BadRequest(f"{len(src_views)} source pages for {len(dst.indices)} destination pages")
    if dst.stride < page_len and len(dst.indices) > 1:
        raise BadRequest(f"destination stride {dst.stride} is smaller than the page ({page_len})")
    # The pages' addresses at the destination in one pass; their bounds on the lowest
    # and the highest (the receiver checks every page again, authoritatively).
    base, stride = desc.ptr + dst.offset, dst.stride
    addrs = [base + i * stride for i in dst.indices]
    if desc.size and addrs and (min(addrs) < desc.ptr
                                or max(addrs) - desc.ptr + page_len > desc.size):
        for a in addrs:  # name the first page that is out
            _check_dst(desc, a - desc.ptr, page_len)
    elif addrs and not desc.size:
        check_space(desc, max(addrs) - desc.ptr + page_len)
    total = len(src_views)
    parts: list[WritePart] = []
    if total <= pages_per_frame and rails == 1:
        # One frame (a KV layer's 64 pages): the lists as they are, no slicing.
        if total:
            addr, rkey = desc.rkeys[0]
            parts.append(WritePart(0, addr, rkey, addrs, [page_len] * total,
                                   list(src_views), imm, None, 0, op, 1, alts=desc.rkeys))
        return parts
    for rail, f, end in paged_frames(total, rails, op, pages_per_frame):
        addr, rkey = desc.rkeys[rail]
        parts.append(WritePart(
            rail, addr, rkey, addrs[f:end], [page_len] * (end - f), list(src_views[f:end]),
            imm, None, len(parts), op, 1, alts=desc.rkeys,
        ))
    if not parts:  # zero pages: nothing moves, nothing is counted
        return []
    return parts


def paged_frames(total: int, rails: int, op: int,
                 per_frame: int) -> Iterator[tuple[int, int, int]]:
    """``(rail, first, end)`` of every frame of ``total`` pages: a contiguous block of
    pages per rail (the rails in turn from ``op``'s), each block cut into frames of at
    most ``per_frame`` pages (paged writes and paged reads alike)."""
    per_rail = split_sizes(total, rails, align=1) if total >= rails else [total]
    start = 0
    for r, count in enumerate(per_rail):
        rail = (op + r) % rails
        for f in range(start, start + count, per_frame):
            yield rail, f, min(f + per_frame, start + count)
        start += count


def plan_barrier(op: int, imm: int, dsts: Sequence[MrDesc], rails: int) -> list[WritePart]:
    parts = []
    for i, desc in enumerate(dsts):
        check_rails(len(desc.rkeys), rails, f"region at 0x{desc.ptr:x}")
        rail = (op + i) % rails
        addr, rkey = desc.rkeys[rail]
        # Zero bytes, yet a valid descriptor (the region's address and rkey): EFA
        # requires one even for zero-length writes, so every Domain gets one.
        parts.append(WritePart(rail, addr, rkey, [desc.ptr], [0], [], imm, None, i, op, 1,
                               alts=desc.rkeys))
    return parts


__all__ = [
    "PAGES_PER_FRAME", "SPLIT_ALIGN", "SPLIT_MIN", "Plan", "SendPart", "WritePart",
    "check_rails", "check_space", "plan_barrier", "plan_paged", "plan_single", "split_sizes",
]
