"""READ and READ_DATA on the sans-IO peer link, in memory (tests/peerlink.py).

The reader's end (an OutboundLink) asks, the responder's (an InboundLink) answers from
its region, checked by the landing rules (rights, bounds, admission); bytes are
compared end to end.  A responder that lies (bytes for a read nobody asked, more or
fewer than asked, an ACK for a read) gets the link cut before any byte lands.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from tests.peerlink import HostMemory, Pair, drain, feed, identity, link_pair
from transferd.protocol.errors import NotFound, OutOfBounds, TransferdError
from transferd.protocol.peer_landing import Landing
from transferd.protocol.peer_link import READ_HIGH, READ_LOW, LinkState, ReadsServed
from transferd.protocol.peer_wire import (
    READ_DATA,
    READ_DATA_HEAD,
    READ_HEAD,
    encode_ack,
    encode_read,
    encode_read_data,
    frame_size,
    parse_read,
)


@dataclass
class Token:
    """What a Domain hands a link with a part: completed once, finished after."""

    finished: bool = False
    error: TransferdError | None = None
    done: int = 0

    def part_done(self, error: TransferdError | None = None) -> None:
        self.done += 1
        self.error = error
        self.finished = True


def pair(access: str = "r", size: int = 1 << 20) -> tuple[Pair, HostMemory, bytearray]:
    mem = HostMemory(rails=1)
    region = mem.region(size, access)
    region.data[:] = os.urandom(size)
    p = link_pair(Landing(mem, 1), identity(1), identity(1), rail=0)
    p.region = region  # type: ignore[attr-defined]
    return p, mem, region.data


def to_responder(p: Pair, data: bytes) -> bytes:
    """Feed the responder while it reads; what it did not take (still in the 'kernel')."""
    while data and p.inb.reading:
        buf = p.inb.get_buffers()[0]
        n = min(len(buf), len(data))
        buf[:n] = data[:n]
        p.inb.received(n, 0.0)
        data = data[n:]
    return data


def shuttle(p: Pair, chunk: int = 1 << 30, rounds: int = 1000, to_inb: bytes = b"") -> None:
    """Move bytes both ways, as sockets would: the responder is fed only while it
    reads (a paused link's bytes wait in the 'kernel'), until both ends are quiet."""
    for _ in range(rounds):
        to_inb = to_responder(p, to_inb + drain(p.out))
        back = drain(p.inb, limit=chunk * 8)
        if back:
            feed(p.out, back, chunk=chunk)
        if not to_inb and not back and not p.out.out.queued and not p.inb.out.queued:
            return
    raise AssertionError("the link never went quiet")


def complete(p: Pair) -> list[tuple[Token, TransferdError | None]]:
    done, p.out.completions = p.out.completions, []
    for tok, err in done:
        tok.part_done(err)
    return done


def test_wire_round_trip() -> None:
    frame = encode_read(7, 3, 0xABCDEF, [0x1000, 0x9000], [100, 4096])
    assert frame_size(frame) == len(frame) == 32 + 32
    head = READ_HEAD.unpack_from(frame)
    r = parse_read(frame, 0, head)
    assert (r.op, r.part, r.rkey, r.addrs, r.lens, r.nbytes) == (
        7, 3, 0xABCDEF, [0x1000, 0x9000], [100, 4096], 4196)
    data = encode_read_data(7, 3, 4196)
    assert frame_size(data) == 24 + 4196
    refused = encode_read_data(7, 3, 0, NotFound("no"))
    assert frame_size(refused) == len(refused)


@pytest.mark.parametrize("chunk", [1 << 30, 4096, 7])
def test_single_and_paged_reads_land_in_place(chunk: int) -> None:
    p, _, src = pair()
    r = p.region  # type: ignore[attr-defined]
    dst = bytearray(1 << 20)
    dv = memoryview(dst)
    one, paged = Token(), Token()
    p.out.read(one, 1, 0, r.rkeys[0], [r.ptr + 5], [300_000], [dv[10:300_010]])
    pages = [(i * 4096, (200 - i) * 4096) for i in range(100)]
    p.out.read(paged, 2, 0, r.rkeys[0], [r.ptr + s for s, _ in pages], [4096] * 100,
               [dv[500_000 + d - 100 * 4096 + 4096:][:4096] for _, d in pages])
    shuttle(p, chunk, rounds=200_000)
    assert not p.out.closed
    assert [e for _, e in complete(p)] == [None, None]
    assert dst[10:300_010] == src[5:300_005]
    for s, d in pages:
        o = 500_000 + d - 100 * 4096 + 4096
        assert dst[o:o + 4096] == src[s:s + 4096]
    assert r.admitted == 0  # sent whole: the responder let its region go
    assert any(isinstance(e, ReadsServed) for e in p.inb.events)


@pytest.mark.parametrize("chunk", [1 << 30, 65_537, 4095])
def test_pages_of_every_size_land_in_place_whatever_the_receives(chunk: int) -> None:
    """Pages from 1 byte to past a receive's worth (1 MiB), scattered: each receive is
    offered the right views and every byte lands where its page says."""
    import random

    rng = random.Random(chunk)
    p, _, src = pair(size=8 << 20)
    r = p.region  # type: ignore[attr-defined]
    dst = bytearray(12 << 20)
    dv = memoryview(dst)
    lens = [1, 16_384, (1 << 20) + 3, 7, 4096, 511, (1 << 20) - 1, 3] + [
        rng.choice([1, 100, 4096, 16_384, 70_000]) for _ in range(200)]
    s_off = d_off = 0
    addrs, into, pages = [], [], []
    for n in lens:
        addrs.append(r.ptr + s_off)
        into.append(dv[d_off:d_off + n])
        pages.append((s_off, d_off, n))
        s_off += n + rng.randrange(0, 64)
        d_off += n + rng.randrange(1, 64)  # gaps: a byte out of place shows
    assert s_off <= len(src) and d_off <= len(dst)
    tok = Token()
    p.out.read(tok, 3, 0, r.rkeys[0], addrs, lens, into)
    shuttle(p, chunk, rounds=2_000_000)
    assert [e for _, e in complete(p)] == [None]
    want = bytearray(len(dst))  # and nothing landed between the pages
    for s, d, n in pages:
        want[d:d + n] = src[s:s + n]
    assert dst == want


def test_a_region_without_read_rights_answers_as_an_unknown_rkey() -> None:
    p, mem, _ = pair(access="w")
    r = p.region  # type: ignore[attr-defined]
    dst = bytearray(4096)
    t1, t2, t3 = Token(), Token(), Token()
    p.out.read(t1, 1, 0, r.rkeys[0], [r.ptr], [4096], [memoryview(dst)])
    p.out.read(t2, 2, 0, r.rkeys[0] ^ 2, [r.ptr], [4096], [memoryview(dst)])
    shuttle(p)
    complete(p)
    assert isinstance(t1.error, NotFound) and isinstance(t2.error, NotFound)
    assert t1.error.message == t2.error.message
    # Past the region's end, on a readable one.
    rr = mem.region(8192, "r")
    p.out.read(t3, 3, 0, rr.rkeys[0], [rr.ptr + 8000], [4096], [memoryview(dst)])
    shuttle(p)
    complete(p)
    assert isinstance(t3.error, OutOfBounds)
    assert dst == bytearray(4096) and not p.out.closed and not p.inb.closed


def _answered(p: Pair, data: bytes) -> None:
    """The responder's bytes (forged), to the reader."""
    feed(p.out, data)


@pytest.mark.parametrize("lie", ["unasked", "more", "fewer", "ack", "text"])
def test_a_lying_responder_is_cut_off_before_a_byte_lands(lie: str) -> None:
    """("text": an ok READ_DATA announcing a message, which frame_size counts and the
    stream's reader skipped: the two ends of a message transport and a stream would
    disagree where the next frame starts; refused like an ok ACK with text.)"""
    p, _, _ = pair()
    r = p.region  # type: ignore[attr-defined]
    dst = bytearray(b"\x55" * 8192)
    tok = Token()
    p.out.read(tok, 9, 0, r.rkeys[0], [r.ptr], [4096], [memoryview(dst)[:4096]])
    drain(p.out)  # the READ went; the peer answers with a lie
    if lie == "unasked":
        forged = encode_read_data(10, 0, 4096) + b"\xAA" * 4096
    elif lie == "more":
        forged = encode_read_data(9, 0, 8192) + b"\xAA" * 8192
    elif lie == "fewer":
        forged = encode_read_data(9, 0, 100) + b"\xAA" * 100
    elif lie == "text":
        forged = (READ_DATA_HEAD.pack(READ_DATA, 0, 5, 0, 9, 4096) + b"hello"
                  + b"\xAA" * 4091)
    else:
        forged = encode_ack(9, 0)
    _answered(p, forged)
    assert p.out.closed and isinstance(p.out.error, TransferdError)
    assert dst == bytearray(b"\x55" * 8192)  # nothing touched
    complete(p)
    assert tok.error is not None  # the read failed with the link (another rail may re-read)


def test_a_read_whose_transfer_ended_drops_what_still_arrives() -> None:
    p, _, src = pair()
    r = p.region  # type: ignore[attr-defined]
    dst = bytearray(200_000)
    tok = Token()
    p.out.read(tok, 1, 0, r.rkeys[0], [r.ptr], [200_000], [memoryview(dst)])
    feed(p.inb, drain(p.out))
    answer = drain(p.inb)
    feed(p.out, answer[:50_000])  # some of it lands ...
    assert p.out.in_frame
    tok.finished = True  # ... then the transfer times out (or is cancelled)
    feed(p.out, answer[50_000:], chunk=4096)
    assert not p.out.closed and not p.out.in_frame
    landed = 50_000 - 24
    assert dst[:landed] == src[:landed]
    assert dst[landed:] == bytes(200_000 - landed)  # nothing after the end
    assert not p.out.completions  # and nothing completes twice


@pytest.mark.parametrize("cut", [0, 10, 50_000])
def test_reads_that_ended_unanswered_are_let_go_and_a_late_answer_is_dropped(cut: int) -> None:
    # The reader's transfer timed out with no answer (or part of one, ``cut`` bytes):
    # the link lets go of the views it was to land in (their memory may go back to
    # its owner: a bytearray with views taken cannot be resized), keeps its length,
    # and drops the answer when it comes late, whole or in pieces; others land.
    p, _, src = pair()
    r = p.region  # type: ignore[attr-defined]
    dst, other = bytearray(200_000), bytearray(1000)
    tok, live = Token(), Token()
    p.out.read(tok, 1, 0, r.rkeys[0], [r.ptr], [200_000], [memoryview(dst)])
    p.out.read(live, 2, 0, r.rkeys[0], [r.ptr + 5], [1000], [memoryview(other)])
    feed(p.inb, drain(p.out))
    answer = drain(p.inb)
    first = 24 + 200_000
    feed(p.out, answer[:cut])
    tok.finished = True
    p.out.let_go_ended()
    dst.extend(b"x")  # no view of it is left (BufferError otherwise)
    del dst[-1]
    feed(p.out, answer[cut:first], chunk=4096)
    feed(p.out, answer[first:])
    assert not p.out.closed
    assert dst[max(cut - 24, 0):] == bytes(200_000 - max(cut - 24, 0))
    assert complete(p) == [(live, None)] and other == src[5:1005]


def test_the_responder_holds_the_region_until_sent_and_reads_no_more_above_water() -> None:
    n = READ_HIGH + 1
    p, _, _ = pair(size=n)
    r = p.region  # type: ignore[attr-defined]
    dst = bytearray(n)
    toks = [Token() for _ in range(2)]
    for i, t in enumerate(toks):
        p.out.read(t, i + 1, 0, r.rkeys[0], [r.ptr], [n], [memoryview(dst)])
    left = to_responder(p, drain(p.out))
    # One answer queued (views: no copy) is over the watermark: the second READ, taken
    # in by the same receive, waits in the link's buffer, not served.
    assert p.inb.out.queued > READ_HIGH and p.inb.state is LinkState.PAUSED
    assert r.admitted == 1 and not left
    feed(p.out, drain(p.inb, limit=n - READ_LOW))  # not all of it yet: still held
    assert r.admitted == 1 and p.inb.state is LinkState.PAUSED
    feed(p.out, drain(p.inb, limit=p.inb.out.queued - READ_LOW))  # down to it: reads on
    # and serves the READ it holds, with no new byte from the peer to wake it (whose
    # answer is over the watermark in turn: held again).
    assert r.admitted == 2 and p.inb.state is LinkState.PAUSED
    shuttle(p, to_inb=left)
    complete(p)
    assert [t.error for t in toks] == [None, None] and r.admitted == 0


def test_a_responder_that_closes_lets_its_regions_go_and_sends_nothing_more() -> None:
    p, _, _ = pair()
    r = p.region  # type: ignore[attr-defined]
    dst = bytearray(1 << 20)
    tok = Token()
    p.out.read(tok, 1, 0, r.rkeys[0], [r.ptr], [1 << 20], [memoryview(dst)])
    feed(p.inb, drain(p.out))
    assert r.admitted == 1
    p.inb.close(None)
    assert r.admitted == 0 and not p.inb.out.queued
    p.out.close(None)
    complete(p)
    assert tok.error is not None


def test_read_data_header_constants() -> None:
    assert READ_DATA_HEAD.size == 24 and READ_DATA == 0x47
