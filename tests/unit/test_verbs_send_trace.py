"""A verbs rail's two-sided messages and their trace ids, without a NIC.

On a verbs rail a SEND travels whole in one RC SEND (a registered slot of MSG_LEN
bytes): the sender puts the TX_EXT block in it when the responder said ``send-ext``
and the block fits; the receiver's link reads the slot with ``messages.parse`` and
hands the message and its trace id on, or refuses that one message (an ACK with the
error) when its block is framed but wrong. The queue pairs are the one part stood in
for (no device here): what the link gives its queue pair is recorded.
"""

from __future__ import annotations

import asyncio
from typing import Any

from transferd.domains.verbs import messages
from transferd.domains.verbs.links import InLink, OutLink
from transferd.domains.verbs.messages import MSG_LEN
from transferd.parts import SendPart
from transferd.protocol.errors import BadRequest, TransferdError
from transferd.protocol.peer_ext import encode_ext
from transferd.protocol.peer_handshake import SEND_EXT
from transferd.protocol.peer_wire import ACK, SEND, TX_EXT, ack_error, encode_send

TP = bytes.fromhex("00" + "4bf92f3577b34da6a3ce929d0e0e4736" + "00f067aa0ba902b7" + "01")


class Slot:
    """A queue pair's send side as the link sees it: each frame copied into a slot."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self._slot = memoryview(bytearray(MSG_LEN))

    def send_frame(self, head: bytes, payload: Any, on_done: Any) -> None:
        n = messages.encode_into(self._slot, head, payload)
        self.frames.append(bytes(self._slot[:n]))


class Transfer:
    finished = False

    def __init__(self) -> None:
        self.failed: TransferdError | None = None

    def fail(self, err: TransferdError) -> None:
        self.failed = err


def out_link(features: frozenset[str]) -> OutLink:
    link = object.__new__(OutLink)
    link.send, link.write = Slot(), object()  # type: ignore[assignment]
    link._pending = {}
    hs = type("Hs", (), {"peer_features": features})()
    link.core = type("Core", (), {"hs": hs})()  # type: ignore[assignment]
    return link


def sent(link: OutLink, msg: bytes, trace: bytes | None) -> bytes:
    t = Transfer()
    link._send(SendPart(0, None, msg, 7, trace=trace), t)  # type: ignore[arg-type]
    assert t.failed is None
    return link.send.frames[-1]  # type: ignore[union-attr]


def test_a_traced_send_carries_its_block_to_a_responder_that_reads_it() -> None:
    link = out_link(frozenset({SEND_EXT}))
    frame = sent(link, b"hello", TP)
    assert frame == encode_send(7, 0, 5, encode_ext(None, TP)) + b"hello"
    assert frame[1] == TX_EXT
    assert messages.parse(memoryview(frame)) == (SEND, 7, 0, b"hello", None, TP)
    assert sent(link, b"plain", None) == encode_send(7, 0, 5) + b"plain"


def test_the_trace_stays_home_where_it_is_not_read_or_does_not_fit() -> None:
    assert sent(out_link(frozenset()), b"hello", TP) == encode_send(7, 0, 5) + b"hello"
    # A message that fits its slot only without the block goes without it, not refused.
    big = bytes(MSG_LEN - 24)
    frame = sent(out_link(frozenset({SEND_EXT})), big, TP)
    assert frame == encode_send(7, 0, len(big)) + big


class Port:
    def __init__(self) -> None:
        self.delivered: list[tuple[Any, ...]] = []

    def deliver(self, peer: Any, msg: bytes, ack: Any, source: Any, *,
                trace: bytes | None = None, op: int = 0) -> None:
        self.delivered.append((peer, msg, trace, op))


def in_link(loop: asyncio.AbstractEventLoop) -> InLink:
    link = object.__new__(InLink)
    link.peer = (5, 0)
    link.send = Slot()  # type: ignore[assignment]
    link.io = None
    link._closed = False
    link.domain = type("D", (), {"port": Port(), "loop": loop, "rail": 0})()  # type: ignore[assignment]
    return link


def test_a_received_slot_hands_on_the_message_and_its_trace_or_refuses_it() -> None:
    loop = asyncio.new_event_loop()
    try:
        link = in_link(loop)
        port = link.domain.port
        traced = encode_send(9, 0, 5, encode_ext(None, TP)) + b"hello"
        link.on_message(messages.parse(memoryview(traced)))
        link.on_message(messages.parse(memoryview(encode_send(10, 0, 5) + b"plain")))
        assert port.delivered == [((5, 0), b"hello", TP, 9), ((5, 0), b"plain", None, 10)]
        # A block framed but wrong: that message is not delivered, its sender is told.
        wrong = encode_send(11, 0, 5, encode_ext(123, None)) + b"nope!"
        link.on_message(messages.parse(memoryview(wrong)))
        assert len(port.delivered) == 2 and not link._closed
        ack = link.send.frames[-1]  # type: ignore[union-attr]
        assert ack[0] == ACK and ack[1] == 1
        err = ack_error(1, ack[16:])
        assert isinstance(err, BadRequest) and "CRC32C" in err.message
    finally:
        loop.close()
