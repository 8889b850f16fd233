"""One-sided READs: a peer region's bytes pulled into a region of ours.

The local side is the destination and must be registered here (its bytes are
received straight into it); the remote side is a region a peer registered with
``access="r"`` or ``"rw"`` and described by its MrDesc.  A read is planned like a
write (:mod:`.plan`): a single read of 1 MiB or more is split in 4 KiB-aligned
parts, one per rail; a paged read's pages in contiguous blocks, one per rail, each
cut into frames of at most 256 pages.  Each part carries the remote region's rkey on
every rail (``alts``) so that a rail that fails is re-read on another
(:mod:`transferd.domains.failover`): a READ changes nothing at the peer, so a re-read
is always safe.

A read into device memory (``cuda:N``) goes through its group's pinned staging as a
write from it does: the bytes are received into staging chunks (waited for: back-
pressure), copied host to device, and the read completes once that copy's event did.
A read completes when every byte of every part is in the local region; nothing is
counted anywhere (a READ carries no immediate).  Its deadline and CANCEL are a
write's; a read that ended early (timed out, cancelled) writes nothing more into the
local region: what of it still arrives is dropped by the link (peer_outbound).
A read may be verified (``verify``: the responder's CRC32C of the bytes it sent, ours of
the bytes placed, a mismatch re-read once) and traced (``traceparent``: on its inflight
entry, in its READ frames, in its span ``transferd.read``), as a write: docs/integrity.md.
Pure planning here, and the engine's submit (no I/O).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from transferd.memory.staging import Claim
from transferd.parts import SPLIT_ALIGN, ReadPart, split_sizes
from transferd.protocol.errors import BadRequest, OutOfBounds
from transferd.protocol.peer_coverage import MAX_PIECES
from transferd.protocol.values import MrDesc, Pages

from .device_source import plan_staging
from .inflight import Stage
from .plan import (
    PAGES_PER_FRAME,
    SPLIT_MIN,
    VERIFY_PART,
    check_rails,
    check_space,
    paged_frames,
)

# A verified read's parts (verify_parts) are at most as many as a verified write's.
MAX_VERIFY_PARTS = MAX_PIECES

if TYPE_CHECKING:
    from .engine import Tag, TransferEngine
    from .regions import Region


def verify_parts(length: int, tag: Tag) -> int | None:
    """How many parts a verified single read of ``length`` goes in (None: as planned):
    of VERIFY_PART bytes, as a verified write's, so that the responder takes each
    part's checksum just before it sends it and the reader each as it lands, while the
    parts before and after are on the wire (one checksum of a whole gigabyte before its
    first byte went would be a pause of its own: docs/integrity.md)."""
    if not tag[0] or length <= VERIFY_PART:
        return None
    return min(-(-length // VERIFY_PART), MAX_VERIFY_PARTS)


def tagged(parts: list[ReadPart], tag: Tag) -> list[ReadPart]:
    """The planned parts, each carrying the submit's verify and trace id (a chaos
    Domain's pieces, a re-read on another rail, carry them on)."""
    verify, trace_id = tag
    if verify or trace_id is not None:
        for p in parts:
            p.verify, p.trace = verify, trace_id
    return parts


def _check_src(desc: MrDesc, off: int, length: int) -> None:
    # The responder checks authoritatively; failing early here saves a round trip.
    if desc.size:
        if off < 0 or off + length > desc.size:
            raise OutOfBounds(f"[{off}, {off + length}) is outside the remote region of "
                              f"{desc.size}")
    else:
        check_space(desc, off + length)


def _cut(views: Sequence[memoryview], start: int, size: int) -> list[memoryview]:
    """Bytes ``[start, start + size)`` of ``views`` (concatenated), as views."""
    out: list[memoryview] = []
    pos = 0
    for v in views:
        end = pos + len(v)
        if end > start and pos < start + size:
            lo, hi = max(start, pos) - pos, min(start + size, end) - pos
            out.append(v[lo:hi])
        pos = end
    return out


def page_views(region: Region, pages: Pages, page_len: int) -> list[memoryview]:
    """``pages`` of a host region (offsets from its start), ``page_len`` bytes each, as
    views: checked from the lowest and highest page (the extreme indices: an offset is
    linear in its index), then sliced in one pass; a page out of bounds is named by
    :meth:`Region.views`, as before (OutOfBounds)."""
    idx, stride, first = pages.indices, pages.stride, pages.offset
    if not idx:
        return []
    lo, hi = sorted((first + min(idx) * stride, first + max(idx) * stride))
    if lo < 0 or page_len < 0 or hi + page_len > region.size:
        base = region.ptr + first
        return region.views([base + i * stride for i in idx], page_len)  # raises
    whole = region.view(region.ptr, region.size)
    return [whole[(o := first + i * stride):o + page_len] for i in idx]


