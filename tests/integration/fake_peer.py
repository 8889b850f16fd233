"""A peer driven by hand over a blocking socket, for tests of what a daemon refuses.

It runs the real sans-IO handshake (:class:`PeerHandshake`) as an initiator, so it
gets exactly as far as its credentials allow: with the cluster secret (or, without
one, listening at the address it claims) it is a peer, and then sends frames as
badly as a test wants; without, the daemon closes on it.

After the handshake a link speaks the data phase's fixed headers
(:mod:`transferd.protocol.peer_wire`); :meth:`FakePeer.send` takes a WRITE or SEND
as the fields a test names (``{"op", "part", "rkey", "addrs", "lens", "imm", "span",
"wid", "again"}``) and :meth:`FakePeer.recv` gives back the ACK as an :class:`Ack`
whose ``body`` has ``op``, ``part`` and ``ok: True`` or the error's ``code`` and
``message``; :attr:`FakePeer.conn` ``.send_raw`` sends bytes as they are.
"""

from __future__ import annotations

import secrets
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from tests.helpers import RawConn
from transferd.domains.rails import parse_rail, rail_bytes
from transferd.protocol.errors import TransferdError
from transferd.protocol.frames import Frame, FrameDecoder
from transferd.protocol.peer import PeerCommand
from transferd.protocol.peer_handshake import (
    PeerHandshake,
    PeerIdentity,
    Role,
    State,
    node_of,
)
from transferd.protocol.peer_wire import (
    ACK,
    ACK_HEAD,
    IMM,
    SPAN,
    WID,
    WRITE_HEAD,
    ack_error,
    encode_send,
    encode_write,
)
from transferd.protocol.values import NetAddr

STRANGER = "127.0.0.9"


@dataclass
class Ack:
    """A data-phase ACK as a test reads it (``body`` as the old msgpack ACK had it)."""

    cmd: int
    body: dict[str, Any] = field(default_factory=dict)
    is_error: bool = False


def raw_write(body: dict[str, Any], payload: bytes = b"", *, payload_len: int | None = None,
              flags: int = 0, ext: bytes = b"") -> bytes:
    """A WRITE built field by field, as a lying peer would: its page table as given
    (pages of any length), ``payload_len`` for the header's payload field (the pages'
    sum if None), extra ``flags`` bits, an extension block ``ext``."""
    addrs, lens = list(body["addrs"]), list(body["lens"])
    fl = flags | (IMM if body.get("imm") is not None else 0) | \
        (WID if body.get("wid") is not None else 0)
    span = body.get("span")
    head = WRITE_HEAD.pack(0x41, fl | (SPAN if span else 0), len(addrs), body["part"],
                           body["op"], body["rkey"], body.get("imm") or 0, len(ext),
                           body.get("wid") or 0,
                           sum(lens) if payload_len is None else payload_len)
    table = struct.pack("<QQ", *span) if span else b""
    table += b"".join(struct.pack("<QQ", a, n) for a, n in zip(addrs, lens, strict=True))
    return head + table + ext + payload


def data_frame(cmd: int, body: dict[str, Any], payload: bytes = b"") -> bytes:
    """A WRITE or SEND of the data phase from named fields (others are not frame fields:
    a test naming one means it to be ignored, as nothing but pages is counted)."""
    if cmd == PeerCommand.SEND:
        return encode_send(body["op"], body["part"], len(payload)) + payload
    if cmd != PeerCommand.WRITE:
        raise ValueError(f"not a data-phase frame a test sends: 0x{cmd:02x}")
    span = body.get("span")
    return encode_write(body["op"], body["part"], body["rkey"], list(body["addrs"]),
                        list(body["lens"]), body.get("imm"), span,
                        body.get("wid"), bool(body.get("again"))) + payload


