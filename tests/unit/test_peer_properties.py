"""Property tests of the peer plane's sans-IO parts (issue 11, hostile input): the
handshake (both roles, with and without a secret) and the data phase's frames.

Any frame a stranger or a lying peer sends, in any order and at any time, ends in the
handshake's events or a typed :class:`TransferdError` after which the end is CLOSED;
any WRITE header parses into one whose every field is in range and that encodes back
to the same bytes, or is BAD_REQUEST (framed) or BAD_FRAME (not); any bytes after an
authenticated handshake end in ACKs or a closed link, with nothing left admitted and
no count but the pages that landed.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hostile import EDGE_INTS, U32, U64, bodies
from tests.peerlink import HostMemory, Pair, feed, identity, link_pair
from transferd.protocol.constants import ErrorCode, Flag
from transferd.protocol.errors import BadFrame, BadRequest, TransferdError
from transferd.protocol.frames import Frame, FrameDecoder
from transferd.protocol.peer import PeerCommand
from transferd.protocol.peer_handshake import (
    MAX_HANDSHAKE_BODY,
    NONCE_LEN,
    TRANSITIONS,
    VERSION,
    PeerHandshake,
    PeerIdentity,
    Probe,
    Ready,
    Role,
    State,
    parse_probe,
)
from transferd.protocol.peer_landing import Landing
from transferd.protocol.peer_wire import (
    KNOWN_FLAGS,
    MAX_PAGES,
    WRITE_HEAD,
    check_write_head,
    encode_ack,
    encode_send,
    encode_write,
    frame_size,
    parse_write,
)

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CODES = {c.value for c in ErrorCode}
SECRET = b"the cluster secret"
A = PeerIdentity(0xA, 0, (b"127.0.0.2:1000", b"127.0.0.3:1001"))
B = PeerIdentity(0xB, 0, (b"127.0.0.4:2000", b"127.0.0.5:2001"))
REACHABLE = {State.START, State.AWAIT_HELLO} | set(TRANSITIONS.values())


def counter_random() -> Any:
    n = itertools.count(1)
    return lambda k: next(n).to_bytes(k, "big")


addrs = st.lists(st.sampled_from([*A.addrs, *B.addrs, b"x" * 300, b""]), max_size=3)
handshake_bodies = bodies({
    "v": st.sampled_from([VERSION, VERSION, 1, True]), "node": st.sampled_from([0xA, 0xB, 0, U64]),
    "group": st.sampled_from([0, 1, 0x10000]), "rail": st.sampled_from([0, 1, 2, 15, 16]),
    "addrs": st.one_of(st.just(list(A.addrs)), st.just(list(B.addrs)), addrs),
    "nonce": st.binary(min_size=31, max_size=33), "auth": st.sampled_from(["hmac-sha256", "x"]),
    "challenge": st.binary(min_size=32, max_size=32), "proof": st.binary(min_size=32,
                                                                      max_size=32),
    "mac": st.binary(min_size=32, max_size=32), "token": st.binary(min_size=32, max_size=32),
    "code": st.sampled_from(sorted(CODES)), "message": st.text(max_size=6),
}, optional=frozenset({"auth", "challenge", "proof", "mac", "token", "code", "message"}))

peer_frames = st.builds(
    Frame,
    cmd=st.sampled_from([int(c) for c in PeerCommand] + [0x00, 0x3F, 0xFF]),
    flags=st.sampled_from([0, 0, int(Flag.REPLY), int(Flag.REPLY | Flag.ERROR), 4, 8]),
    seq=st.integers(0, U32),
    body=handshake_bodies,
    payload_len=st.sampled_from([0, 0, 0, 1]),
)


@st.composite
def steps(draw: st.DrawFn) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["frame", "frame", "frame", "probe", "tick"]))
        if kind == "frame":
            out.append((kind, draw(peer_frames)))
        elif kind == "probe":
            out.append((kind, draw(st.binary(min_size=30, max_size=33))))
        else:
            out.append((kind, draw(st.floats(0, 10))))
    return out


def check_output(h: PeerHandshake) -> None:
    """What this end writes: at most a handshake body, no payload, errors with a code."""
    dec = FrameDecoder(max_body=MAX_HANDSHAKE_BODY, max_payload=0)
    for f in dec.feed(h.data_to_send()):
        if f.flags & int(Flag.ERROR):  # a refusal answers the frame it refuses
            assert f.body.get("code") in CODES and f.flags & int(Flag.REPLY)
        else:
            assert f.cmd in (PeerCommand.HELLO, PeerCommand.AUTH), f


@SETTINGS
@given(st.sampled_from(list(Role)), st.sampled_from([None, SECRET]), st.sampled_from([0, 1]),
       steps())
def test_any_frames_in_any_order_at_any_time(role: Role, secret: bytes | None, rail: int,
                                             plan: list[tuple[str, Any]]) -> None:
    me, other = (A, B) if role is Role.INITIATOR else (B, A)
    expect = (other.node, other.group, other.addrs[rail]) if role is Role.INITIATOR else None
    h = PeerHandshake(role, me, rail, secret, 0.0, expect=expect, random=counter_random())
    if role is Role.INITIATOR:
        h.start()
    readies = 0
    now = 0.0
    for kind, arg in plan:
        before = h.state
        try:
            if kind == "frame":
                h.receive(arg, now)
            elif kind == "probe":
                h.probe(arg, now)
            else:
                now = max(now, arg)
                h.tick(now)
        except TransferdError as exc:
            assert exc.code.value in CODES
            assert h.state is State.CLOSED and h.error is not None
        else:
            assert h.state in REACHABLE
            if before is not h.state and h.state is not State.CLOSED:
                assert TRANSITIONS.get((role, before, _any_input(role, before, h.state)))
        for ev in h.events():
            assert isinstance(ev, Ready | Probe)
            if isinstance(ev, Ready):
                readies += 1
                assert h.state is State.READY and ev.peer == h.peer
            else:
                assert role is Role.RESPONDER and secret is None
        check_output(h)
    assert readies <= 1


def _any_input(role: Role, before: State, after: State) -> Any:
    """Some input the table allows from ``before`` to ``after`` (None if none)."""
    for (r, s, inp), nxt in TRANSITIONS.items():
        if r is role and s is before and nxt is after:
            return inp
    return None


@SETTINGS
@given(st.sampled_from([None, SECRET]), st.integers(0, 1), st.lists(st.integers(0, 2),
                                                                    max_size=6))
def test_two_real_ends_with_frames_lost_or_repeated(secret: bytes | None, rail: int,
                                                    plan: list[int]) -> None:
    """Two real ends whose frames are delivered, dropped or repeated: both READY with each
    other's identity, or a typed error; probes are delivered as the I/O layer would."""
    ini = PeerHandshake(Role.INITIATOR, A, rail, secret, 0.0,
                        expect=(B.node, B.group, B.addrs[rail]), random=counter_random())
    res = PeerHandshake(Role.RESPONDER, B, rail, secret, 0.0, random=counter_random())
    ini.start()
    dec = lambda: FrameDecoder(max_body=MAX_HANDSHAKE_BODY, max_payload=0)
    for step in [*plan, 0, 0, 0]:
        for src, dst in ((ini, res), (res, ini)):
            moved = dec().feed(src.data_to_send())
            if step == 1:
                moved = []
            elif step == 2:
                moved = moved * 2
            for f in moved:
                try:
                    dst.receive(f, 0.0)
                except TransferdError as exc:
                    assert exc.code.value in CODES and dst.state is State.CLOSED
        for ev in res.events():
            if isinstance(ev, Probe) and ini.state is not State.CLOSED:
                (pf,) = dec().feed(ev.data)
                nonce, token = parse_probe(pf.body)
                assert nonce == ini.nonce and ev.addr == A.addrs[rail]
                try:
                    ini.probe(token, 0.0)
                except TransferdError as exc:
                    assert exc.code.value in CODES
            elif isinstance(ev, Ready):
                assert ev.peer == A
    if ini.state is State.READY:
        assert ini.peer == B
    assert ini.state in REACHABLE and res.state in REACHABLE


