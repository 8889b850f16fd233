"""A SEND's trace id on the sans-IO peer link, and the responder's READs in flight
(issue 20; tests/peerlink.py, in memory).

A SEND carries its trace id in an extension block (TX_EXT) only to a responder whose
HELLO reply names ``send-ext``; without a trace id, or to a responder that does not
name it (a daemon from before), the frame is the 24 bytes it always was.  A READ
answered by an InboundLink is listed (:meth:`InboundLink.answering`) until its bytes
are all sent.
"""

from __future__ import annotations

import os
import struct

import pytest

from tests.peerlink import (
    MAX_MESSAGE,
    SECRET,
    HostMemory,
    Pair,
    drain,
    feed,
    frames,
    identity,
    link_pair,
)
from tests.unit.test_peer_reads import Token, complete, pair
from transferd.protocol import trace as tracing
from transferd.protocol.errors import BadFrame, BadRequest
from transferd.protocol.peer_ext import encode_ext
from transferd.protocol.peer_handshake import SEND_EXT, PeerHandshake, Ready, Role
from transferd.protocol.peer_inbound import InboundLink
from transferd.protocol.peer_landing import Landing
from transferd.protocol.peer_link import Deliver, LinkState, Refused
from transferd.protocol.peer_outbound import OutboundLink
from transferd.protocol.peer_wire import (
    ACK_HEAD,
    SEND,
    SEND_HEAD,
    TX_EXT,
    check_send_head,
    encode_send,
    frame_size,
    parse_message,
)

TP = tracing.parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")


def sends(p: Pair, msg: bytes, trace: bytes | None) -> tuple[bytes, Deliver]:
    """One SEND of ``msg`` through ``p``: its frame's bytes and the Deliver it made."""
    tok = Token()
    p.out.send(tok, 9, 0, msg, trace)
    wire = drain(p.out)
    feed(p.inb, wire)
    (ev,) = [e for e in p.inb.events if isinstance(e, Deliver)]
    p.inb.events.clear()
    return wire, ev


def test_the_frame_without_a_trace_is_the_one_of_before_and_with_one_exactly() -> None:
    assert encode_send(9, 2, 5) == SEND_HEAD.pack(SEND, 0, 0, 2, 9, 5)
    ext = encode_ext(None, TP)
    framed = encode_send(9, 2, 5, ext)
    # cmd 0x43, flags TX_EXT, ext 28 (u16), part, op, payload; then kind 0x02, len 26
    # and the traceparent's 26 bytes; then the message.
    assert framed == (bytes([0x43, 0x01, 28, 0]) + struct.pack("<IQQ", 2, 9, 5)
                      + bytes([0x02, 26]) + TP)
    assert len(framed) == 24 + 28 and frame_size(framed + b"hello") == 24 + 28 + 5
    with pytest.raises(BadFrame, match="unknown flag"):
        check_send_head(0x02, 0)
    with pytest.raises(BadFrame, match="without TX_EXT"):
        check_send_head(0, 28)
    with pytest.raises(BadFrame, match="at most"):
        check_send_head(TX_EXT, 4097)
    # A message transport's SEND (a verbs rail's) is one whole frame, its block read too.
    cmd, op, part, payload, err, trace = parse_message(framed + b"hello")
    assert (cmd, op, part, bytes(payload or b""), err, trace) == (SEND, 9, 2, b"hello", None, TP)
    cmd, op, part, payload, err, trace = parse_message(encode_send(9, 2, 5) + b"hello")
    assert (bytes(payload or b""), err, trace) == (b"hello", None, None)
    for cut in (framed + b"hell", framed + b"hello!", framed[:30]):
        with pytest.raises(BadFrame):  # not exactly one frame
            parse_message(cut)
    with pytest.raises(BadFrame, match="unknown flag"):
        parse_message(bytes([0x43, 0x03]) + framed[2:] + b"hello")
    # A block framed but wrong (a CRC32C entry): that message refused, nothing delivered.
    crc = encode_ext(7, None)
    cmd, op, part, payload, err, trace = parse_message(encode_send(9, 2, 5, crc) + b"hello")
    assert cmd == SEND and payload is None and trace is None
    assert isinstance(err, BadRequest) and "CRC32C" in err.message


