"""The sans-IO peer link, in memory: two cores wired together, no sockets, no loop.

Both ends of a link (:mod:`transferd.protocol.peer_link`), the group's landing rules
(:mod:`transferd.protocol.peer_landing`) over bytearray regions, and a shuffler that
loses, repeats, delays and reorders frames across rails (:class:`tests.peerlink.
Shuffler`).  Data is compared byte for byte, counters by the counting rules.
"""

from __future__ import annotations

import itertools
import random
import struct

import pytest

from tests.peerlink import (
    SECRET,
    HostMemory,
    Shuffler,
    Write,
    drain,
    feed,
    frames,
    identity,
    link_pair,
)
from transferd.protocol.errors import (
    BadFrame,
    BadRequest,
    NotFound,
    OutOfBounds,
    PeerUnreachable,
    Timeout,
    Unauthorized,
)
from transferd.protocol.peer_handshake import Probe, Ready
from transferd.protocol.peer_inbound import InboundLink
from transferd.protocol.peer_landing import Landing
from transferd.protocol.peer_link import (
    ACK_HIGH,
    RECV_BYTES,
    TRANSITIONS,
    Closed,
    Land,
    LinkInput,
    LinkState,
    ProbeArrived,
)
from transferd.protocol.peer_outbound import OutboundLink
from transferd.protocol.peer_wire import (
    ACK_HEAD,
    WRITE_HEAD,
    encode_ack,
    encode_send,
    encode_write,
    frame_size,
)

_ops = itertools.count(1)


def _setup(rails: int = 1, deferred: bool = False):
    mem = HostMemory(rails, deferred)
    landing = Landing(mem, rails)
    me, them = identity(rails), identity(rails)
    return mem, landing, link_pair(landing, me, them)


def _write(p, region, off, data, imm=7, rail=0, **kw):
    op = kw.pop("op", next(_ops))
    token = object()
    p.out.write(token, op, kw.pop("part", 0), region.rkeys[rail], [region.ptr + off],
                [len(data)], [memoryview(data)], imm, **kw)
    p.pump()
    results = [e for t, e in p.out.completions if t is token]
    p.out.completions.clear()
    return results


# -- the state table ------------------------------------------------------------------


def test_every_state_move_is_a_row_of_the_table() -> None:
    link = OutboundLink(identity(1), 0, SECRET, 0.0, timeout=5.0,
                        expect=(1, 0, b"10.0.1.0:1"))
    assert link.state is LinkState.CONNECTING
    for state, what in itertools.product(LinkState, LinkInput):
        link.state = state
        if (state, what) in TRANSITIONS:
            link._move(what)
            assert link.state is TRANSITIONS[(state, what)]
        else:
            with pytest.raises(BadFrame):
                link._move(what)
            assert link.state is state
    assert all((s, LinkInput.CLOSE) in TRANSITIONS for s in LinkState if s is not
               LinkState.CLOSED)


def test_a_write_lands_counts_once_and_its_ack_is_sixteen_bytes() -> None:
    mem, _, p = _setup()
    r = mem.region(1 << 16)
    data = random.Random(1).randbytes(4096)
    token = object()
    p.out.write(token, 5, 0, r.rkeys[0], [r.ptr + 64], [4096], [memoryview(data)], 9)
    wire = drain(p.out)
    assert len(wire) == 64 + 4096  # the small write: one 64-byte header
    feed(p.inb, wire)
    ack = drain(p.inb)
    assert len(ack) == ACK_HEAD.size and ACK_HEAD.unpack(ack) == (0x42, 0, 0, 0, 5)
    feed(p.out, ack)
    assert p.out.completions == [(token, None)]
    assert bytes(r.data[64:64 + 4096]) == data and mem.counts[9] == 1
    assert r.admitted == 0


def test_paged_writes_count_per_page_and_many_arrive_in_one_read() -> None:
    mem, _, p = _setup()
    r = mem.region(1 << 20)
    rng = random.Random(2)
    pages = [rng.randbytes(4096) for _ in range(40)]
    idx = rng.sample(range(200), 40)
    tokens = []
    for k in range(4):  # four frames of ten pages, sent back to back
        t = object()
        tokens.append(t)
        sl = slice(10 * k, 10 * k + 10)
        p.out.write(t, 100 + k, 0, r.rkeys[0], [r.ptr + i * 4096 for i in idx[sl]],
                    [4096] * 10, [memoryview(x) for x in pages[sl]], 3)
    feed(p.inb, drain(p.out))  # all of it in one receive
    feed(p.out, drain(p.inb))
    assert [t for t, e in p.out.completions if e is None] == tokens
    for i, page in zip(idx, pages, strict=True):
        assert bytes(r.data[i * 4096:(i + 1) * 4096]) == page
    assert mem.counts[3] == 40