def test_a_reply_naming_another_rail_is_refused_typed() -> None:
    """Found by the properties above: a HELLO reply naming a rail this daemon does not
    have (rail 5 of 2) was an IndexError while building the refusal's message; the
    responder indexed the same list for its probe."""
    ini = PeerHandshake(Role.INITIATOR, A, 0, SECRET, 0.0, expect=(B.node, B.group, B.addrs[0]),
                        random=counter_random())
    ini.start()
    body = {"v": VERSION, "node": B.node, "group": B.group, "rail": 5, "addrs": list(B.addrs),
            "challenge": b"c" * NONCE_LEN, "proof": b"p" * 32}
    with pytest.raises(TransferdError) as info:
        ini.receive(Frame(int(PeerCommand.HELLO), int(Flag.REPLY), 0, body), 0.0)
    assert info.value.code is ErrorCode.BAD_FRAME and "'rail' 5" in info.value.message
    assert ini.state is State.CLOSED


# -- the data phase ------------------------------------------------------------------------

page_ints = st.one_of(st.sampled_from([e for e in EDGE_INTS if e >= 0]),
                      st.integers(0, 1 << 20))
table = st.lists(st.tuples(page_ints, page_ints), max_size=4)


@SETTINGS
@given(st.integers(0, 255), table, page_ints, page_ints, page_ints, page_ints,
       st.one_of(st.none(), st.tuples(page_ints, page_ints)), page_ints)
