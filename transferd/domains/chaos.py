"""The chaos Domain: a wrapper around any other that delivers out of order on purpose.

``engine.domain = "chaos"`` (around tcp) or ``"chaos:NAME"``.  Every part it is
given is cut in pieces (a frame of pages into one frame per page, a range of
a single write into up to ``max_parts`` aligned pieces that each name the
write's span, so the receiver still counts it once) and every piece is handed
to the wrapped Domain after its own random delay (seeded: the same seed, the
same schedule).  The part completes when all its pieces did.  Nothing above
the Domain knows: the engine plans as for any Domain, and the receiver's
counting rules (pages placed, spans covered) make the order irrelevant.

``engine.chaos_corrupt`` (a probability) proves the checksums (docs/integrity.md):
a piece drawn for it is sent from a copy of its bytes with one byte flipped, never
the source; a verified piece's checksum is taken from the source first, so the
receiver sees the mismatch (and the initiator re-sends), while an unverified one
lands corrupted.

The answers a chaos daemon sends to its peers' READs are corrupted the same way (a
copy with one byte flipped, the checksum a verified read asked for taken from the
region first: the reader sees the mismatch and re-reads).

A READ is cut the same way (a frame of pages into one READ per page, a range into
aligned pieces), each piece after its own delay, its answer landing straight in its
own slice of the reader's region: the read completes when every piece's bytes did,
in whatever order they came.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

from transferd.parts import (
    SPLIT_ALIGN,
    ReadPart,
    RegionInfo,
    SendPart,
    Transfer,
    WritePart,
    split_sizes,
)
from transferd.protocol.errors import TransferdError
from transferd.protocol.peer_coverage import MAX_PIECES as SPAN_PIECES
from transferd.protocol.values import NetAddr

from .base import Domain, DomainOptions, LinkStats, Port

# Pieces of one part are numbered (part index << 8) | k: at most this many.
MAX_PIECES = 256


def _cut(views: list[memoryview], sizes: list[int]) -> list[list[memoryview]]:
    """``views`` (concatenated) cut into consecutive runs of ``sizes`` bytes, as views."""
    out: list[list[memoryview]] = []
    vi, off = 0, 0
    for size in sizes:
        run: list[memoryview] = []
        left = size
        while left:
            v = views[vi]
            take = min(left, len(v) - off)
            run.append(v[off:off + take])
            off += take
            left -= take
            if off == len(v):
                vi, off = vi + 1, 0
        out.append(run)
    return out


def pieces(part: WritePart, max_parts: int) -> list[WritePart]:
    """``part`` in pieces the receiver counts exactly as the whole part (each verified
    and traced as it is)."""
    out = _pieces(part, max_parts)
    if len(out) > 1 and (part.verify or part.trace is not None):
        for p in out:
            p.verify, p.trace = part.verify, part.trace
    return out


def corrupted(piece: WritePart, rng: random.Random) -> WritePart:
    """``piece`` sent from a copy of its bytes with one of them flipped (its checksum,
    if verified, taken from the source first: the receiver must see the difference)."""
    if piece.verify and piece.crc is None:
        piece.ext()
    copy = bytearray(piece.nbytes)
    pos = 0
    for v in piece.src:
        copy[pos:pos + len(v)] = v
        pos += len(v)
    copy[rng.randrange(len(copy))] ^= 0xFF
    view = memoryview(copy)
    srcs = _cut([view], piece.lens)
    return WritePart(piece.rail, piece.dst, piece.rkey, piece.addrs, piece.lens,
                     [v for run in srcs for v in run], piece.imm, piece.span, piece.index,
                     piece.op, piece.parts, piece.wid, piece.alts, piece.again, piece.verify,
                     piece.crc, piece.trace)


class _Joined:
    """The Transfer the pieces of one part share: the part answers once every piece
    did (the first error, if any), so that a re-send of the part never races a piece
    of its first attempt still on its way."""

    __slots__ = ("error", "left", "target")

    def __init__(self, target: Transfer, n: int) -> None:
        self.target, self.left = target, n
        self.error: TransferdError | None = None

    @property
    def finished(self) -> bool:
        return self.target.finished

    @property
    def op(self) -> int:
        return self.target.op

    def part_done(self, error: TransferdError | None = None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.left -= 1
        if self.left == 0:
            self.target.part_done(self.error)

    def fail(self, error: TransferdError) -> None:
        self.part_done(error)


def _pieces(part: WritePart, max_parts: int) -> list[WritePart]:
    n = len(part.addrs)
    if n > 1 and n <= MAX_PIECES:
        srcs = _cut(part.src, part.lens)
        return [WritePart(part.rail, part.dst, part.rkey, [a], [ln], src, part.imm, None,
                          (part.index << 8) | k, part.op, part.parts, part.wid,
                          again=part.again)
                for k, (a, ln, src) in enumerate(zip(part.addrs, part.lens, srcs, strict=True))]
    if n == 1 and part.lens[0] >= 2 * SPLIT_ALIGN:
        length = part.lens[0]
        # The write's pieces, all its parts' together, stay within what a receiver
        # takes for one write (peer_coverage.MAX_PIECES).
        most = max(1, SPAN_PIECES // max(1, part.parts))
        sizes = split_sizes(length, min(max_parts, most, length // SPLIT_ALIGN))
        if len(sizes) > 1:
            # A piece names the whole write's span (its own range if the part was whole).
            span = part.span or [part.addrs[0], length]
            starts = [0, *accumulate(sizes)][:-1]
            return [WritePart(part.rail, part.dst, part.rkey, [part.addrs[0] + s], [size],
                              src, part.imm, span, (part.index << 8) | k, part.op, part.parts,
                              part.wid, again=part.again)
                    for k, (s, size, src) in enumerate(
                        zip(starts, sizes, _cut(part.src, sizes), strict=True))]
    return [part]


def read_pieces(part: ReadPart, max_parts: int) -> list[ReadPart]:
    """A READ in pieces, each into its own slice of the reader's views."""
    n = len(part.addrs)
    if 1 < n <= MAX_PIECES:
        intos = _cut(part.into, part.lens)
        return [ReadPart(part.rail, part.dst, part.rkey, [a], [ln], into,
                         (part.index << 8) | k, part.op, part.parts, part.alts, part.again,
                         part.verify, part.trace)
                for k, (a, ln, into) in enumerate(zip(part.addrs, part.lens, intos,
                                                      strict=True))]
    if n == 1 and part.lens[0] >= 2 * SPLIT_ALIGN:
        length = part.lens[0]
        sizes = split_sizes(length, min(max_parts, MAX_PIECES, length // SPLIT_ALIGN))
        if len(sizes) > 1:
            starts = [0, *accumulate(sizes)][:-1]
            return [ReadPart(part.rail, part.dst, part.rkey, [part.addrs[0] + s], [size],
                             into, (part.index << 8) | k, part.op, part.parts, part.alts,
                             part.again, part.verify, part.trace)
                    for k, (s, size, into) in enumerate(
                        zip(starts, sizes, _cut(part.into, sizes), strict=True))]
    return [part]


class _Pieces:
    """The transfer a read's pieces complete: done when all are, failed by the first
    failure; finished as soon as the part's own transfer is (a link then drops what
    still arrives instead of writing it into memory that may be its owner's again)."""

    __slots__ = ("_ended", "left", "outer")

    def __init__(self, outer: Any, n: int) -> None:
        self.outer = outer
        self.left = n
        self._ended = False

    @property
    def op(self) -> int:
        return int(self.outer.op)

    @property
    def finished(self) -> bool:
        return self._ended or bool(self.outer.finished)

    def part_done(self, error: TransferdError | None = None) -> None:
        if self._ended:
            return
        if error is not None:
            self._ended = True
            self.outer.part_done(error)
            return
        self.left -= 1
        if not self.left:
            self._ended = True
            self.outer.part_done()

    def fail(self, error: TransferdError) -> None:
        self.part_done(error)


class ChaosDomain(Domain):
    name = "chaos"

    def __init__(self, port: Port, rail: int, host: str, port_number: int,
                 options: DomainOptions, *, inner: Domain) -> None:
        self.port = port
        self.rail = rail
        self.inner = inner
        # It carries what the wrapped Domain carries, and can do what it can.
        self.capabilities = inner.capabilities
        self.options = options
        self._rng = random.Random(options.seed * 1009 + rail)
        # engine.chaos_corrupt: the probability that a piece with bytes goes corrupted.
        self.corrupt = float(options.of("chaos").get("corrupt", 0.0))
        self.corrupted = 0
        if self.corrupt:
            # The answers this daemon sends to peers' READs go the same corrupting way
            # (their checksum, if asked, taken from the region first: peer_inbound).
            port.landing.corrupt_read = self._corrupt_read

    def _corrupt_read(self, views: Sequence[memoryview]) -> list[memoryview] | None:
        """A READ's answer: drawn for it, a copy of its bytes with one flipped (never the
        region's own), else None (sent from the region)."""
        rng = self._rng
        if rng.random() >= self.corrupt:
            return None
        copy = bytearray(b"".join(views))
        copy[rng.randrange(len(copy))] ^= 0xFF
        self.corrupted += 1
        return [memoryview(copy)]

    @property
    def address(self) -> bytes:
        return self.inner.address

    def check_address(self, raw: bytes) -> None:
        self.inner.check_address(raw)

    def register(self, region: RegionInfo) -> int:
        return self.inner.register(region)

    def deregister(self, region: RegionInfo) -> None:
        self.inner.deregister(region)

    def post(self, part: WritePart | SendPart | ReadPart, transfer: Transfer) -> None:
        loop = self.port.loop
        if isinstance(part, ReadPart):
            reads = read_pieces(part, self.options.max_parts)
            self._rng.shuffle(reads)
            pieces_of: Any = transfer if len(reads) == 1 else _Pieces(transfer, len(reads))
            for read in reads:
                delay = self._rng.uniform(0, self.options.max_delay_s)
                loop.call_later(delay, self.inner.post, read, pieces_of)
            return
        todo: list[WritePart | SendPart] = []
        if isinstance(part, WritePart):
            todo.extend(pieces(part, self.options.max_parts))
        else:
            todo.append(part)
        target = transfer if len(todo) == 1 else _Joined(transfer, len(todo))
        rng = self._rng
        for piece in todo:
            if self.corrupt and isinstance(piece, WritePart) and piece.nbytes \
                    and rng.random() < self.corrupt:
                piece = corrupted(piece, rng)
                self.corrupted += 1
            delay = rng.uniform(0, self.options.max_delay_s)
            loop.call_later(delay, self.inner.post, piece, target)  # type: ignore[arg-type]

    def connect(self, dst: NetAddr) -> None:
        self.inner.connect(dst)

    def drop_stalled(self, dst: NetAddr, error: TransferdError) -> None:
        self.inner.drop_stalled(dst, error)

    def link_stats(self) -> LinkStats:
        return self.inner.link_stats()

    def incoming(self) -> list[Any]:
        return self.inner.incoming()

    def close(self) -> None:
        self.inner.close()


def factory(port: Port, rail: int, host: str, port_number: int, options: DomainOptions,
            *, inner: Domain) -> ChaosDomain:
    return ChaosDomain(port, rail, host, port_number, options, inner=inner)
