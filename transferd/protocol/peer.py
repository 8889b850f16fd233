"""The peer plane: daemon-to-daemon frames, one connection per rail per peer.

Same 24-byte header and msgpack bodies as the client protocol; the command
ids (0x40-0x4F) never appear on a client connection.

WRITE   body {op, part, parts, rkey, addrs: [addr, ...], lens: [len, ...],
              imm (absent = none), count}   payload: the bytes, concatenated
        ``count`` is what this frame adds to ``imm`` once all its bytes are in
        place; for a single write split over rails it is 1 on every part and
        the receiver adds it once, when the last of ``parts`` parts landed.
ACK     body {op, part, ok: true} or {op, part, code, message}
SEND    body {op}  payload: the message (two-sided)
HELLO   body {node, group, rail, rails}  both ways, first frame of a link
"""

from __future__ import annotations

import enum


class PeerCommand(enum.IntEnum):
    HELLO = 0x40
    WRITE = 0x41
    ACK = 0x42
    SEND = 0x43