def test_any_write_header_parses_in_range_or_is_refused(
        flags: int, pages: list[tuple[int, int]], op: int, part: int, rkey: int,
        imm: int, span: tuple[int, int] | None, payload: int) -> None:
    n = len(pages)
    raw = bytearray(WRITE_HEAD.pack(0x41, flags & ~0x12, n, part & U32, op & U64, rkey & U64,
                                    imm & U32, 0, op & U64, payload & U64))
    if span is not None:
        raw[1] |= 0x02
        raw += struct.pack("<QQ", *(v & U64 for v in span))
    for a, ln in pages:
        raw += struct.pack("<QQ", a & U64, ln & U64)
    head = WRITE_HEAD.unpack_from(raw)
    try:
        check_write_head(head[1], head[2], head[7])
    except BadFrame:
        assert head[1] & ~KNOWN_FLAGS
        return
    try:
        w = parse_write(raw, 0, head)
    except BadRequest:
        return
    assert 0 <= w.op <= U64 and 0 <= w.part <= U32 and 0 <= w.rkey <= U64
    assert len(w.addrs) == len(w.lens) <= MAX_PAGES and sum(w.lens) == head[9]
    assert all(a + ln <= U64 + 1 for a, ln in zip(w.addrs, w.lens, strict=True))
    assert w.imm is None or 0 <= w.imm <= U32
    if w.span is not None:
        assert w.span[0] <= w.addrs[0] and w.addrs[0] + w.lens[0] <= w.span[0] + w.span[1]
    again = encode_write(w.op, w.part, w.rkey, w.addrs, w.lens, w.imm, w.span, w.wid, w.again)
    assert parse_write(again, 0, WRITE_HEAD.unpack_from(again)) == w  # as it would send it


def _ready() -> tuple[Pair, HostMemory, Any]:
    mem = HostMemory(1)
    p = link_pair(Landing(mem, 1), identity(1), identity(1))
    return p, mem, mem.region(1 << 16)


@SETTINGS
@given(st.lists(st.one_of(st.binary(max_size=80), st.sampled_from(["write", "send", "ack"])),
                max_size=8))
def test_any_bytes_after_the_handshake_end_in_acks_or_a_closed_link(
        pieces: list[Any]) -> None:
    p, mem, r = _ready()
    wire = bytearray()
    for piece in pieces:  # hostile bytes between well-formed frames
        if piece == "write":
            wire += encode_write(1, 0, r.rkeys[0], [r.ptr + 8], [4], 7) + b"abcd"
        elif piece == "send":
            wire += encode_send(2, 0, 3) + b"msg"
        elif piece == "ack":
            wire += encode_ack(3, 0)
        else:
            wire += piece
    with contextlib.suppress(AssertionError):  # the link stopped reading: a socket holds it
        feed(p.inb, bytes(wire))
    if p.inb.closed:
        assert isinstance(p.inb.error, BadFrame)
    p.inb.close()
    assert r.admitted == 0  # nothing left holding the region
    landed = sum(1 for x in range(8, 12) if r.data[x] != 0)
    assert mem.counts[7] <= sum(1 for x in pieces if x == "write") and (
        mem.counts[7] == 0 or landed)


@SETTINGS
@given(st.binary(max_size=200))
def test_any_bytes_to_an_outbound_link_complete_parts_or_close_it(data: bytes) -> None:
    p, _, _ = _ready()
    p.out.send("token", 9, 0, b"x")
    feed(p.out, data)
    assert p.out.closed or all(t == "token" for t, _ in p.out.completions)
    if p.out.closed:
        assert p.out.error is not None and p.out.error.code is ErrorCode.PEER_UNREACHABLE


@pytest.mark.parametrize("n", [MAX_PAGES, MAX_PAGES + 1])
def test_page_lists_at_the_frame_cap(n: int) -> None:
    raw = encode_write(1, 0, 1, list(range(0, 2 * n, 2)), [1] * n, None)
    if n > MAX_PAGES:
        with pytest.raises(BadFrame):
            frame_size(raw)
    else:
        assert len(parse_write(raw, 0, WRITE_HEAD.unpack_from(raw)).addrs) == n