class FakePeer:
    """Node ``node`` (random by default) with one listener per rail on ``host``, where
    probes come; ``claim`` replaces the addresses it claims."""

    def __init__(self, dst: NetAddr, rail: int = 0, secret: bytes | None = None, *,
                 node: int | None = None, host: str = STRANGER,
                 claim: tuple[bytes, ...] | None = None, timeout: float = 10.0) -> None:
        self.dst, self.rail, self.timeout = dst, rail, timeout
        self.listeners = []
        for _ in dst.rails:
            s = socket.socket()
            s.bind((host, 0))
            s.listen(4)
            s.settimeout(timeout)
            self.listeners.append(s)
        addrs = claim or tuple(rail_bytes(*s.getsockname()) for s in self.listeners)
        # A fresh id each time: the daemon binds an id to the addresses it came with.
        # Without a secret an id is its addresses' (unless a test claims another).
        if node is None:
            node = secrets.randbits(62) + 1 if secret is not None else node_of((addrs,))
        self.me = PeerIdentity(node, 0, addrs)
        self.conn = RawConn(*parse_rail(dst.rails[rail]), timeout=timeout)
        self.hs = PeerHandshake(Role.INITIATOR, self.me, rail, secret, time.monotonic(),
                                timeout=timeout,
                                expect=(dst.node, dst.group, dst.rails[rail]))

    def handshake(self) -> None:
        """Run the handshake to its end; raises the TransferdError that ended it."""
        hs = self.hs
        hs.start()
        self.conn.send_raw(hs.data_to_send())
        while not hs.done:
            if hs.state is State.AWAIT_PROBE:
                self._take_probe()
            else:
                hs.receive(self.conn.recv(), time.monotonic())
            self.conn.send_raw(hs.data_to_send())

    def _take_probe(self) -> None:
        sock, _ = self.listeners[self.rail].accept()
        with sock:
            sock.settimeout(self.timeout)
            d = FrameDecoder()
            frames: list[Frame] = []
            while not frames:
                data = sock.recv(4096)
                if not data:
                    raise ConnectionError("probe connection closed before a frame")
                frames = d.feed(data)
        (probe,) = frames
        assert probe.cmd == PeerCommand.PROBE
        self.hs.probe(probe.body["token"], time.monotonic())

    def send(self, cmd: int, body: dict[str, Any], payload: bytes = b"") -> None:
        """A frame: a handshake one (before it is done), else a WRITE or SEND."""
        if not self.hs.done:
            self.conn.send(cmd, body, payload)
            return
        self.conn.send_raw(data_frame(cmd, body, payload))

    def recv_acks(self, n: int) -> list[Ack]:
        return [self.recv() for _ in range(n)]

    def recv(self) -> Any:
        """The next frame: a handshake one before it is done, else an ACK."""
        if not self.hs.done:
            return self.conn.recv()
        head = self._read(ACK_HEAD.size)
        cmd, status, mlen, part, op = ACK_HEAD.unpack(head)
        if cmd != ACK:
            raise AssertionError(f"a peer frame 0x{cmd:02x} where an ACK was due")
        err = ack_error(status, self._read(mlen))
        body: dict[str, Any] = {"op": op, "part": part}
        body.update({"ok": True} if err is None else err.to_body())
        return Ack(cmd, body, err is not None)

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            data = self.conn.sock.recv(n - len(buf))
            if not data:
                raise ConnectionError("peer closed the connection")
            buf += data
        return buf

    def write(self, rkey: int, addrs: list[int], lens: list[int], payload: bytes,
              op: int = 1, **extra: Any) -> Any:
        """One WRITE and its ACK."""
        self.send(PeerCommand.WRITE, {"op": op, "part": 0, "rkey": rkey, "addrs": addrs,
                                      "lens": lens, **extra}, payload)
        return self.recv()

    def close(self) -> None:
        self.conn.close()
        for s in self.listeners:
            s.close()

    def __enter__(self) -> FakePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def handshake_error(peer: FakePeer) -> TransferdError | OSError | None:
    """The handshake's outcome: None when it went through, else what ended it."""
    try:
        peer.handshake()
    except (TransferdError, OSError) as exc:
        return exc
    return None


__all__ = ["STRANGER", "Ack", "FakePeer", "data_frame", "handshake_error", "parse_rail",
           "raw_write"]