def test_a_large_payload_is_received_straight_into_its_pages() -> None:
    mem, _, p = _setup()
    r = mem.region(4 << 20)
    data = random.Random(3).randbytes(3 << 20)
    p.out.write(object(), 1, 0, r.rkeys[0], [r.ptr], [len(data)], [memoryview(data)], None)
    wire = drain(p.out)
    feed(p.inb, wire[:64 + 1000])  # header and a little: into the link's buffer
    bufs = p.inb.get_buffers()
    # The rest goes to the region itself, not to the link's buffer: a socket's worth
    # (RECV_BYTES) a receive, straight after what came first.
    assert bufs[0].obj is r.data and len(bufs) == 1
    assert len(bufs[0]) == min(RECV_BYTES, len(data) - 1000)
    bufs[0][0] = 0xAB  # where it lies: at offset 1000 of the region
    assert r.data[1000] == 0xAB
    feed(p.inb, wire[64 + 1000:], chunk=1 << 18)
    feed(p.out, drain(p.inb))
    assert p.out.completions[0][1] is None and bytes(r.data[:len(data)]) == data


def test_a_paged_writes_header_comes_in_one_receive_once_the_link_has_seen_one() -> None:
    mem, _, p = _setup()
    r = mem.region(1 << 22)
    rng = random.Random(9)

    def paged(op: int) -> tuple[bytes, list[int], list[bytes]]:
        idx = rng.sample(range(200), 64)
        pages = [rng.randbytes(16384) for _ in idx]
        p.out.write(op, op, 0, r.rkeys[0], [r.ptr + i * 16384 for i in idx], [16384] * 64,
                    [memoryview(x) for x in pages], 5)
        return drain(p.out), idx, pages

    first, _, _ = paged(1)
    # The first: the frame-start read (64 bytes and room for a small write's payload)
    # takes its 568-byte header whole, then its pages (and the next header's start)
    # come in one receive.
    assert feed(p.inb, first) == 2
    second, idx, pages = paged(2)
    assert feed(p.inb, second) == 2  # its header whole, then its pages
    feed(p.out, drain(p.inb))
    assert [e for _, e in p.out.completions] == [None, None] and mem.counts[5] == 128
    for i, page in zip(idx, pages, strict=True):
        assert bytes(r.data[i * 16384:(i + 1) * 16384]) == page


@pytest.mark.parametrize("chunk", [1, 100, 567, 568, 569, 5000, 1 << 30])
def test_frames_after_a_paged_write_land_whole_however_the_stream_is_cut(chunk: int) -> None:
    # After a paged write the link reads a frame's start as such a header: what a
    # smaller frame brings in past its own header is payload, copied to its pages.
    mem, _, p = _setup()
    r = mem.region(1 << 21)
    rng = random.Random(chunk)
    idx = rng.sample(range(64), 32)
    pages = [rng.randbytes(16384) for _ in idx]
    small = [rng.randbytes(n) for n in (0, 1, 300, 4096, 9000)]
    p.out.write("paged", 1, 0, r.rkeys[0], [r.ptr + i * 16384 for i in idx], [16384] * 32,
                [memoryview(x) for x in pages], 4)
    for k, d in enumerate(small):
        p.out.write(k, 10 + k, 0, r.rkeys[0], [r.ptr + (1 << 20) + 10000 * k], [len(d)],
                    [memoryview(d)], 6)
    feed(p.inb, drain(p.out), chunk=chunk)
    feed(p.out, drain(p.inb))
    assert sorted(map(str, (t for t, e in p.out.completions if e is None))) == \
        sorted(["paged", *map(str, range(len(small)))])
    for i, page in zip(idx, pages, strict=True):
        assert bytes(r.data[i * 16384:(i + 1) * 16384]) == page
    for k, d in enumerate(small):
        at = (1 << 20) + 10000 * k
        assert bytes(r.data[at:at + len(d)]) == d
    assert mem.counts[4] == 32 and mem.counts[6] == len(small) and r.admitted == 0


def test_a_paged_write_whose_pages_do_not_add_up_is_refused_and_the_link_serves_on() -> None:
    mem, landing, p = _setup()
    r = mem.region(1 << 16)
    addrs = [r.ptr + 4096 * i for i in range(4)]
    wire = bytearray(encode_write(2, 0, r.rkeys[0], addrs, [4096] * 4, 7))
    struct.pack_into("<Q", wire, 40, 4 * 4096 - 1)  # the payload one byte short
    feed(p.inb, bytes(wire) + bytes(4 * 4096 - 1))
    (ack,) = frames(drain(p.inb))
    assert ack[1] == 1 and b"payload has 16383" in ack
    # One page ending past the last address: refused before the memory is asked.
    top = (1 << 64) - 4096
    wire = encode_write(3, 0, r.rkeys[0], [r.ptr, top + 1], [4096] * 2, 7)
    feed(p.inb, wire + bytes(8192))
    (ack,) = frames(drain(p.inb))
    assert ack[1] == 1 and b"past the end of the address space" in ack
    assert mem.counts[7] == 0 and r.admitted == 0
    assert landing.refused_by == {"BAD_REQUEST": 2}
    assert _write(p, r, 0, b"good") == [None]


