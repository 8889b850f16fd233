"""Verified and traced READs on the wire (issue 20), sans-IO: the READ's RX_CRC and
RX_EXT, the READ_DATA's extension block, both ways over an in-memory link pair
(tests/peerlink.py): a verified read lands exactly, an answer corrupted on its way
(Landing.corrupt_read, what the chaos Domain sets) or without the checksum asked is
refused before it completes, and a read asking nothing is the frame it always was."""

from __future__ import annotations

import os
import secrets
import struct

import pytest

from tests.peerlink import HostMemory, Pair, drain, feed, identity, link_pair
from tests.unit.test_peer_reads import Token, complete, shuttle
from transferd.protocol import trace
from transferd.protocol.crc import crc_of
from transferd.protocol.errors import (
    BadFrame,
    BadRequest,
    IntegrityError,
    PeerAnswered,
    PeerUnreachable,
)
from transferd.protocol.peer_ext import CRC32C, encode_ext
from transferd.protocol.peer_landing import Landing
from transferd.protocol.peer_link import Placed, Refused
from transferd.protocol.peer_outbound import MISMATCH_CUTOFF
from transferd.protocol.peer_wire import (
    READ_DATA,
    READ_DATA_HEAD,
    READ_HEAD,
    RX_CRC,
    RX_EXT,
    encode_read,
    encode_read_data,
    frame_size,
    parse_read,
)

