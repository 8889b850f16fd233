"""The peer plane: daemon-to-daemon frames, one connection per rail per peer.

Same 24-byte header and msgpack bodies as the client protocol; the command
ids (0x40-0x4F) never appear on a client connection.  A link starts with the
handshake of :mod:`transferd.protocol.peer_handshake` (HELLO, AUTH, PROBE);
only then are WRITE and SEND taken.

WRITE   body {op, part, rkey, addrs: [addr, ...], lens: [len, ...], imm (absent = none),
              span: [addr, len] (a split single write only), wid (absent = none)}
        payload: the bytes, concatenated.  The receiver counts what landed, never a
        number the sender wrote: a frame without ``span`` adds one per page it
        placed (one for a frame of no pages: a barrier); the parts of a single
        write split over rails each name the whole write in ``span`` and their
        own range in ``addrs``/``lens``, and the receiver adds one when its
        parts have covered the span, each byte once.  ``wid`` (u64) is the
        client's write id: the receiver applies each (initiator, wid, part) at
        most once (transferd/domains/writeids.py).
ACK     body {op, part, ok: true} or {op, part, code, message}
SEND    body {op, part}  payload: the message (two-sided); its sender is the link's
        authenticated peer, not anything in the frame.

This module parses those bodies: every field is checked for type and range,
and a malformed one is a :class:`BadRequest`, never a KeyError or a
TypeError out of a socket callback.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .errors import BadRequest

U64 = (1 << 64) - 1
U32 = (1 << 32) - 1
# A WRITE frame carries at most this many pages (plan.PAGES_PER_FRAME is 256).
MAX_PAGES_PER_FRAME = 4096


class PeerCommand(enum.IntEnum):
    HELLO = 0x40
    WRITE = 0x41
    ACK = 0x42
    SEND = 0x43
    AUTH = 0x44
    # Sent on a connection of its own to the initiator's rail listener by a
    # responder without a cluster secret: only a daemon listening at the
    # address it claims can answer it (see peer_handshake).
    PROBE = 0x45


def _uint(body: dict[str, Any], name: str, limit: int = U64) -> int:
    v = body.get(name)
    if type(v) is not int or not 0 <= v <= limit:
        raise BadRequest(f"peer frame field {name!r} must be an unsigned integer "
                         f"of at most {limit}, got {type(v).__name__}")
    return v


def _uints(v: Any, name: str) -> list[int]:
    if type(v) is not list or len(v) > MAX_PAGES_PER_FRAME:
        raise BadRequest(f"peer frame field {name!r} must be a list of at most "
                         f"{MAX_PAGES_PER_FRAME} unsigned integers")
    if not set(map(type, v)) <= {int} or (v and (min(v) < 0 or max(v) > U64)):
        raise BadRequest(f"peer frame field {name!r} must hold unsigned 64-bit integers")
    return v


@dataclass(slots=True)
class WriteHeader:
    """A checked WRITE body."""

    op: int
    part: int
    rkey: int
    addrs: list[int]
    lens: list[int]
    imm: int | None
    span: tuple[int, int] | None
    # The receiver's reservation of this part's range in its span (a split write).
    partial: Any = None
    # The client's write id (a retry carries the same): applied at most once.
    wid: int | None = None
    # Re-sent on another rail after its own failed (rail failover): if the same
    # part landed already, it is acknowledged and neither placed nor counted again.
    again: bool = False

    @property
    def nbytes(self) -> int:
        return sum(self.lens)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> WriteHeader:
        op = _uint(body, "op")
        part = _uint(body, "part", U32)
        rkey = _uint(body, "rkey")
        addrs = _uints(body.get("addrs"), "addrs")
        lens = _uints(body.get("lens"), "lens")
        if len(addrs) != len(lens):
            raise BadRequest("peer WRITE: addrs and lens must be lists of equal length")
        imm = None if body.get("imm") is None else _uint(body, "imm", U32)
        raw = body.get("span")
        span: tuple[int, int] | None = None
        if raw is not None:
            s = _uints(raw, "span")
            if len(s) != 2 or len(addrs) != 1:
                raise BadRequest("peer WRITE: span is [addr, len] and goes with one range")
            span = (s[0], s[1])
            a, n = addrs[0], lens[0]
            if a < span[0] or a + n > span[0] + span[1]:
                raise BadRequest(f"peer WRITE: range [0x{a:x}, +{n}) is outside its span "
                                 f"[0x{span[0]:x}, +{span[1]})")
        wid = None if body.get("wid") is None else _uint(body, "wid")
        return cls(op, part, rkey, addrs, lens, imm, span, wid=wid,
                   again=body.get("again") is True)

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"op": self.op, "part": self.part, "rkey": self.rkey,
                                "addrs": self.addrs, "lens": self.lens}
        if self.imm is not None:
            body["imm"] = self.imm
        if self.span is not None:
            body["span"] = list(self.span)
        if self.wid is not None:
            body["wid"] = self.wid
        if self.again:
            body["again"] = True
        return body


def parse_ref(body: dict[str, Any]) -> tuple[int, int]:
    """The (op, part) a SEND or an ACK names."""
    return _uint(body, "op"), _uint(body, "part", U32)