def test_a_write_that_meets_an_expectation_asks_for_its_ack_after_the_callbacks() -> None:
    mem, _, p = _setup()
    r = mem.region(1 << 16)

    def count(imm: int, n: int) -> int:  # an expectation waits on immediate 7
        mem.counts[imm] += n
        return 1 if imm == 7 else 0

    mem.count = count  # type: ignore[method-assign]
    p.out.write("a", 1, 0, r.rkeys[0], [r.ptr], [4], [memoryview(b"abcd")], 8)
    feed(p.inb, drain(p.out))
    assert not p.inb.acks_later and p.inb.out.queued == 16  # nothing met: at once
    feed(p.out, drain(p.inb))
    p.out.write("b", 2, 0, r.rkeys[0], [r.ptr + 4], [4], [memoryview(b"efgh")], 7)
    feed(p.inb, drain(p.out))
    # Met: the ACK is queued, and the I/O side is told to send it after this turn.
    assert p.inb.acks_later and p.inb.out.queued == 16
    feed(p.out, drain(p.inb))
    assert [t for t, e in p.out.completions if e is None] == ["a", "b"]
    assert bytes(r.data[:8]) == b"abcdefgh" and mem.counts[7] == 1


@pytest.mark.parametrize("chunk", [1, 7, 63, 64, 65, 4096])
def test_any_cut_of_the_stream_gives_the_same_result(chunk: int) -> None:
    mem, _, p = _setup()
    r = mem.region(1 << 16)
    rng = random.Random(chunk)
    datas = [rng.randbytes(rng.randrange(0, 9000)) for _ in range(6)]
    for k, d in enumerate(datas):
        p.out.write(k, 10 + k, 0, r.rkeys[0], [r.ptr + 10000 * (k % 6)], [len(d)],
                    [memoryview(d)], 1)
    feed(p.inb, drain(p.out), chunk=chunk)
    feed(p.out, drain(p.inb), chunk=chunk)
    assert sorted(t for t, e in p.out.completions if e is None) == list(range(6))
    for k, d in enumerate(datas):
        assert bytes(r.data[10000 * k:10000 * k + len(d)]) == d
    assert mem.counts[1] == 6


# -- refusals ----------------------------------------------------------------------------


def test_refusals_leave_memory_and_counters_untouched_and_the_link_serves_on() -> None:
    mem, landing, p = _setup()
    r = mem.region(8192)
    before = bytes(r.data)
    assert isinstance(_write(p, r, 8192 - 100, b"x" * 200)[0], OutOfBounds)
    token = object()
    p.out.write(token, 1, 0, 12345, [r.ptr], [4], [memoryview(b"abcd")], 7)
    p.pump()
    assert isinstance(p.out.completions.pop()[1], NotFound)
    # Lengths that do not add up to the payload: refused, its bytes skipped.
    wire = bytearray(encode_write(2, 0, r.rkeys[0], [r.ptr], [8], 7))
    struct.pack_into("<Q", wire, 40, 4)
    feed(p.inb, bytes(wire) + b"abcd")
    (ack,) = frames(drain(p.inb))
    assert ack[1] == 1 and b"BAD_REQUEST" in ack
    assert bytes(r.data) == before and mem.counts[7] == 0 and r.admitted == 0
    assert _write(p, r, 0, b"good") == [None]  # the link goes on
    assert landing.refused_by == {"OUT_OF_BOUNDS": 1, "NOT_FOUND": 1, "BAD_REQUEST": 1}


def test_an_extension_block_is_refused_and_skipped() -> None:
    mem, _, p = _setup()
    r = mem.region(8192)
    wire = bytearray(encode_write(3, 0, r.rkeys[0], [r.ptr], [4], 7))
    struct.pack_into("<I", wire, 28, 8)  # ext: 8 bytes after the page table
    feed(p.inb, bytes(wire[:64]) + b"EXTBLOCK" + b"abcd")
    (ack,) = frames(drain(p.inb))
    assert ack[1] == 1 and b"extension" in ack
    assert bytes(r.data[:4]) == bytes(4) and _write(p, r, 0, b"next") == [None]


