"""Peer-plane frames carried whole in one RC SEND: encode into a registered slot, parse
a received slot.

On a verbs rail the send/recv queue pair carries two-sided messages (SEND frames) and
their acknowledgements (ACK frames), in the peer plane's own data-phase frames
(:mod:`transferd.protocol.peer_wire`, the same as a tcp rail's), each one frame in one
message of at most the receiver's ``recv_len`` (announced in the set-up).  A receive
completion holds exactly one message; it is parsed whole from its slot, and a message
that is not exactly one SEND or ACK is BAD_FRAME (the link is broken, not
resynchronised).
"""

from __future__ import annotations

from transferd.copies import COUNTING, count
from transferd.protocol.errors import BadRequest, TransferdError
from transferd.protocol.peer_wire import parse_message

MSG_LEN = 64 * 1024  # one message slot: the largest two-sided frame on a verbs rail


def encode_into(slot: memoryview, head: bytes, payload: bytes | memoryview = b"") -> int:
    """Write one frame (``head`` then ``payload``) into ``slot``; returns its length
    (BadRequest if it does not fit)."""
    n = len(head) + len(payload)
    if n > len(slot):
        raise BadRequest(f"a frame of {n} bytes does not fit one message of {len(slot)} "
                         "bytes on this verbs rail")
    slot[:len(head)] = head
    slot[len(head):n] = payload
    if COUNTING:
        count("verbs.encode", len(payload))
    return n


def parse(message: memoryview) -> tuple[int, int, int, bytes | None, TransferdError | None,
                                        bytes | None]:
    """One whole received message: (cmd, op, part, a SEND's payload copied out of the
    slot, an ACK's error or a SEND's refusal, a SEND's trace id)."""
    cmd, op, part, payload, error, trace = parse_message(message)
    data = None
    if payload is not None:
        data = bytes(payload)
        if COUNTING:
            count("verbs.parse", len(data))
    return cmd, op, part, data, error, trace
