"""Peer-plane frames carried whole in one RC SEND: encode into a registered slot, parse
a received slot.

On a verbs rail the send/recv queue pair carries two-sided messages (SEND frames) and
their acknowledgements (ACK frames), each one frame in one message, at most the
receiver's ``recv_len`` (announced in the set-up).  A receive completion holds exactly
one message; it is parsed whole from its slot, and a message whose length is not the
frame its header announces is BAD_FRAME (the link is broken, not resynchronised).
"""

from __future__ import annotations

from transferd.copies import COUNTING, count
from transferd.protocol import frames
from transferd.protocol.constants import HEADER_SIZE
from transferd.protocol.errors import BadFrame, BadRequest
from transferd.protocol.frames import Frame


def encode_into(slot: memoryview, cmd: int, body: dict[str, object],
                payload: bytes | memoryview = b"") -> int:
    """Write one frame into ``slot``; returns its length (BadRequest if it does not fit)."""
    raw = frames.pack_body(body)
    n = HEADER_SIZE + len(raw) + len(payload)
    if n > len(slot):
        raise BadRequest(f"a frame of {n} bytes does not fit one message of {len(slot)} "
                         "bytes on this verbs rail")
    slot[:HEADER_SIZE] = frames.encode_header(cmd, 0, 0, len(raw), len(payload))
    slot[HEADER_SIZE : HEADER_SIZE + len(raw)] = raw
    slot[HEADER_SIZE + len(raw) : n] = payload
    if COUNTING:
        count("verbs.encode", len(payload))
    return n


def parse(message: memoryview, max_body: int = 4096) -> Frame:
    """One whole received message as a frame, its payload copied out of the slot."""
    n = len(message)
    if n < HEADER_SIZE:
        raise BadFrame(f"message of {n} bytes is shorter than a frame header")
    h = frames.decode_header(message)
    frames.check_header(h, max_body, n)
    if HEADER_SIZE + h.body_len + h.payload_len != n:
        raise BadFrame(f"message of {n} bytes holds a frame of "
                       f"{HEADER_SIZE + h.body_len + h.payload_len}")
    body = frames.unpack_body(message[HEADER_SIZE : HEADER_SIZE + h.body_len], h.seq)
    f = Frame(h.cmd, h.flags, h.seq, body, h.payload_len, h.body_len)
    if h.payload_len:
        f.payload = bytearray(message[HEADER_SIZE + h.body_len :])
        if COUNTING:
            count("verbs.parse", h.payload_len)
    return f
