"""The queue pair set-up two daemons exchange, as value types with a byte form.

The article's ConnectX Domain exchanges RC set-up over a UD queue pair per Domain.
transferd carries it in the authenticated peer handshake over TCP instead (a choice,
docs/rdma.md): the peer has already proven the cluster secret on that connection, so
the QPN, PSN and GID it hands over belong to a peer we know, and no unauthenticated
UD endpoint is left listening on the fabric.  RC queue pairs connected this way accept
traffic only from the one remote queue pair they were connected to.

Each rail's handshake carries one :class:`RailSetup`: the two queue pairs this side
created for that peer (send/recv and write, see ``domain.py`` for why two), and the
limits the other side must respect.  The byte form is fixed-layout little endian with
a magic and a version; every field is range checked on the way in.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from transferd.protocol.errors import BadRequest

# ibv_mtu: 1 = 256, 2 = 512, 3 = 1024, 4 = 2048, 5 = 4096 bytes.
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_U24 = (1 << 24) - 1

_QP = struct.Struct("<IIHB16sBB")  # qpn, psn, lid, port, gid, gid_index, mtu
_HEAD = struct.Struct("<4sBBBBQIHHII")  # magic, version, rail, rails, read_depth, node,
# group, recv_depth, write_depth, recv_len, max_msg
MAGIC = b"TDVQ"
VERSION = 2  # 2: read_depth (RDMA READ), in what was a pad byte


@dataclass(frozen=True, slots=True)
class QpInfo:
    """What the other side needs to connect its RC queue pair to ours."""

    qpn: int
    psn: int
    lid: int
    port: int
    gid: bytes  # 16 bytes, network order, as ibv_gid.raw
    gid_index: int
    mtu: int  # ibv_mtu enum of our port's active MTU

    def __post_init__(self) -> None:
        if not (0 < self.qpn <= _U24 and 0 <= self.psn <= _U24):
            raise BadRequest(f"queue pair number {self.qpn} or PSN {self.psn} is not 24-bit")
        if not 0 <= self.lid <= 0xFFFF or not 1 <= self.port <= 255:
            raise BadRequest(f"LID {self.lid} or port {self.port} out of range")
        if len(self.gid) != 16 or not 0 <= self.gid_index <= 255:
            raise BadRequest("GID must be 16 bytes, its index 0-255")
        if self.mtu not in MTU_BYTES:
            raise BadRequest(f"MTU enum {self.mtu} is not an ibv_mtu (1-5)")

    def to_bytes(self) -> bytes:
        return _QP.pack(self.qpn, self.psn, self.lid, self.port, self.gid, self.gid_index,
                        self.mtu)

    @classmethod
    def from_bytes(cls, raw: bytes) -> QpInfo:
        if len(raw) != _QP.size:
            raise BadRequest(f"queue pair info is {len(raw)} bytes, expected {_QP.size}")
        return cls(*_QP.unpack(raw))

    @property
    def gid_text(self) -> str:
        """The 8-word form pyverbs' GID takes: 'fe80:0000:...:0001'."""
        h = self.gid.hex()
        return ":".join(h[i : i + 4] for i in range(0, 32, 4))

    @staticmethod
    def gid_from_text(text: str) -> bytes:
        words = text.split(":")
        if len(words) != 8 or not all(len(w) == 4 for w in words):
            raise BadRequest(f"GID {text!r} is not in the 8-word form")
        try:
            return bytes.fromhex("".join(words))
        except ValueError:
            raise BadRequest(f"GID {text!r} is not hexadecimal") from None


