"""Fuzz target: the server's sans-IO connection (ServerConnection, HELLO and AUTH).

The input picks the listener's settings (a secret or none, the token method offered)
and the clock's moves, then is fed as a client's byte stream in pieces.  Every event is
Ready, Refused or Request; one verdict at most; after a refusal nothing more is read;
what the server writes is replies only; before READY its buffer stays small."""

from __future__ import annotations

import itertools

from fuzzing.driver import Data, instrumented, run

with instrumented():
    from transferd.protocol import auth
    from transferd.protocol.connection import (
        TRANSITIONS,
        ConnState,
        Ready,
        Refused,
        Request,
        ServerConnection,
        ServerSettings,
    )
    from transferd.protocol.constants import ErrorCode, Flag
    from transferd.protocol.frames import FrameDecoder

SECRET = b"fuzzing secret"
CODES = {c.value for c in ErrorCode}
REACHABLE = {ConnState.HELLO} | {s for row in TRANSITIONS.values() for s in row.values()}


def test_one_input(raw: bytes) -> None:
    # An input that starts with the magic is a stream as it is (the seeds: no secret, so
    # their HELLO is answered); else its first byte picks the listener's settings.
    data = Data(raw)
    mode = 0 if raw[:2] == b"TD" else data.number()
    # Without a payload_sink (the session always gives one) the sans-IO connection collects
    # a payload into a bytearray of the announced size: keep that size small here.
    settings = ServerSettings(secret=SECRET if mode & 1 else b"", token_allowed=bool(mode & 2),
                              handshake_timeout=5.0, max_payload=1 << 20)
    n = itertools.count(1)
    conn = ServerConnection(settings, now=0.0, random=lambda k: next(n).to_bytes(k, "big"))
    stream = data.rest()
    out = FrameDecoder()
    ready = refused = 0
    now = 0.0
    for i in range(0, max(len(stream), 1), 97):
        for ev in conn.receive_data(stream[i : i + 97]):
            assert isinstance(ev, Ready | Refused | Request), ev
            if isinstance(ev, Refused):
                refused += 1
                assert ev.error.code.value in CODES
            elif isinstance(ev, Ready):
                ready += 1
        assert conn.state in REACHABLE
        assert ready <= 1 and refused <= 1
        if refused:
            assert conn.state in (ConnState.CLOSING, ConnState.CLOSED)
        for f in out.feed(conn.data_to_send()):
            assert f.flags & int(Flag.REPLY)
            if f.flags & int(Flag.ERROR):
                assert f.body.get("code") in CODES
        if conn.state in (ConnState.HELLO, ConnState.AUTH):
            assert len(conn.decoder._buf) <= 8192
        now += 1.0
        conn.handle_timeout(now)
    assert auth.PRE_AUTH_MAX_BODY == 4096


def main() -> None:
    run(test_one_input)


if __name__ == "__main__":
    main()