TRACE = trace.parse(f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01")


def pair(size: int = 1 << 20) -> tuple[Pair, Landing, bytearray]:
    mem = HostMemory(rails=1)
    region = mem.region(size, "r")
    region.data[:] = os.urandom(size)
    landing = Landing(mem, 1)
    p = link_pair(landing, identity(1), identity(1), rail=0)
    p.region = region  # type: ignore[attr-defined]
    return p, landing, region.data


def test_a_read_asking_nothing_is_the_frame_of_issue_19() -> None:
    plain = encode_read(7, 3, 0xABCDEF, [0x1000, 0x9000], [100, 4096])
    assert plain == READ_HEAD.pack(0x46, 0, 2, 3, 7, 0xABCDEF, 4196) + struct.pack(
        "<4Q", 0x1000, 100, 0x9000, 4096)
    assert encode_read(7, 3, 0xABCDEF, [0x1000], [100], False, b"") == encode_read(
        7, 3, 0xABCDEF, [0x1000], [100])
    assert encode_read_data(7, 3, 4196, None, b"") == encode_read_data(7, 3, 4196)


def test_read_flags_and_extension_round_trip() -> None:
    checked = encode_read(7, 3, 5, [0x1000, 0x9000], [100, 4096], True)
    assert checked[1] == RX_CRC and len(checked) == frame_size(checked) == 32 + 32
    r = parse_read(checked, 0, READ_HEAD.unpack_from(checked))
    assert r.crc and r.trace is None and r.lens == [100, 4096]
    ext = encode_ext(None, TRACE)
    traced = encode_read(8, 0, 5, [0x1000], [4096], True, ext)
    assert traced[1] == RX_CRC | RX_EXT
    assert len(traced) == frame_size(traced) == 40 + 16 + len(ext)
    assert frame_size(traced[:39]) is None  # its block's length is not there yet
    r = parse_read(traced, 0, READ_HEAD.unpack_from(traced))
    assert (r.op, r.addrs, r.lens, r.crc, r.trace) == (8, [0x1000], [4096], True, TRACE)
    only_trace = encode_read(9, 0, 5, [0x1000], [4096], False, ext)
    r = parse_read(only_trace, 0, READ_HEAD.unpack_from(only_trace))
    assert not r.crc and r.trace == TRACE
    # A READ_DATA with its payload's checksum: the block between header and payload.
    data = encode_read_data(8, 0, 4096, None, encode_ext(0x1234, None))
    _, status, mlen, _, _, plen = READ_DATA_HEAD.unpack_from(data)
    assert (status, mlen, plen) == (0, 6, 4096) and data[24] == CRC32C
    assert frame_size(data) == 24 + 6 + 4096


def test_a_bad_read_extension_is_refused_framed() -> None:
    # A checksum in a READ (it goes with bytes), a must-understand kind unknown here.
    for ext in (encode_ext(0x1234, None), bytes((0x33, 1, 0))):
        f = encode_read(1, 0, 5, [0x1000], [10], False, ext)
        with pytest.raises(BadRequest):
            parse_read(f, 0, READ_HEAD.unpack_from(f))
    # An unknown flag or a block longer than any: the framing is lost.
    f = bytearray(encode_read(1, 0, 5, [0x1000], [10]))
    f[1] = 0x80
    with pytest.raises(BadFrame):
        frame_size(bytes(f))
    f = bytearray(encode_read(1, 0, 5, [0x1000], [10], False, encode_ext(None, TRACE)))
    f[32:36] = (1 << 20).to_bytes(4, "little")
    with pytest.raises(BadFrame):
        frame_size(bytes(f))


@pytest.mark.parametrize("chunk", [1 << 30, 4096, 7])
def test_a_verified_traced_read_lands_exactly(chunk: int) -> None:
    p, _, src = pair()
    r = p.region  # type: ignore[attr-defined]
    dst = bytearray(1 << 20)
    dv = memoryview(dst)
    one, paged = Token(), Token()
    p.out.read(one, 1, 0, r.rkeys[0], [r.ptr + 5], [300_000], [dv[10:300_010]], True, TRACE)
    p.out.read(paged, 2, 0, r.rkeys[0], [r.ptr + i * 8192 for i in range(50)], [4096] * 50,
               [dv[400_000 + i * 4096:][:4096] for i in range(50)], True)
    shuttle(p, chunk, rounds=200_000)
    assert not p.out.closed
    assert [e for _, e in complete(p)] == [None, None]
    assert dst[10:300_010] == src[5:300_005]
    for i in range(50):
        assert dst[400_000 + i * 4096:][:4096] == src[i * 8192:][:4096]
    # The responder's record of the traced one carries its trace id.
    (placed,) = [e for e in p.inb.events if isinstance(e, Placed)]
    assert placed.what == "read" and placed.trace == TRACE and placed.ref == (1, 0)


def test_an_answer_corrupted_on_its_way_is_refused() -> None:
    """The responder's checksum is of its region; what it sends is a corrupted copy
    (the chaos Domain's hook): the reader refuses it (INTEGRITY), and MISMATCH_CUTOFF in
    a row cut the link.  Unverified, the same corruption lands."""
    p, landing, src = pair()
    r = p.region  # type: ignore[attr-defined]

    def flip(views: object) -> list[memoryview]:
        copy = bytearray(b"".join(views))  # type: ignore[arg-type]
        copy[17] ^= 0xFF
        return [memoryview(copy)]

    landing.corrupt_read = flip
    dst = bytearray(8192)
    plain = Token()
    p.out.read(plain, 1, 0, r.rkeys[0], [r.ptr], [4096], [memoryview(dst)[:4096]])
    shuttle(p)
    complete(p)
    assert plain.error is None and dst[:4096] != src[:4096]
    assert sum(a != b for a, b in zip(dst[:4096], src[:4096], strict=True)) == 1
    tokens = []
    for op in range(2, 2 + MISMATCH_CUTOFF):
        tok = Token()
        tokens.append(tok)
        p.out.read(tok, op, 0, r.rkeys[0], [r.ptr], [4096], [memoryview(dst)[4096:]], True)
        shuttle(p)
        complete(p)
        if op < 1 + MISMATCH_CUTOFF:
            assert not p.out.closed
    for tok in tokens:
        assert isinstance(tok.error, IntegrityError), tok.error
        assert "checksum mismatch" in tok.error.message
    assert p.out.closed and isinstance(p.out.error, PeerUnreachable)
    assert "cut off" in str(p.out.error)
    # The region itself was never touched.
    landing.corrupt_read = None


def _asked(p: Pair, verify: bool) -> tuple[Token, bytearray]:
    r = p.region  # type: ignore[attr-defined]
    dst = bytearray(b"\x55" * 4096)
    tok = Token()
    p.out.read(tok, 9, 0, r.rkeys[0], [r.ptr], [4096], [memoryview(dst)], verify)
    drain(p.out)  # the READ went; a raw responder answers
    return tok, dst


def test_an_answer_without_the_checksum_asked_is_refused_unplaced() -> None:
    p, _, _ = pair()
    tok, dst = _asked(p, True)
    feed(p.out, encode_read_data(9, 0, 4096) + b"\xAA" * 4096)
    complete(p)
    assert isinstance(tok.error, PeerAnswered) and "without the checksum" in str(tok.error)
    assert dst == bytearray(b"\x55" * 4096)  # its bytes were dropped, not placed
    assert not p.out.closed  # the framing held


def test_a_wrong_checksum_is_refused_and_a_right_one_taken() -> None:
    p, _, _ = pair()
    body = os.urandom(4096)
    tok, dst = _asked(p, True)
    feed(p.out, encode_read_data(9, 0, 4096, None, encode_ext(crc_of([body]) ^ 1, None))
         + body, chunk=1000)
    complete(p)
    assert isinstance(tok.error, IntegrityError)
    tok, dst = _asked(p, True)
    feed(p.out, encode_read_data(9, 0, 4096, None, encode_ext(crc_of([body]), None)) + body,
         chunk=999)
    complete(p)
    assert tok.error is None and dst == body


def test_an_extension_block_nobody_asked_for_cuts_the_link() -> None:
    p, _, _ = pair()
    tok, dst = _asked(p, False)
    feed(p.out, encode_read_data(9, 0, 4096, None, encode_ext(0, None)) + b"\xAA" * 4096)
    assert p.out.closed and isinstance(p.out.error, PeerUnreachable)
    assert dst == bytearray(b"\x55" * 4096)
    complete(p)
    assert tok.error is not None
    # A block that is not one: cut as well, before a byte lands.
    p, _, _ = pair()
    tok, dst = _asked(p, True)
    feed(p.out, READ_DATA_HEAD.pack(READ_DATA, 0, 3, 0, 9, 4096) + b"\x01\x09\x00"
         + b"\xAA" * 4096)
    assert p.out.closed and dst == bytearray(b"\x55" * 4096)
    complete(p)
    assert isinstance(tok.error, PeerUnreachable)  # (another rail may re-read it)


def test_a_refused_traced_read_names_its_trace_id() -> None:
    p, _, _ = pair()
    r = p.region  # type: ignore[attr-defined]
    dst = bytearray(4096)
    tok = Token()
    p.out.read(tok, 4, 0, r.rkeys[0] ^ 2, [r.ptr], [4096], [memoryview(dst)], False, TRACE)
    shuttle(p)
    complete(p)
    assert tok.error is not None
    (refused,) = [e for e in p.inb.events if isinstance(e, Refused)]
    assert refused.what == "read" and refused.trace == TRACE



def test_a_refused_verified_read_leaves_nothing_behind() -> None:
    """Its READ_DATA refusal is the read's error, and the link forgets it asked for a
    checksum (a long-lived link's bookkeeping stays bounded)."""
    p, _, _ = pair()
    r = p.region  # type: ignore[attr-defined]
    dst = bytearray(4096)
    for op in range(1, 6):
        tok = Token()
        p.out.read(tok, op, 0, r.rkeys[0] ^ 2, [r.ptr], [4096], [memoryview(dst)], True)
        shuttle(p)
        complete(p)
        assert tok.error is not None and not isinstance(tok.error, IntegrityError)
    assert not p.out._crc_asked and not p.out._reads and not p.out.closed
