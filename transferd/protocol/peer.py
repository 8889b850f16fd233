"""The peer plane: daemon-to-daemon frames, one connection per rail per peer.

A link starts with the handshake of :mod:`transferd.protocol.peer_handshake` (HELLO,
AUTH, PROBE): the client protocol's 24-byte header and msgpack bodies, with command
ids 0x40-0x4F that never appear on a client connection.  Once it is done the link
speaks the data phase of :mod:`transferd.protocol.peer_wire` (WRITE, ACK, SEND, and a
Domain's SETUP: fixed little-endian headers, no msgpack), driven by the sans-IO link
of :mod:`transferd.protocol.peer_link`.  The command ids are shared by both.
"""

from __future__ import annotations

import enum


class PeerCommand(enum.IntEnum):
    HELLO = 0x40
    WRITE = 0x41
    ACK = 0x42
    SEND = 0x43
    AUTH = 0x44
    # Sent on a connection of its own to the initiator's rail listener by a
    # responder without a cluster secret: only a daemon listening at the address
    # it claims can answer it (see peer_handshake).
    PROBE = 0x45
    # The data phase's SETUP (a Domain's own set-up after the handshake: verbs).
    SETUP = 0x4E