@pytest.mark.parametrize("bad", ["cmd", "flags", "pages"])
def test_a_frame_whose_size_cannot_be_trusted_closes_the_link(bad: str) -> None:
    mem, _, p = _setup()
    r = mem.region(8192)
    wire = bytearray(encode_write(3, 0, r.rkeys[0], [r.ptr], [4], 7))
    if bad == "cmd":
        wire[0] = 0x4F
    elif bad == "flags":
        wire[1] |= 0x80
    else:
        struct.pack_into("<H", wire, 2, 5000)
    feed(p.inb, bytes(wire))
    assert p.inb.closed and isinstance(p.inb.error, BadFrame)
    assert any(isinstance(e, Closed) for e in p.inb.events)


def test_an_outbound_link_takes_acks_only_and_bounded_ones() -> None:
    _, _, p = _setup()
    feed(p.out, encode_send(1, 0, 0))
    # Its parts fail PEER_UNREACHABLE (another rail may take them), saying why.
    assert p.out.closed and isinstance(p.out.error, PeerUnreachable)
    assert "takes ACKs only" in p.out.error.message
    _, _, p = _setup()
    feed(p.out, ACK_HEAD.pack(0x42, 1, 60000, 0, 1))
    assert p.out.closed and "ACK" in p.out.error.message


def test_closed_mid_payload_counts_nothing_and_lets_a_retry_land() -> None:
    mem, landing, p = _setup()
    r = mem.region(1 << 20)
    data = b"z" * 100_000
    p.out.write(object(), 1, 0, r.rkeys[0], [r.ptr], [len(data)], [memoryview(data)], 4,
                wid=77)
    feed(p.inb, drain(p.out)[:50_000])
    assert r.admitted == 1
    p.inb.close(PeerUnreachable("gone"))
    assert r.admitted == 0 and mem.counts[4] == 0
    q = link_pair(landing, p.out.hs.me, p.inb.hs.me)
    assert _write(q, r, 0, data, imm=4, wid=77) == [None]
    assert mem.counts[4] == 1


# -- duplicates, re-sent parts, write ids --------------------------------------------------


def test_a_resent_part_whose_first_copy_landed_is_acknowledged_not_applied() -> None:
    mem, landing, p = _setup(rails=2)
    r = mem.region(1 << 16)
    assert _write(p, r, 0, b"first", op=50) == [None]
    r.data[:5] = b"-----"
    # Its ACK was lost with the rail: the same part, marked again, on rail 1.
    q = link_pair(landing, p.out.hs.me, p.inb.hs.me, rail=1)
    assert _write(q, r, 0, b"first", op=50, rail=1, again=True) == [None]
    assert bytes(r.data[:5]) == b"-----" and mem.counts[7] == 1
    assert landing.duplicates == 1
    # Unmarked, the same frame is a write of its own (a peer may repeat one).
    assert _write(q, r, 0, b"first", op=50, rail=1) == [None]
    assert bytes(r.data[:5]) == b"first" and mem.counts[7] == 2


def test_a_split_write_counts_once_its_span_is_covered_in_any_order() -> None:
    mem, landing, p = _setup(rails=2)
    q = link_pair(landing, p.out.hs.me, p.inb.hs.me, rail=1)
    r = mem.region(1 << 20)
    span = (r.ptr, 3 * 4096)
    parts = [(2, 8192, b"c" * 4096), (0, 0, b"a" * 4096), (1, 4096, b"b" * 4096)]
    for k, (part, off, data) in enumerate(parts):
        link = p if k % 2 else q
        res = _write(link, r, off, data, op=60, part=part, rail=k % 2 ^ 1, span=span)
        assert res == [None]
        assert mem.counts[7] == (1 if k == 2 else 0)
    assert bytes(r.data[:3 * 4096]) == b"a" * 4096 + b"b" * 4096 + b"c" * 4096
    # An overlapping part is refused.
    assert isinstance(_write(p, r, 100, b"x" * 4096, op=61, span=span)[0], type(None))
    assert isinstance(_write(p, r, 200, b"x" * 4096, op=61, part=1, span=span)[0], BadRequest)


def test_write_ids_retry_lands_once_other_contents_refused() -> None:
    mem, landing, p = _setup()
    r = mem.region(1 << 20)
    assert _write(p, r, 0, b"abcd", wid=9) == [None]
    r.data[:4] = b"...."
    assert _write(p, r, 0, b"abcd", wid=9, op=999) == [None]  # a retry: not again
    assert bytes(r.data[:4]) == b"...." and mem.counts[7] == 1
    (err,) = _write(p, r, 8, b"efgh", wid=9)
    assert isinstance(err, BadRequest) and "other contents" in err.message
    # Still landing from the first attempt (on another link): TIMEOUT, outcome unknown.
    big = b"q" * 200_000
    p.out.write(object(), 5, 0, r.rkeys[0], [r.ptr], [len(big)], [memoryview(big)], 7,
                wid=10)
    feed(p.inb, drain(p.out)[:1000])
    q = link_pair(landing, p.out.hs.me, p.inb.hs.me)
    assert isinstance(_write(q, r, 0, big, wid=10)[0], Timeout)


