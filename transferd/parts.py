"""What the engine and the Domains share: a leaf module, so neither imports the other.

The engine plans WriteParts and SendParts and tracks a Transfer per submit; every
Domain takes them (:mod:`transferd.domains.base`).  What a Domain may know of a
registered region is :class:`RegionInfo`; what a domain group asks of the engine
is :class:`EnginePort` (the memory side of landing, and where messages go).  No
I/O here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from transferd.protocol.crc import crc_of
from transferd.protocol.errors import TransferdError
from transferd.protocol.peer_ext import encode_ext
from transferd.protocol.peer_landing import Placement, Source
from transferd.protocol.values import NetAddr

Peer = tuple[int, int]
# ack(None) once a client has the message, ack(error) if it cannot; from any thread.
Ack = Callable[[TransferdError | None], None]


class RegionInfo(Protocol):
    """What a Domain may read of a region it registers (the engine's Region)."""

    @property
    def id(self) -> int: ...

    @property
    def ptr(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def staging(self) -> Any:
        """Its staging path (a ``transferd.memory.staging.DeviceIO``) when the memory has
        no host view (device memory), else None."""
        ...

    @property
    def rkeys(self) -> tuple[int, ...]:
        """The region table's own secret per rail (a Domain may use it as its rkey)."""
        ...

    @property
    def device(self) -> str:
        """The memory's device kind: ``cpu``, ``shm``, ``cuda:0``..."""
        ...

    @property
    def access(self) -> str:
        """What peers may do: ``"w"`` (write), ``"r"`` (read) or ``"rw"``; a NIC grants
        its remote rights from it (verbs: IBV_ACCESS_REMOTE_READ only with "r")."""
        ...


class EnginePort(Protocol):
    """What a domain group asks of the engine: a :class:`~transferd.protocol.peer_landing.
    Memory` (regions by rkey, and the immediate counter) and where messages go."""

    def place(self, rkey: int, rail: int, addrs: list[int], lens: list[int],
              payload_len: int, abort: Callable[[], None] | None) -> Placement: ...

    def count(self, imm: int, n: int) -> int | None: ...

    def room(self, imm: int) -> None: ...

    def source(self, rkey: int, rail: int, addrs: list[int], lens: list[int],
               abort: Callable[[], None] | None, checksum: bool = False,
               peer: Peer | None = None) -> Source: ...

    def deliver(self, peer: Peer, msg: bytes, ack: Ack, source: Hashable, *,
                trace: bytes | None = None, op: int = 0) -> None:
        """A message from ``peer`` for a posted receive (any thread may ack); ``trace``
        its sender's trace id (when its SEND carried one), ``op`` the sender's transfer."""

    def sender_gone(self, source: Hashable) -> None:
        """Inbound link ``source`` closed: its messages waiting for a receive go."""

# Two-sided messages are for small control messages (RPC-style); bulk data
# goes by one-sided writes.
MAX_MESSAGE = 1 << 20
# Pieces of a split write are multiples of this.
SPLIT_ALIGN = 4096


@dataclass(slots=True)
class WritePart:
    rail: int
    dst: NetAddr  # the destination rail's address
    rkey: int
    addrs: list[int]
    lens: list[int]
    src: list[memoryview]
    imm: int | None
    # A part of a single write split in several: [addr, len] of the whole write.
    span: list[int] | None = None
    index: int = 0
    op: int = 0
    # How many parts carry this op (a split single write's; 1 otherwise).  The
    # initiator's own bookkeeping, for a Domain whose receiver cannot see offsets
    # (verbs counts a split write by its last part's carrier); tcp never sends it.
    parts: int = 1
    # The client's write id (SINGLE_WRITE / PAGED_WRITES ``wid``): a retry carries the
    # same, and the receiver applies each of its frames at most once.
    wid: int | None = None
    # The destination region's (rail address, rkey) on every rail (its MrDesc's
    # rkeys): where the part may be re-sent if its rail fails (rail failover).
    alts: Sequence[tuple[NetAddr, int]] | None = None
    # Re-sent on another rail: the receiver drops it if its first copy landed.
    again: bool = False
    # verify: the part carries the CRC32C of its source bytes (``crc``, computed from
    # ``src`` when first sent: see :meth:`ext`); ``trace`` the W3C trace id (26 bytes).
    verify: bool = False
    crc: int | None = None
    trace: bytes | None = None

    @property
    def nbytes(self) -> int:
        return sum(self.lens)

    def ext(self) -> bytes:
        """The WRITE's extension block (b"" for a part neither verified nor traced); a
        verified part's checksum is taken from its source memory the first time."""
        if self.verify:
            if self.crc is None:
                self.crc = crc_of(self.src)
            return encode_ext(self.crc, self.trace)
        return encode_ext(None, self.trace) if self.trace is not None else b""


@dataclass(slots=True)
class ReadPart:
    """One READ: ``lens`` bytes at the peer's ``addrs`` (its region ``rkey``) into
    ``dst`` (views of our own region, in order; received straight into them)."""

    rail: int
    dst: NetAddr  # the peer rail's address (where the bytes come from)
    rkey: int
    addrs: list[int]
    lens: list[int]
    into: list[memoryview]
    index: int = 0
    op: int = 0
    parts: int = 1
    # The peer region's (rail address, rkey) on every rail: where it may be re-read.
    alts: Sequence[tuple[NetAddr, int]] | None = None
    # Re-read on another rail (a READ has no effect at the peer: nothing to drop).
    again: bool = False
    # verify: the answer carries the responder's CRC32C of its bytes, checked against
    # ours of the bytes placed (peer_wire RX_CRC); ``trace`` the W3C trace id (26 bytes).
    verify: bool = False
    trace: bytes | None = None

    @property
    def nbytes(self) -> int:
        return sum(self.lens)


@dataclass(slots=True)
class SendPart:
    rail: int
    dst: NetAddr
    msg: bytes
    op: int = 0
    index: int = 0
    parts: int = 1
    # The submit's W3C trace id (26 bytes), for the sender's log records and span, and
    # carried in the SEND frame (TX_EXT) to a receiver that reads it (send-ext).
    trace: bytes | None = None

    @property
    def nbytes(self) -> int:
        return len(self.msg)


def split_sizes(length: int, n: int, align: int = SPLIT_ALIGN) -> list[int]:
    """``n`` near-equal, ``align``-aligned sizes adding up to ``length``."""
    if n <= 1 or length < n * align:
        return [length]
    base = (length // n) // align * align
    sizes = [base] * (n - 1)
    sizes.append(length - base * (n - 1))
    return sizes


class Transfer:
    """Completes once every part was acknowledged (applied at the destination).

    The first failure fails the transfer; later acknowledgements are ignored.
    ``done`` is called exactly once, on the worker's loop.
    """

    __slots__ = ("_done", "ended", "error", "finished", "nbytes", "op", "remaining", "span",
                 "timer", "trace")

    def __init__(self, op: int, parts: int, nbytes: int,
                 done: Callable[[TransferdError | None], None]) -> None:
        self.op = op
        self.remaining = parts
        self.nbytes = nbytes
        self._done = done
        self.error: TransferdError | None = None
        self.finished = False
        # Cancelled when the transfer ends (a peer that hangs must not hang us).
        self.timer: asyncio.TimerHandle | None = None
        # Called once if it fails (timed out, cancelled, refused): the links still
        # holding its parts let go of them (their views of its source, their bytes).
        self.ended: Callable[[TransferdError], None] | None = None
        # The submit's W3C trace id (26 bytes), for the log records about it.
        self.trace: bytes | None = None
        # Its OpenTelemetry span where spans are on (transferd.tracing): each part's
        # span goes under it.
        self.span: Any = None

    def _end(self, error: TransferdError | None) -> None:
        self.finished = True
        self.error = error
        if self.timer is not None:
            self.timer.cancel()
        self._done(error)
        ended, self.ended = self.ended, None
        if ended is not None and error is not None:
            ended(error)

    def part_done(self, error: TransferdError | None = None) -> None:
        if self.finished:
            return
        if error is not None:
            self.fail(error)
            return
        self.remaining -= 1
        if self.remaining <= 0:
            self._end(None)

    def fail(self, error: TransferdError) -> None:
        if not self.finished:
            self._end(error)