def plan_single_read(op: int, length: int, into: memoryview | Sequence[memoryview],
                     desc: MrDesc, src_off: int, rails: int, *,
                     split_min: int = SPLIT_MIN, max_parts: int | None = None
                     ) -> list[ReadPart]:
    """``length`` bytes at ``src_off`` of the peer's region into ``into`` (one view of
    the local region, or the pieces of staging they go through); ``max_parts``: in that
    many parts (a verified read's, :func:`verify_parts`) rather than one per rail."""
    check_rails(len(desc.rkeys), rails, f"region at 0x{desc.ptr:x}")
    views = [into] if isinstance(into, memoryview) else list(into)
    have = sum(len(v) for v in views)
    if have != length:
        raise OutOfBounds(f"destination holds {have} bytes for a read of {length}")
    _check_src(desc, src_off, length)
    rkeys = desc.rkeys
    n = rails if length >= split_min else 1
    if max_parts is not None:
        n = max(n, min(max_parts, max(1, length // SPLIT_ALIGN)))
    sizes = split_sizes(length, n) if n > 1 else [length]
    parts: list[ReadPart] = []
    pos = 0
    for i, size in enumerate(sizes):
        rail = (op + i) % rails
        addr, rkey = rkeys[rail]
        part_into = [views[0][pos:pos + size]] if len(views) == 1 else _cut(views, pos, size)
        parts.append(ReadPart(rail, addr, rkey, [desc.ptr + src_off + pos], [size],
                              part_into, i, op, len(sizes), alts=rkeys))
        pos += size
    return parts


def plan_paged_reads(op: int, page_len: int, into: Sequence[memoryview], desc: MrDesc,
                     src: Pages, rails: int, *, pages_per_frame: int = PAGES_PER_FRAME
                     ) -> list[ReadPart]:
    """The peer's pages ``src`` (``page_len`` each) into the local views ``into``."""
    check_rails(len(desc.rkeys), rails, f"region at 0x{desc.ptr:x}")
    if len(into) != len(src.indices):
        raise BadRequest(f"{len(into)} destination pages for {len(src.indices)} source "
                         "pages")
    if src.stride < page_len and len(src.indices) > 1:
        raise BadRequest(f"source stride {src.stride} is smaller than the page ({page_len})")
    idx, stride, first = src.indices, src.stride, src.offset
    if desc.size and idx:
        # The lowest and highest page from the extreme indices (an offset is linear in
        # its index): one pass over thousands of pages, not three.
        lo, hi = sorted((first + min(idx) * stride, first + max(idx) * stride))
        if lo < 0 or hi + page_len > desc.size:
            for i in idx:  # name the first page that is out
                _check_src(desc, first + i * stride, page_len)
    elif idx:
        check_space(desc, first + max(idx) * stride + page_len)
    base = desc.ptr + first
    addrs = [base + i * stride for i in idx]
    total = len(into)
    parts: list[ReadPart] = []
    for rail, f, end in paged_frames(total, rails, op, pages_per_frame):
        addr, rkey = desc.rkeys[rail]
        parts.append(ReadPart(rail, addr, rkey, addrs[f:end], [page_len] * (end - f),
                              list(into[f:end]), len(parts), op, 1, alts=desc.rkeys))
    return parts


class Reads:
    """The engine's READ submits (see the module doc); the engine delegates here."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine

    def _local(self, region_id: int) -> Region:
        if not self.engine.capabilities.reads:
            raise BadRequest("one-sided READ needs a Domain that serves it (tcp, chaos, "
                             f"verbs), not {self.engine.config.domain}")
        return self.engine.regions.get(region_id)

    def _into_device(self, op: int, region: Region, pages: list[tuple[int, int]],
                     plan: Callable[[list[memoryview]], list[ReadPart]],
                     owner: Hashable = None, trace: bytes | None = None
                     ) -> asyncio.Future[None]:
        """A read into device memory: received into pinned staging of the region's group
        (waiting for chunks: back-pressure), then copied host to device; it completes
        only once those copies' event completed.  ``pages``: (absolute address, length)
        in the region, each at most a chunk; the chunks go back once the copies ended.
        In flight from the submit to the end: QUEUED while it waits for staging, the
        transfer's stages while it reads, LANDING while the copies run."""
        e = self.engine
        assert e.loop is not None
        io, devs, places, need = plan_staging(region, pages, "a read into")
        held = region.buffer.ref()
        lock = e.staging_lock(io)
        inflight = e.inflight
        nbytes = sum(n for _, n in pages)

        def listed(stage: Stage, what: str) -> None:
            inflight.add(op, "read", op=op, owner=owner, trace=trace, stage=stage,
                         progress=lambda: (0, nbytes) if stage is Stage.QUEUED else (
                             nbytes, nbytes), what=what)

        async def run() -> None:
            claim = Claim(io)
            try:
                async with lock:  # one operation takes its chunks at a time
                    chunks = await claim.take(need)
                inflight.remove(op)  # (the transfer's own entry from here)
                views = [chunks[c].view[off:off + n]
                         for (c, off), (_, n) in zip(places, pages, strict=True)]
                reading = e._submit(op, plan(views), None, e.group_of(region), owner,
                                    kind="read")
                me = asyncio.current_task()
                entry = e._transfers.get(reading)
                if me is not None and entry is not None:
                    e._transfers[me] = entry  # CANCEL of this task ends the transfer
                try:
                    await reading
                finally:
                    if me is not None:
                        e._transfers.pop(me, None)
                # Every byte is in staging (a read that ended early wrote none after):
                # now onto the device, and done only once it is there.
                listed(Stage.LANDING, "copying into device memory")
                for dev, (c, off), (_, n) in zip(devs, places, pages, strict=True):
                    io.stream.copy_h2d(dev, chunks[c].ptr + off, n)
                await io.waiter.wait(claim.fence())
            finally:
                held.release()
                claim.release()

        listed(Stage.QUEUED, "waiting for staging chunks")
        task = asyncio.ensure_future(run())
        task.add_done_callback(lambda _: inflight.remove(op))
        return task

    def single(self, length: int, dst: tuple[int, int], src: tuple[MrDesc, int],
               owner: Hashable = None, tag: Tag = (False, None)) -> asyncio.Future[None]:
        """``owner``: the submitting connection (what inflight names); ``tag``: the
        submit's (verify, trace id), TransferEngine._read_tag."""
        e = self.engine
        e._check_descs([src[0]])
        region = self._local(dst[0])
        if region.staging is not None:
            step = region.staging.pool.chunk_size
            start = region.ptr + dst[1]
            pages = [(start + k, min(step, length - k)) for k in range(0, length, step)]
            op = e.next_op()
            return self._into_device(op, region, pages or [(start, 0)], lambda v: tagged(
                plan_single_read(op, length, v, src[0], src[1], e.rails,
                                 max_parts=verify_parts(length, tag)), tag), owner, tag[1])
        into = region.view(region.ptr + dst[1], length)
        op = e.next_op()
        parts = plan_single_read(op, length, into, src[0], src[1], e.rails,
                                 max_parts=verify_parts(length, tag) if tag[0] else None)
        return e._submit(op, tagged(parts, tag), region.buffer.ref(), e.group_of(region),
                         owner, kind="read")

    def paged(self, page_len: int, dst: tuple[int, Pages], src: tuple[MrDesc, Pages],
              owner: Hashable = None, tag: Tag = (False, None)) -> asyncio.Future[None]:
        e = self.engine
        e._check_descs([src[0]])
        region = self._local(dst[0])
        dp, sp = dst[1], src[1]
        if len(dp.indices) != len(sp.indices):
            raise BadRequest(f"{len(dp.indices)} destination pages for {len(sp.indices)} "
                             "source pages")
        if dp.stride < page_len and len(dp.indices) > 1:
            raise BadRequest(f"destination stride {dp.stride} is smaller than the page "
                             f"({page_len})")
        base = region.ptr + dp.offset
        op = e.next_op()
        if region.staging is not None:
            pages = [(base + i * dp.stride, page_len) for i in dp.indices]
            return self._into_device(op, region, pages, lambda v: tagged(
                plan_paged_reads(op, page_len, v, src[0], sp, e.rails), tag), owner, tag[1])
        into = page_views(region, dp, page_len)
        parts = plan_paged_reads(op, page_len, into, src[0], sp, e.rails)
        if not parts:  # zero pages: nothing moves
            return e._submit(op, [], None, e.group_of(region))
        return e._submit(op, tagged(parts, tag), region.buffer.ref(), e.group_of(region),
                         owner, kind="read")

    def gather(self, region_id: int, srcs: Sequence[tuple[int, int, MrDesc, int]],
               owner: Hashable = None, tag: Tag = (False, None)) -> asyncio.Future[None]:
        """Each ``(len, dst_off, desc, src_off)`` into our region: one transfer (one
        completion), each range a single read of its own (an op each, as a scatter)."""
        e = self.engine
        e._check_descs([s[2] for s in srcs])
        region = self._local(region_id)
        if region.staging is not None:
            raise BadRequest(f"a GATHER into {region.buffer.device} memory is not supported "
                             "(single and paged reads are)")
        parts: list[ReadPart] = []
        first = 0
        for length, dst_off, desc, src_off in srcs:
            op = e.next_op()
            first = first or op
            into = region.view(region.ptr + dst_off, length)
            parts += plan_single_read(op, length, into, desc, src_off, e.rails,
                                      max_parts=verify_parts(length, tag))
        return e._submit(first or e.next_op(), tagged(parts, tag), region.buffer.ref(),
                         e.group_of(region), owner, kind="read")


__all__ = ["Reads", "plan_paged_reads", "plan_single_read"]