# -- messages ---------------------------------------------------------------------------


def test_a_message_is_delivered_from_the_authenticated_peer_then_acknowledged() -> None:
    _, _, p = _setup()
    token = object()
    p.out.send(token, 3, 0, b"hello")
    p.pump()
    (ev,) = p.delivered
    assert ev.peer == p.out.hs.me.key and ev.message == b"hello"
    assert p.out.completions == []  # not until a client has it
    p.inb.delivered(ev.ref, None)
    p.pump()
    assert p.out.completions == [(token, None)]


def test_a_message_over_the_limit_is_refused_before_anything_is_allocated() -> None:
    _, _, p = _setup()
    n = (1 << 20) + 1
    feed(p.inb, encode_send(4, 0, n))  # a size only the sender vouches for
    assert p.inb._msg is None  # nothing collected: its bytes are read and dropped
    feed(p.inb, bytes(n))
    (ack,) = frames(drain(p.inb))
    assert b"over the limit" in ack and not p.inb.closed and not p.delivered


# -- back-pressure ------------------------------------------------------------------------


def test_acks_unread_stop_reading_until_they_are_taken() -> None:
    mem, _, p = _setup()
    r = mem.region(1 << 16)
    n = ACK_HIGH // 16 + 1000
    wire = b"".join(encode_write(k, 0, r.rkeys[0], [r.ptr], [1], None) + b"x"
                    for k in range(n))
    fed = 0
    while p.inb.reading:
        bufs = p.inb.get_buffers()
        k = min(len(bufs[0]), 65 * 100, len(wire) - fed)
        bufs[0][:k] = wire[fed:fed + k]
        fed += k
        p.inb.received(k, 0.0)
    assert p.inb.state is LinkState.PAUSED and fed < len(wire)
    acks = drain(p.inb)  # the peer reads its ACKs: reading goes on
    assert p.inb.reading
    feed(p.inb, wire[fed:])
    acks += drain(p.inb)
    assert len(frames(acks)) == n


def test_an_outbound_link_over_its_high_watermark_holds_parts_back() -> None:
    mem = HostMemory(1)
    landing = Landing(mem, 1)
    me, them = identity(1), identity(1)
    p = link_pair(landing, me, them)
    p.out.high_water, p.out.low_water = 10_000, 4_000
    r = mem.region(1 << 20)
    for k in range(5):
        p.out.write(k, k + 1, 0, r.rkeys[0], [r.ptr + k * 8000], [8000],
                    [memoryview(b"%d" % k * 8000)], 1)
    assert p.out.state is LinkState.PAUSED and p.out.waiting == 3
    p.pump()
    assert sorted(t for t, e in p.out.completions if e is None) == list(range(5))
    assert mem.counts[1] == 5


def test_a_deferred_landing_holds_the_link_and_acks_once_landed() -> None:
    mem, _, p = _setup(deferred=True)
    r = mem.region(1 << 16)
    token = object()
    p.out.write(token, 1, 0, r.rkeys[0], [r.ptr], [4], [memoryview(b"dev!")], 2)
    p.out.write(token, 2, 0, r.rkeys[0], [r.ptr + 4], [4], [memoryview(b"next")], 2)
    first, second = frames(drain(p.out))
    feed(p.inb, first)
    (land,) = [e for e in p.inb.events if isinstance(e, Land)]
    assert p.inb.state is LinkState.PAUSED and mem.counts[2] == 0 and drain(p.inb) == b""
    assert not p.inb.reading  # the next frame waits in the socket meanwhile
    p.inb.events.clear()
    p.inb.landed(land, None)  # the copy completed: counted, acknowledged, reading on
    assert mem.counts[2] == 1 and p.inb.reading
    feed(p.inb, second)
    (land2,) = [e for e in p.inb.events if isinstance(e, Land)]
    p.inb.landed(land2, None)
    feed(p.out, drain(p.inb))
    assert [e for _, e in p.out.completions] == [None, None] and mem.counts[2] == 2


# -- the handshake ---------------------------------------------------------------------


