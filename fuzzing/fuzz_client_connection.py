"""Fuzz target: the client's sans-IO connection (ClientConnection), fed a server's bytes.

Every outcome is Ready, Refused or a typed TransferdError; a Ready carries a HELLO reply
whose version and limits are unsigned integers (what the asyncio client reads)."""

from __future__ import annotations

import itertools

from fuzzing.driver import Data, instrumented, run

with instrumented():
    from transferd.protocol.connection import (
        TRANSITIONS,
        ClientConnection,
        ConnState,
        Ready,
        Refused,
    )
    from transferd.protocol.constants import ErrorCode
    from transferd.protocol.errors import TransferdError

SECRET = b"fuzzing secret"
CODES = {c.value for c in ErrorCode}
REACHABLE = {ConnState.HELLO} | {s for row in TRANSITIONS.values() for s in row.values()}
LIMITS = ("max_body", "max_payload", "max_tensors", "max_reply", "max_message")


def test_one_input(raw: bytes) -> None:
    # As in fuzz_server_connection: the magic first is a stream as it is, else the first
    # byte picks the client's secret and method.
    data = Data(raw)
    mode = 0 if raw[:2] == b"TD" else data.number()
    n = itertools.count(1)
    conn = ClientConnection(secret=SECRET if mode & 1 else None,
                            method="token" if mode & 2 else "hmac-sha256",
                            random=lambda k: next(n).to_bytes(k, "big"))
    conn.start()
    conn.data_to_send()
    stream = data.rest()
    for i in range(0, max(len(stream), 1), 61):
        try:
            events = conn.receive_data(stream[i : i + 61])
        except TransferdError as exc:
            assert exc.code.value in CODES
            return
        for ev in events:
            assert isinstance(ev, Ready | Refused), ev
            if isinstance(ev, Ready):
                for k in ("major", "minor", "patch"):
                    assert type(ev.hello[k]) is int and ev.hello[k] >= 0
                for k in LIMITS:
                    assert k not in ev.hello or (type(ev.hello[k]) is int and ev.hello[k] >= 0)
            else:
                assert ev.error.code.value in CODES
        assert conn.state in REACHABLE


def main() -> None:
    run(test_one_input)


if __name__ == "__main__":
    main()