@dataclass(frozen=True, slots=True)
class RailSetup:
    """One rail's side of the exchange: our two queue pairs for this peer, our limits."""

    node: int
    group: int
    rail: int
    rails: int
    send_qp: QpInfo  # SEND/RECV (two-sided messages)
    write_qp: QpInfo  # RDMA WRITE and WRITE_WITH_IMM (one-sided)
    recv_depth: int  # receives posted on send_qp: the sender keeps this many in flight
    write_depth: int  # receives posted on write_qp: one per WRITE_WITH_IMM in flight
    recv_len: int  # size of each receive buffer: the largest SEND we take
    max_msg: int  # the port's max_msg_sz: the largest single WR we take
    # READs our write queue pair serves at once (its max_dest_rd_atomic): the peer keeps
    # at most this many in flight towards it (its max_rd_atomic and read window).
    read_depth: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rail < self.rails <= 4:
            raise BadRequest(f"rail {self.rail} of {self.rails}: a group has 1 to 4 rails")
        if not 0 < self.recv_depth <= 0xFFFF or not 0 < self.write_depth <= 0xFFFF:
            raise BadRequest("receive depths must be 1-65535")
        if not 64 <= self.recv_len <= 1 << 30 or not 4096 <= self.max_msg <= 1 << 31:
            raise BadRequest(f"receive length {self.recv_len} or max message "
                             f"{self.max_msg} out of range")
        if not 1 <= self.read_depth <= 255:
            raise BadRequest(f"read depth {self.read_depth}: 1-255")
        if not 0 <= self.node < 1 << 64 or not 0 <= self.group < 1 << 32:
            raise BadRequest("node is 64-bit, group 32-bit")

    def to_bytes(self) -> bytes:
        head = _HEAD.pack(MAGIC, VERSION, self.rail, self.rails, self.read_depth, self.node,
                          self.group, self.recv_depth, self.write_depth, self.recv_len,
                          self.max_msg)
        return head + self.send_qp.to_bytes() + self.write_qp.to_bytes()

    @classmethod
    def from_bytes(cls, raw: bytes) -> RailSetup:
        want = _HEAD.size + 2 * _QP.size
        if not isinstance(raw, bytes | bytearray | memoryview) or len(raw) != want:
            raise BadRequest(f"verbs rail set-up must be {want} bytes")
        raw = bytes(raw)
        (magic, version, rail, rails, reads, node, group, rd, wd, rlen,
         mmsg) = _HEAD.unpack_from(raw)
        if magic != MAGIC:
            raise BadRequest("verbs rail set-up: bad magic")
        if version != VERSION:
            raise BadRequest(f"verbs rail set-up version {version}, this daemon speaks "
                             f"{VERSION}")
        send = QpInfo.from_bytes(raw[_HEAD.size : _HEAD.size + _QP.size])
        write = QpInfo.from_bytes(raw[_HEAD.size + _QP.size :])
        return cls(node, group, rail, rails, send, write, rd, wd, rlen, mmsg, reads)


def path_mtu(a: QpInfo, b: QpInfo) -> int:
    """Both ends use the smaller of the two ports' active MTUs."""
    return min(a.mtu, b.mtu)


def check_pair(mine: RailSetup, theirs: RailSetup) -> None:
    """Refuse a peer whose rail set-up cannot work with ours, naming the mismatch."""
    if theirs.rails != mine.rails:
        raise BadRequest(
            f"rail count mismatch: this daemon has {mine.rails} rail(s), the peer "
            f"{theirs.rails}; every peer must have the same number of NICs")
    if theirs.rail != mine.rail:
        raise BadRequest(f"the peer's rail {theirs.rail} answered on our rail {mine.rail}")
    for qp in (theirs.send_qp, theirs.write_qp):
        if qp.lid == 0 and not any(qp.gid):
            raise BadRequest(f"the peer's queue pair {qp.qpn} has neither a LID nor a GID: "
                             "it cannot be reached")


_CHAN = struct.Struct("<4sBxHI")  # magic, version, recv_depth, slot_len
CHANNEL_MAGIC = b"TDVC"
# 2: every message a SEND_WITH_IMM returning credits (transferd.rdma.credits).
CHANNEL_VERSION = 2


@dataclass(frozen=True, slots=True)
class ChannelSetup:
    """One side of an rdma:// connection's set-up (over TCP at HOST:PORT): its queue
    pair, how many receives it posts, and how large each is (the largest message the
    other side may send it: the server's is its max_message)."""

    qp: QpInfo
    recv_depth: int
    slot_len: int

    def __post_init__(self) -> None:
        if not 2 <= self.recv_depth <= 4096:  # credits keep one for a credit return
            raise BadRequest(f"rdma:// receive depth {self.recv_depth} is not 2-4096")
        if not 4096 <= self.slot_len <= 64 << 20:
            raise BadRequest(f"rdma:// message size {self.slot_len} is not 4 KiB-64 MiB")

    SIZE = _CHAN.size + _QP.size

    def to_bytes(self) -> bytes:
        return _CHAN.pack(CHANNEL_MAGIC, CHANNEL_VERSION, self.recv_depth,
                          self.slot_len) + self.qp.to_bytes()

    @classmethod
    def from_bytes(cls, raw: bytes) -> ChannelSetup:
        if len(raw) != cls.SIZE:
            raise BadRequest(f"rdma:// set-up must be {cls.SIZE} bytes, got {len(raw)}")
        magic, version, depth, slot = _CHAN.unpack_from(raw)
        if magic != CHANNEL_MAGIC:
            raise BadRequest("rdma:// set-up: bad magic (is this an rdma:// listener?)")
        if version != CHANNEL_VERSION:
            raise BadRequest(f"rdma:// set-up version {version}, this side speaks "
                             f"{CHANNEL_VERSION} (credit flow control: docs/rdma.md)")
        return cls(QpInfo.from_bytes(raw[_CHAN.size :]), depth, slot)