def test_a_wrong_secret_ends_both_ends_with_the_reason() -> None:
    me, them = identity(1), identity(1)
    out = OutboundLink(me, 0, b"one secret", 0.0, timeout=5.0,
                       expect=(them.node, 0, them.addrs[0]))
    inb = InboundLink(them, 0, b"another", 0.0, landing=Landing(HostMemory(1)), timeout=5.0,
                      max_message=1 << 20)
    out.connected(0.0)
    feed(inb, drain(out))
    feed(out, drain(inb))
    assert out.closed and isinstance(out.error, PeerUnreachable)
    assert "did not prove the cluster secret" in out.error.message
    # The responder, told nothing, waits for an AUTH until its handshake times out.
    assert not inb.closed
    inb.tick(6.0)
    assert inb.closed and isinstance(inb.error, Timeout)
    # The other way round the responder refuses the AUTH and says why.
    out = OutboundLink(me, 0, b"one secret", 0.0, timeout=5.0,
                       expect=(them.node, 0, them.addrs[0]))
    out.connected(0.0)
    inb = InboundLink(them, 0, b"one secret", 0.0, landing=Landing(HostMemory(1)),
                      timeout=5.0, max_message=1 << 20)
    feed(inb, drain(out))
    feed(out, drain(inb))
    out.hs.secret = b"a third"  # the initiator's AUTH proves another secret
    out.hs._out.clear()
    from transferd.protocol.frames import encode_frame
    from transferd.protocol.peer import PeerCommand
    feed(inb, encode_frame(PeerCommand.AUTH, 0, 0, {"mac": bytes(32)}))
    assert inb.closed and isinstance(inb.error, Unauthorized)
    assert b"UNAUTHORIZED" in drain(inb)


def test_without_a_secret_the_probe_holds_the_initiator_to_its_address() -> None:
    me, them = identity(1), identity(1)
    out = OutboundLink(me, 0, None, 0.0, timeout=5.0, expect=(them.node, 0, them.addrs[0]))
    inb = InboundLink(them, 0, None, 0.0, landing=Landing(HostMemory(1)), timeout=5.0,
                      max_message=1 << 20)
    out.connected(0.0)
    feed(inb, drain(out))
    (probe,) = [e for e in inb.events if isinstance(e, Probe)]
    assert probe.addr == me.addrs[0]
    feed(out, drain(inb))
    # The PROBE reaches our listener on a connection of its own.
    listener = InboundLink(me, 0, None, 0.0, landing=Landing(HostMemory(1)), timeout=5.0,
                           max_message=1 << 20)
    feed(listener, probe.data)
    (arrived,) = [e for e in listener.events if isinstance(e, ProbeArrived)]
    assert arrived.nonce == out.nonce and listener.closed
    out.probe(arrived.token, 0.0)
    feed(inb, drain(out))
    feed(out, drain(inb))
    assert any(isinstance(e, Ready) for e in out.events) and inb.authenticated


def test_the_handshake_times_out_and_takes_no_payload() -> None:
    them = identity(1)
    inb = InboundLink(them, 0, SECRET, 0.0, landing=Landing(HostMemory(1)), timeout=2.0,
                      max_message=1 << 20)
    inb.tick(1.0)
    assert not inb.closed
    inb.tick(2.5)
    assert inb.closed and isinstance(inb.error, Timeout)
    # Before the handshake a data frame is not one: the decoder refuses it.
    inb = InboundLink(them, 0, SECRET, 0.0, landing=Landing(HostMemory(1)), timeout=2.0,
                      max_message=1 << 20)
    feed(inb, encode_write(1, 0, 1, [0], [4], None) + b"abcd")
    assert inb.closed


def test_frame_size_reads_every_data_frame() -> None:
    w = encode_write(1, 2, 3, [10, 20, 30], [5, 5, 5], 4) + b"x" * 15
    assert frame_size(w) == len(w) and frame_size(w[:47]) is None
    assert WRITE_HEAD.unpack_from(w)[1] & 0x10  # one length for all pages
    a = encode_ack(1, 2, BadRequest("no"))
    assert frame_size(a) == len(a)
    with pytest.raises(BadFrame):
        frame_size(b"\x99" + bytes(60))


