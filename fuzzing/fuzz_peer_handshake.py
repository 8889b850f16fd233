"""Fuzz target: the peer plane's sans-IO handshake (PeerHandshake), either role.

The first byte picks the role (bit 0: responder), a secret (bit 1) and the rail count
(bit 2: two rails); the rest is the other end's frames, with a probe token and clock
ticks between them where the input says so.  Every step ends in the handshake's events
or a typed TransferdError after which the end is CLOSED and says no more but its refusal.

The initiator knows whom it dials: here, whoever the first HELLO reply claims to be (so
an input can get past that check and into the proofs)."""

from __future__ import annotations

import itertools

from fuzzing.driver import Data, frames_until_error, instrumented, run

with instrumented():
    from transferd.protocol.constants import ErrorCode, Flag
    from transferd.protocol.errors import TransferdError
    from transferd.protocol.frames import FrameDecoder
    from transferd.protocol.peer import PeerCommand
    from transferd.protocol.peer_handshake import (
        MAX_HANDSHAKE_BODY,
        TRANSITIONS,
        PeerHandshake,
        PeerIdentity,
        Probe,
        Ready,
        Role,
        State,
    )

SECRET = b"fuzzing cluster secret"
CODES = {c.value for c in ErrorCode}
REACHABLE = {State.START, State.AWAIT_HELLO} | set(TRANSITIONS.values())


def test_one_input(raw: bytes) -> None:
    data = Data(raw)
    mode = data.number()
    role = Role.RESPONDER if mode & 1 else Role.INITIATOR
    addrs = (b"127.0.0.1:7000", b"127.0.0.2:7001")[: 2 if mode & 4 else 1]
    me = PeerIdentity(0x1234, 0, addrs)
    todo = frames_until_error(FrameDecoder(max_body=MAX_HANDSHAKE_BODY, max_payload=1 << 20),
                              data.rest())
    n = itertools.count(1)
    h: PeerHandshake | None = None
    now = 0.0
    for f in todo:
        if h is None:
            expect = (0, 0, b"")
            if role is Role.INITIATOR and f.cmd == PeerCommand.HELLO and f.body:
                b = f.body
                got = b.get("addrs")
                rail = b.get("rail")
                if type(got) is list and type(rail) is int and 0 <= rail < len(got):
                    expect = (b.get("node"), b.get("group"), got[rail])
            h = PeerHandshake(role, me, 0, SECRET if mode & 2 else None, 0.0,
                              expect=expect if role is Role.INITIATOR else None,
                              random=lambda k: next(n).to_bytes(k, "big"))
            if role is Role.INITIATOR:
                h.start()
        try:
            if f.cmd == 0xFE:  # not a peer command: the input's way to send a probe token
                h.probe(bytes(f.body.get("t", b"")) if isinstance(f.body.get("t"), bytes)
                        else b"", now)
            elif f.cmd == 0xFD:
                now += 3.0
                h.tick(now)
            else:
                h.receive(f, now)
        except TransferdError as exc:
            assert exc.code.value in CODES
            assert h.state is State.CLOSED and h.error is not None
        assert h.state in REACHABLE
        for ev in h.events():
            assert isinstance(ev, Ready | Probe)
            if isinstance(ev, Ready):
                assert h.state is State.READY
        for out in FrameDecoder(max_body=MAX_HANDSHAKE_BODY, max_payload=0).feed(
                h.data_to_send()):
            if out.flags & int(Flag.ERROR):
                assert out.body.get("code") in CODES
            else:
                assert out.cmd in (PeerCommand.HELLO, PeerCommand.AUTH)


def main() -> None:
    run(test_one_input)


if __name__ == "__main__":
    main()
