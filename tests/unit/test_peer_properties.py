"""Property tests of the peer plane's sans-IO parts (issue 11, hostile input): the
handshake (both roles, with and without a secret) and the WRITE / ACK / SEND headers.

Any frame a stranger or a lying peer sends, in any order and at any time, ends in the
handshake's events or a typed :class:`TransferdError` after which the end is CLOSED;
any body of a WRITE, ACK or SEND parses into a header whose every field is in range,
or is BAD_REQUEST.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hostile import EDGE_INTS, U32, U64, bodies, values
from transferd.protocol.constants import ErrorCode, Flag
from transferd.protocol.errors import BadRequest, TransferdError
from transferd.protocol.frames import Frame, FrameDecoder
from transferd.protocol.peer import MAX_PAGES_PER_FRAME, PeerCommand, WriteHeader, parse_ref
from transferd.protocol.peer_handshake import (
    MAX_HANDSHAKE_BODY,
    NONCE_LEN,
    TRANSITIONS,
    PeerHandshake,
    PeerIdentity,
    Probe,
    Ready,
    Role,
    State,
    parse_probe,
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
    "v": st.sampled_from([1, 1, 2, True]), "node": st.sampled_from([0xA, 0xB, 0, U64]),
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
    body = {"v": 1, "node": B.node, "group": B.group, "rail": 5, "addrs": list(B.addrs),
            "challenge": b"c" * NONCE_LEN, "proof": b"p" * 32}
    with pytest.raises(TransferdError) as info:
        ini.receive(Frame(int(PeerCommand.HELLO), int(Flag.REPLY), 0, body), 0.0)
    assert info.value.code is ErrorCode.BAD_FRAME and "'rail' 5" in info.value.message
    assert ini.state is State.CLOSED


# -- WRITE, ACK and SEND headers ------------------------------------------------------------

page_ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(0, 1 << 20))
write_bodies = bodies({
    "op": page_ints, "part": page_ints, "rkey": page_ints,
    "addrs": st.lists(page_ints, max_size=4), "lens": st.lists(page_ints, max_size=4),
    "imm": st.one_of(st.none(), page_ints),
    "span": st.one_of(st.none(), st.lists(page_ints, min_size=2, max_size=2),
                      st.lists(page_ints, max_size=3)),
}, optional=frozenset({"imm", "span"}))


@SETTINGS
@given(write_bodies)
def test_any_write_body_parses_in_range_or_is_bad_request(body: dict[str, Any]) -> None:
    try:
        h = WriteHeader.parse(body)
    except BadRequest as exc:
        assert exc.message.startswith("peer ")
        return
    assert 0 <= h.op <= U64 and 0 <= h.part <= U32 and 0 <= h.rkey <= U64
    assert len(h.addrs) == len(h.lens) <= MAX_PAGES_PER_FRAME
    assert all(type(v) is int and 0 <= v <= U64 for v in (*h.addrs, *h.lens))
    assert h.imm is None or 0 <= h.imm <= U32
    if h.span is not None:
        a, n = h.addrs[0], h.lens[0]
        assert h.span[0] <= a and a + n <= h.span[0] + h.span[1]
    assert WriteHeader.parse(h.to_body()) == h  # what it parsed is what it would send


@SETTINGS
@given(st.one_of(bodies({"op": page_ints, "part": page_ints, "ok": values}),
                 st.dictionaries(st.text(max_size=4), values, max_size=3)))
def test_any_ack_or_send_body_names_an_op_or_is_bad_request(body: dict[str, Any]) -> None:
    try:
        op, part = parse_ref(body)
    except BadRequest:
        return
    assert type(op) is int and 0 <= op <= U64 and type(part) is int and 0 <= part <= U32


@pytest.mark.parametrize("n", [MAX_PAGES_PER_FRAME, MAX_PAGES_PER_FRAME + 1])
def test_page_lists_at_the_frame_cap(n: int) -> None:
    body = {"op": 1, "part": 0, "rkey": 1, "addrs": list(range(n)), "lens": [1] * n}
    if n > MAX_PAGES_PER_FRAME:
        with pytest.raises(BadRequest):
            WriteHeader.parse(body)
    else:
        assert len(WriteHeader.parse(body).addrs) == n