# -- the shuffler ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_lost_repeated_delayed_reordered_frames_count_exactly_once(seed: int) -> None:
    """Single, split and paged writes over two rails while rails are cut (their frames
    lost, their parts re-sent marked again) and frames with write ids repeated:
    every write ends once, ok; every byte is right; every counter exactly right."""
    sh = Shuffler(rails=2, seed=seed, cut=0.03, delay=0.3, repeat=0.2)
    rng = random.Random(100 + seed)
    r = sh.memory.region(1 << 21)
    writes: list[Write] = []
    expect = 0
    for k in range(60):
        op = 1000 + k
        base = k * 32768
        kind = rng.choice(["single", "split", "paged"])
        wid = rng.randrange(1, 1 << 63) if rng.random() < 0.5 else None
        if kind == "single":
            data = rng.randbytes(rng.randrange(1, 20000))
            writes.append(Write(op, 0, [r.ptr + base], [len(data)], [data], 5, wid=wid,
                                rkeys=r.rkeys, rail=k % 2))
            expect += 1
        elif kind == "split":
            span = (r.ptr + base, 3 * 4096)
            for part in range(3):
                data = rng.randbytes(4096)
                writes.append(Write(op, part, [r.ptr + base + part * 4096], [4096], [data],
                                    5, span, wid, r.rkeys, rail=(k + part) % 2))
            expect += 1
        else:
            pages = [rng.randbytes(1024) for _ in range(6)]
            writes.append(Write(op, 0, [r.ptr + base + i * 2048 for i in range(6)],
                                [1024] * 6, pages, 5, wid=wid, rkeys=r.rkeys, rail=k % 2))
            expect += 6
    order = writes[:]
    rng.shuffle(order)
    for w in order:
        sh.post(w)
        for _ in range(rng.randrange(0, 4)):
            sh.step()
    sh.run()
    assert sh.cuts, "no rail was cut: the case proves nothing"
    for w in writes:
        assert w.result == [None], (w.op, w.part, w.result)
        for a, n, s in zip(w.addrs, w.lens, w.src, strict=True):
            assert bytes(r.data[a - r.ptr:a - r.ptr + n]) == s
    assert sh.memory.counts[5] == expect
    assert r.admitted == 0


def test_an_ok_ack_that_announces_text_closes_the_link() -> None:
    """An ACK is 16 bytes and ``mlen`` more (frame_size); an ok one with text was
    read as 16, so its text was taken for the next ACKs: a forged ``(op, part)``
    inside it completed a part the peer never answered."""
    mem, _, p = _setup()
    r = mem.region(1 << 16)
    token = object()
    p.out.write(token, 5, 0, r.rkeys[0], [r.ptr], [4], [memoryview(b"abcd")], 1)
    drain(p.out)
    feed(p.out, ACK_HEAD.pack(0x42, 0, 16, 0, 99) + ACK_HEAD.pack(0x42, 0, 0, 0, 5))
    assert p.out.closed and "ACK" in p.out.error.message
    assert p.out.completions == [(token, p.out.error)]


def test_acks_never_owed_complete_nothing() -> None:
    """An ACK for a part never sent, a second ACK for one answered, and an ACK for a
    part of another link (rail 1's, on rail 0) complete nothing and keep the link."""
    mem, landing, p = _setup(rails=2)
    q = link_pair(landing, p.out.hs.me, p.inb.hs.me, rail=1)
    r = mem.region(1 << 16)
    mine, theirs = object(), object()
    p.out.write(mine, 5, 0, r.rkeys[0], [r.ptr], [4], [memoryview(b"abcd")], 1)
    q.out.write(theirs, 6, 0, r.rkeys[1], [r.ptr + 8], [4], [memoryview(b"efgh")], 1)
    drain(p.out), drain(q.out)
    feed(p.out, encode_ack(77, 0) + encode_ack(6, 0))  # never sent here; rail 1's part
    assert p.out.completions == [] and q.out.completions == []
    feed(p.out, encode_ack(5, 0) + encode_ack(5, 0, BadRequest("late")))  # twice
    assert p.out.completions == [(mine, None)] and not p.out.closed
    feed(q.out, encode_ack(6, 0))
    assert q.out.completions == [(theirs, None)]


@pytest.mark.parametrize("n", [4096, 4097])
def test_ack_error_text_of_the_maximum_and_one_more(n: int) -> None:
    mem, _, p = _setup()
    r = mem.region(1 << 16)
    token = object()
    p.out.write(token, 5, 0, r.rkeys[0], [r.ptr], [4], [memoryview(b"abcd")], 1)
    drain(p.out)
    feed(p.out, ACK_HEAD.pack(0x42, 1, n, 0, 5) + b"NOT_FOUND\0" + b"m" * (n - 10))
    if n == 4096:
        assert p.out.completions == [(token, p.out.completions[0][1])] and not p.out.closed
        assert isinstance(p.out.completions[0][1], NotFound)
        assert len(p.out.completions[0][1].message) == 4086
    else:
        assert p.out.closed and isinstance(p.out.error, PeerUnreachable)


# -- a transfer that ended lets go of its parts ---------------------------------------


class _Transfer:
    """A token as a Domain's: ``finished`` once its transfer ended."""

    def __init__(self) -> None:
        self.finished = False


def _silent_pair(high_water: int = 10_000):
    """A pair whose peer reads nothing yet: what the outbound end is given stays in it."""
    mem = HostMemory(1)
    p = link_pair(Landing(mem, 1), identity(1), identity(1))
    p.out.high_water, p.out.low_water = high_water, high_water // 2
    return mem, mem.region(1 << 20), p