def test_a_traced_send_reaches_the_receiver_and_an_untraced_one_is_unchanged() -> None:
    p = link_pair(Landing(HostMemory(1), 1), identity(1), identity(1))
    assert SEND_EXT in p.out.hs.peer_features
    wire, ev = sends(p, b"hello", TP)
    assert wire[1] == TX_EXT and ev.trace == TP and ev.message == b"hello"
    assert ev.ref == (9, 0)
    wire, ev = sends(p, b"plain", None)
    assert wire == SEND_HEAD.pack(SEND, 0, 0, 0, 9, 5) + b"plain" and ev.trace is None
    # Many back to back, cut anywhere: every message whole, each with its own trace id.
    tok = Token()
    traces = [tracing.parse(f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01")
              if i % 2 else None for i in range(20)]
    for i, t in enumerate(traces):
        p.out.send(tok, 100 + i, 0, bytes([i]) * (i * 37), t)
    feed(p.inb, drain(p.out), chunk=11)
    got = [e for e in p.inb.events if isinstance(e, Deliver)]
    assert [e.trace for e in got] == traces
    assert [e.message for e in got] == [bytes([i]) * (i * 37) for i in range(20)]


def old_responder_pair() -> Pair:
    """A link to a responder whose HELLO reply names no feature (as before issue 20)."""
    me, them = identity(1), identity(1)
    out = OutboundLink(me, 0, SECRET, 0.0, timeout=5.0,
                       expect=(them.node, them.group, them.addrs[0]))
    inb = InboundLink(them, 0, SECRET, 0.0, landing=Landing(HostMemory(1), 1), timeout=5.0,
                      max_message=MAX_MESSAGE)
    inb.hs = PeerHandshake(Role.RESPONDER, them, 0, SECRET, 0.0, timeout=5.0)  # features ()
    out.connected(0.0)
    for _ in range(10):
        feed(inb, drain(out))
        feed(out, drain(inb))
        if out.authenticated and inb.authenticated:
            break
    assert any(isinstance(e, Ready) for e in out.events)
    out.events.clear()
    inb.events.clear()
    out.carrier_ready()
    inb.carrier_ready()
    assert out.state is LinkState.READY
    return Pair(out, inb)


def test_to_a_responder_that_does_not_say_send_ext_the_trace_stays_home() -> None:
    p = old_responder_pair()
    assert not p.out.hs.peer_features
    wire, ev = sends(p, b"hello", TP)
    assert wire == SEND_HEAD.pack(SEND, 0, 0, 0, 9, 5) + b"hello"
    assert ev.trace is None and ev.message == b"hello"


def test_a_verbs_responder_says_send_ext_too() -> None:
    """Its messages come whole (parse_message), their blocks read as a stream's are."""
    hs = InboundLink(identity(1), 0, SECRET, 0.0, landing=Landing(HostMemory(1), 1),
                     timeout=5.0, max_message=MAX_MESSAGE, stream_frames=False).hs
    assert hs.features == (SEND_EXT,)


def test_a_malformed_handshake_features_list_is_refused() -> None:
    from transferd.protocol.peer_handshake import _features

    assert _features({}) == frozenset()
    assert _features({"features": ["send-ext", "later"]}) == {"send-ext", "later"}
    for bad in ("send-ext", [1], ["x" * 65], ["a"] * 33):
        with pytest.raises(BadFrame, match="features"):
            _features({"features": bad})


def test_a_send_block_that_is_wrong_refuses_the_message_and_the_link_goes_on() -> None:
    p = link_pair(Landing(HostMemory(1), 1), identity(1), identity(1))
    bad = encode_ext(0x1234, TP)  # a CRC32C entry: a SEND carries none
    feed(p.inb, encode_send(3, 0, 4, bad) + b"oops")
    refused = [e for e in p.inb.events if isinstance(e, Refused)]
    assert len(refused) == 1 and refused[0].what == "message"
    assert isinstance(refused[0].error, BadRequest) and refused[0].trace is None
    assert not [e for e in p.inb.events if isinstance(e, Deliver)]
    (ack,) = frames(drain(p.inb))
    assert ACK_HEAD.unpack_from(ack)[1] == 1 and b"CRC32C" in ack
    p.inb.events.clear()
    # The framing held: the next SEND is delivered with its trace id.
    _, ev = sends(p, b"next", TP)
    assert ev.message == b"next" and ev.trace == TP and p.inb.state is LinkState.READY
    # An unknown flag cannot be framed: the link is cut.
    feed(p.inb, SEND_HEAD.pack(SEND, 0x80, 0, 0, 4, 1) + b"x")
    assert p.inb.closed


def test_a_read_being_answered_is_listed_until_its_bytes_are_sent() -> None:
    n = 1 << 20
    p, _, data = pair(size=n)
    r = p.region  # type: ignore[attr-defined]
    dst = bytearray(n)
    tok = Token()
    p.out.read(tok, 7, 0, r.rkeys[0], [r.ptr], [n], [memoryview(dst)], trace=TP)
    feed(p.inb, drain(p.out), now=5.0)
    (a,) = p.inb.answering()
    assert (a.kind, a.ref, a.received, a.nbytes, a.trace, a.since) == (
        "read", (7, 0), 0, n, TP, 5.0)
    # Part of the answer goes (its 24-byte header, then 1000 bytes of payload).
    feed(p.out, drain(p.inb, limit=24 + 1000))
    (a,) = p.inb.answering()
    assert a.received == 1000
    feed(p.out, drain(p.inb))
    assert p.inb.answering() == []
    complete(p)
    assert tok.error is None and dst == data
    # An untraced read is listed too (no trace id), and so are two back to back.
    toks = [Token(), Token()]
    for i, t in enumerate(toks):
        p.out.read(t, 20 + i, 0, r.rkeys[0], [r.ptr], [4096], [memoryview(dst)[:4096]])
    feed(p.inb, drain(p.out))
    got = p.inb.answering()
    assert [(x.ref, x.received, x.nbytes, x.trace) for x in got] == [
        ((20, 0), 0, 4096, None), ((21, 0), 0, 4096, None)]
    feed(p.out, drain(p.inb, limit=24 + 4096 + 24 + 100))
    assert [(x.ref, x.received) for x in p.inb.answering()] == [((21, 0), 100)]
