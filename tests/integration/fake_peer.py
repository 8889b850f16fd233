"""A peer driven by hand over a blocking socket, for tests of what a daemon refuses.

It runs the real sans-IO handshake (:class:`PeerHandshake`) as an initiator, so it
gets exactly as far as its credentials allow: with the cluster secret (or, without
one, listening at the address it claims) it is a peer, and then sends frames as
badly as a test wants; without, the daemon closes on it.
"""

from __future__ import annotations

import secrets
import socket
import time
from typing import Any

from tests.helpers import RawConn
from transferd.domains.rails import parse_rail, rail_bytes
from transferd.protocol.errors import TransferdError
from transferd.protocol.frames import Frame, FrameDecoder
from transferd.protocol.peer import PeerCommand
from transferd.protocol.peer_handshake import PeerHandshake, PeerIdentity, Role, State
from transferd.protocol.values import NetAddr

STRANGER = "127.0.0.9"


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
        self.me = PeerIdentity(node or secrets.randbits(62) + 1, 0, addrs)
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
        self.conn.send(cmd, body, payload)

    def recv(self) -> Frame:
        return self.conn.recv()

    def write(self, rkey: int, addrs: list[int], lens: list[int], payload: bytes,
              op: int = 1, **extra: Any) -> Frame:
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


__all__ = ["STRANGER", "FakePeer", "handshake_error", "parse_rail"]