def test_a_transfer_that_ends_drops_its_queued_and_waiting_parts_and_their_views() -> None:
    """Its frames not begun and its parts waiting go unsent, at once, with the views of
    its source (a buffer with a view exported cannot be resized, nor a mapping closed);
    another transfer's part on the link goes on and lands."""
    mem, r, p = _silent_pair()
    t, u = _Transfer(), _Transfer()
    src = bytearray(b"T" * 8000 * 3)
    view = memoryview(src)
    for k, token in enumerate([t, t, u, t]):  # T0 queued, T1 queued (paused), U2, T3 wait
        piece = view[k * 8000 % len(src):][:8000] if token is t else memoryview(b"U" * 8000)
        p.out.write(token, 50 + k, 0, r.rkeys[0], [r.ptr + k * 8000], [8000], [piece], 3)
    del piece, view
    assert p.out.state is LinkState.PAUSED and p.out.waiting == 2
    with pytest.raises(BufferError):
        src.extend(b"x")  # held by the link's parts
    t.finished = True  # timed out, say, its peer having read nothing
    p.out.let_go_ended()
    src.extend(b"x")  # no view of it is left
    assert p.out.state is LinkState.READY and p.out.waiting == 0
    p.pump()
    assert p.out.completions == [(u, None)]
    assert bytes(r.data[2 * 8000:3 * 8000]) == b"U" * 8000
    assert r.data[:2 * 8000] == bytes(2 * 8000) and r.data[3 * 8000:4 * 8000] == bytes(8000)
    assert mem.counts[3] == 1  # only U's immediate: nothing of T went


def test_a_transfer_that_ends_with_a_frame_half_sent_cuts_the_link() -> None:
    """The rest of a frame begun cannot be taken back from the stream: the link is cut
    (PEER_UNREACHABLE for the others on it, which another rail may take), nothing more
    of it goes, and its views go with the link's output."""
    mem, r, p = _silent_pair(high_water=1 << 20)
    t, u = _Transfer(), _Transfer()
    src = bytearray(b"T" * 64 * 1024)
    p.out.write(t, 60, 0, r.rkeys[0], [r.ptr], [len(src)], [memoryview(src)], 3)
    p.out.write(u, 61, 0, r.rkeys[0], [r.ptr + len(src)], [8], [memoryview(b"U" * 8)], 3)
    sent = drain(p.out, limit=4096)  # the peer took 4 KiB of T's frame, then nothing
    t.finished = True
    p.out.let_go_ended()
    assert p.out.closed and isinstance(p.out.error, PeerUnreachable)
    assert "half sent" in p.out.error.message
    assert p.out.out.queued == 0 and drain(p.out) == b""
    assert [(tok, type(e)) for tok, e in p.out.completions] == [(u, PeerUnreachable)]
    src.extend(b"x")  # no view of it is left
    feed(p.inb, sent)
    assert mem.counts[3] == 0


def test_a_read_whose_transfer_ended_before_it_went_is_never_asked() -> None:
    """A READ still queued when its transfer ended is not sent; the views its answer was
    to land in go; the link serves on."""
    _, r, p = _silent_pair(high_water=100)
    t = _Transfer()
    p.out.write(_Transfer(), 70, 0, r.rkeys[0], [r.ptr], [4096],
                [memoryview(b"w" * 4096)], None)  # paused behind it ...
    into = bytearray(4096)
    p.out.read(t, 71, 0, r.rkeys[0], [r.ptr], [4096], [memoryview(into)])
    assert p.out.waiting == 1
    t.finished = True
    p.out.let_go_ended()
    into.extend(b"x")  # not held
    p.pump()
    assert p.out.waiting == 0 and not p.out.closed and not p.out._reads
    assert [e for _, e in p.out.completions] == [None]  # the write's, only


def test_a_frame_of_an_ended_transfer_never_goes_even_before_the_links_pass() -> None:
    """Between a transfer's end and the link's pass (a turn later), what the socket is
    offered leaves out its frames not begun: none of it is sent."""
    mem, r, p = _silent_pair(high_water=1 << 20)
    t, u = _Transfer(), _Transfer()
    p.out.write(t, 80, 0, r.rkeys[0], [r.ptr], [4096], [memoryview(b"T" * 4096)], 3)
    p.out.write(u, 81, 0, r.rkeys[0], [r.ptr + 4096], [4096], [memoryview(b"U" * 4096)], 4)
    t.finished = True
    p.pump()
    assert p.out.completions == [(u, None)] and mem.counts[3] == 0 and mem.counts[4] == 1
    assert r.data[:4096] == bytes(4096)
    assert p.out.in_flight == 1  # T's, owed nothing: forgotten by the pass
    p.out.let_go_ended()
    assert p.out.in_flight == 0 and not p.out.closed
