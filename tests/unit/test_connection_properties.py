"""Property tests of the sans-IO client connections (issue 11, hostile input).

Whatever a client sends a :class:`ServerConnection` (any bytes cut at any read
boundaries, any frames in any order, with the clock moved anywhere between them) and
whatever a server sends a :class:`ClientConnection`, the outcome is valid events and
frames, or a typed :class:`TransferdError`: never another exception, and the state
machine never goes where its transition table does not lead.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.hostile import U32, bodies, values
from transferd.protocol import auth
from transferd.protocol.connection import (
    TRANSITIONS,
    ClientConnection,
    ConnState,
    Ready,
    Refused,
    Request,
    ServerConnection,
    ServerSettings,
)
from transferd.protocol.constants import Command, ErrorCode, Flag
from transferd.protocol.errors import TransferdError
from transferd.protocol.frames import Frame, FrameDecoder, encode_frame

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SECRET = b"correct horse battery staple"
CODES = {c.value for c in ErrorCode}
# Reached from HELLO by some path of the table (the only states a connection may be in).
REACHABLE = {ConnState.HELLO} | {s for row in TRANSITIONS.values() for s in row.values()}


def counter_random() -> Any:
    n = itertools.count(1)
    return lambda k: next(n).to_bytes(k, "big")


server_settings = st.builds(
    ServerSettings,
    minor=st.sampled_from([1, 2]),
    secret=st.sampled_from([b"", SECRET]),
    token_allowed=st.booleans(),
    max_message=st.sampled_from([None, 4096]),
    handshake_timeout=st.sampled_from([0.5, 5.0]),
)

# HELLO and AUTH bodies: right, wrong and hostile values of every field they have.
hello_bodies = bodies({
    "major": st.sampled_from([1, 1, 0, 2]), "minor": st.sampled_from([1, 2, 3]),
    "client": st.text(max_size=10), "auth": st.sampled_from(["hmac-sha256", "token", "x"]),
    "nonce": st.binary(min_size=32, max_size=32), "token": st.sampled_from(
        [SECRET.decode(), "wrong", ""]),
})
auth_bodies = bodies({"mac": st.binary(min_size=31, max_size=33)})
commands = st.sampled_from([int(Command.HELLO), int(Command.AUTH), int(Command.HELLO),
                            int(Command.GET_DEVICES), int(Command.SET_TENSOR), 0x3F, 0x41, 0xFF])
flags = st.sampled_from([0, 0, 0, int(Flag.NO_REPLY), int(Flag.REPLY), int(Flag.ERROR), 0x10])


def check_output(conn: ServerConnection, frames_out: FrameDecoder) -> list[Any]:
    """What the server wrote: whole frames, each a reply (or a refusal) with a valid body."""
    out = frames_out.feed(conn.data_to_send())
    for f in out:
        assert f.flags & int(Flag.REPLY), f
        if f.flags & int(Flag.ERROR):
            assert f.body.get("code") in CODES, f.body
    return out


def check_events(conn: ServerConnection, events: list[Any], seen: dict[str, int]) -> None:
    assert conn.state in REACHABLE
    for ev in events:
        assert isinstance(ev, Ready | Refused | Request), ev
        if isinstance(ev, Refused):
            assert isinstance(ev.error, TransferdError)
            assert ev.error.code.value in CODES
            seen["refused"] += 1
        elif isinstance(ev, Ready):
            seen["ready"] += 1
        else:
            assert conn.state is ConnState.READY
    # One verdict per connection: ready once at most, refused once at most (the first
    # refusal closes it; nothing is read after).
    assert seen["ready"] <= 1 and seen["refused"] <= 1
    if seen["refused"]:
        assert conn.state in (ConnState.CLOSING, ConnState.CLOSED)


@SETTINGS
@given(server_settings, st.binary(max_size=700), st.lists(st.integers(0, 700), max_size=6),
       st.lists(st.floats(0, 10), max_size=3))
def test_server_takes_any_bytes(settings_: ServerSettings, data: bytes, cuts: list[int],
                                clock: list[float]) -> None:
    conn = ServerConnection(settings_, now=0.0, random=counter_random())
    out = FrameDecoder()
    seen = {"ready": 0, "refused": 0}
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    ticks = iter(sorted(clock))
    for a, b in itertools.pairwise(points):
        check_events(conn, conn.receive_data(data[a:b]), seen)
        now = next(ticks, None)
        if now is not None:
            check_events(conn, conn.handle_timeout(now), seen)
        check_output(conn, out)
    check_events(conn, conn.handle_timeout(100.0), seen)
    check_output(conn, out)
    # The pre-auth buffer never grew for a stranger's announced sizes.
    if conn.state in (ConnState.HELLO, ConnState.AUTH):
        assert len(conn.decoder._buf) <= 8192


@st.composite
def handshake_frames(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """Steps: a frame, a right AUTH (the mac for the challenge the server sent), a clock
    tick; in any order and number."""
    steps: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["hello", "auth", "good_auth", "other", "tick"]))
        if kind == "hello":
            steps.append(("frame", (int(Command.HELLO), draw(flags), draw(hello_bodies), b"")))
        elif kind == "auth":
            steps.append(("frame", (int(Command.AUTH), draw(flags), draw(auth_bodies), b"")))
        elif kind == "other":
            payload = draw(st.binary(max_size=8))
            steps.append(("frame", (draw(commands), draw(flags),
                                    draw(bodies({"x": values})), payload)))
        else:
            steps.append((kind, draw(st.floats(0, 10)) if kind == "tick" else None))
    return steps


@SETTINGS
@given(server_settings, handshake_frames())
def test_server_takes_any_frames_in_any_order(settings_: ServerSettings,
                                              steps: list[tuple[str, Any]]) -> None:
    conn = ServerConnection(settings_, now=0.0, random=counter_random())
    out = FrameDecoder()
    seen = {"ready": 0, "refused": 0}
    nonce = b""
    challenge = b""
    now = 0.0
    for kind, arg in steps:
        if kind == "tick":
            now = max(now, arg)
            events = conn.handle_timeout(now)
        elif kind == "good_auth":
            mac = auth.client_mac(settings_.secret, challenge, nonce) if challenge else b""
            events = conn.receive_data(encode_frame(int(Command.AUTH), 0, 7, {"mac": mac}))
        else:
            cmd, fl, body, payload = arg
            if cmd == int(Command.HELLO) and isinstance(body.get("nonce"), bytes):
                nonce = body["nonce"]
            events = conn.receive_data(encode_frame(cmd, fl, 1, body, len(payload)) + payload)
        check_events(conn, events, seen)
        for f in check_output(conn, out):
            if f.cmd == int(Command.HELLO) and isinstance(f.body.get("challenge"), bytes):
                challenge = f.body["challenge"]
                assert conn.state is ConnState.AUTH
    if seen["ready"]:
        assert conn.state in (ConnState.READY, ConnState.CLOSING)
    conn.connection_lost()
    assert conn.state is ConnState.CLOSED


# -- the client side ------------------------------------------------------------------

hello_replies = bodies({
    "major": st.sampled_from([1, 1, 1, 0, 2]), "minor": st.sampled_from([1, 2]),
    "patch": st.just(0), "server": st.text(max_size=8), "features": st.just(["engine"]),
    "max_body": st.sampled_from([4096, 1 << 22]), "max_payload": st.just(1 << 34),
    "max_tensors": st.just(65536), "max_reply": st.just(1 << 34),
    "auth": st.sampled_from([["hmac-sha256"], ["token"], []]),
    "challenge": st.binary(min_size=32, max_size=32), "proof": st.binary(min_size=32,
                                                                      max_size=32),
    "max_message": st.just(4096),
}, optional=frozenset({"auth", "challenge", "proof", "max_message", "max_tensors"}))
reply_flags = st.sampled_from([int(Flag.REPLY), int(Flag.REPLY), int(Flag.REPLY | Flag.ERROR),
                               int(Flag.EVENT), 0])


@st.composite
def server_frames(draw: st.DrawFn) -> list[bytes]:
    out = []
    for _ in range(draw(st.integers(1, 4))):
        cmd = draw(st.sampled_from([int(Command.HELLO), int(Command.HELLO), int(Command.AUTH),
                                    int(Command.STATS), 0x3F]))
        body = draw(hello_replies if cmd == int(Command.HELLO) else bodies(
            {"code": st.sampled_from([*sorted(CODES), "NOPE"]), "message": st.text(max_size=8)}))
        out.append(encode_frame(cmd, draw(reply_flags), draw(st.integers(0, U32)), body))
    return out


def client_events(conn: ClientConnection, data: bytes) -> list[Any]:
    try:
        events = conn.receive_data(data)
    except TransferdError as exc:  # typed: the I/O layer closes the connection
        assert exc.code.value in CODES
        return []
    for i, ev in enumerate(events):
        assert isinstance(ev, Ready | Refused), ev
        if isinstance(ev, Ready):
            # READY, unless a later frame of the same read refused it.
            later = events[i + 1:]
            assert conn.state is ConnState.READY or any(isinstance(e, Refused) for e in later)
            # What the asyncio client reads off a reply that made it READY.
            for name in ("major", "minor", "patch"):
                assert type(ev.hello[name]) is int and ev.hello[name] >= 0
            for name in ("max_body", "max_payload", "max_tensors", "max_reply", "max_message"):
                if name in ev.hello:
                    assert type(ev.hello[name]) is int and ev.hello[name] >= 0
        else:
            assert ev.error.code.value in CODES
    return events


@SETTINGS
@given(st.sampled_from([None, SECRET]), st.sampled_from(["hmac-sha256", "token"]),
       server_frames(), st.lists(st.integers(0, 2000), max_size=4))
def test_client_takes_any_server_frames(secret: bytes | None, method: str, data: list[bytes],
                                        cuts: list[int]) -> None:
    conn = ClientConnection(secret=secret, method=method, random=counter_random())
    conn.start()
    FrameDecoder().feed(conn.data_to_send())
    wire = b"".join(data)
    points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
    for a, b in itertools.pairwise(points):
        client_events(conn, wire[a:b])
        assert conn.state in REACHABLE
        for f in FrameDecoder().feed(conn.data_to_send()):
            assert f.cmd == int(Command.AUTH) and conn.state is ConnState.AUTH


@SETTINGS
@given(st.sampled_from([None, SECRET]), hello_replies)
@example(None, {"major": True, "minor": 1, "patch": 0})  # (True == 1: was READY)
def test_client_takes_any_hello_reply(secret: bytes | None, body: dict[str, Any]) -> None:
    conn = ClientConnection(secret=secret, random=counter_random())
    conn.start()
    conn.data_to_send()
    client_events(conn, encode_frame(int(Command.HELLO), int(Flag.REPLY), 1, body))
    assert conn.state in REACHABLE


@SETTINGS
@given(st.binary(max_size=400))
def test_client_takes_any_bytes(data: bytes) -> None:
    conn = ClientConnection(secret=SECRET, random=counter_random())
    conn.start()
    client_events(conn, data)
    assert conn.state in REACHABLE


@SETTINGS
@given(server_settings, st.sampled_from([None, SECRET, b"another secret"]),
       st.sampled_from(["hmac-sha256", "token"]), st.lists(st.integers(0, 3), max_size=6))
def test_a_real_pair_with_frames_lost_or_repeated(settings_: ServerSettings,
                                                  secret: bytes | None, method: str,
                                                  plan: list[int]) -> None:
    """A real client and server whose frames are each delivered, dropped, repeated or
    delayed: both end READY, or one has a typed verdict; never an untyped exception."""
    srv = ServerConnection(settings_, now=0.0, random=counter_random())
    cli = ClientConnection(secret=secret, method=method, random=counter_random())
    cli.start()
    late = b""
    for step in [*plan, 0, 0, 0]:
        up, late = late + cli.data_to_send(), b""
        if step == 1:
            up = b""  # lost
        elif step == 2:
            up *= 2  # repeated
        elif step == 3:
            up, late = b"", up  # delayed past the next turn
        srv.receive_data(up)
        client_events(cli, srv.data_to_send())
        srv.handle_timeout(float(step))
    assert srv.state in REACHABLE and cli.state in REACHABLE
    if cli.state is ConnState.READY:
        assert srv.state is ConnState.READY


@pytest.mark.parametrize("body", [{"major": 1}, {"major": 1, "minor": "x", "patch": 0},
                                  {"major": 1, "minor": 2, "patch": 0, "max_body": -1},
                                  {"major": 1, "minor": 2, "patch": 0, "max_reply": 1.5}])
def test_a_hello_reply_with_ill_typed_fields_is_bad_frame(body: dict[str, Any]) -> None:
    """Found by the properties above: a reply without ``minor`` (or with ``"x"``) was a
    KeyError / ValueError out of ClientConnection; the asyncio client did int() on them."""
    conn = ClientConnection(random=counter_random())
    conn.start()
    conn.data_to_send()
    (ev,) = conn.receive_data(encode_frame(int(Command.HELLO), int(Flag.REPLY), 1, body))
    assert isinstance(ev, Refused) and ev.error.code is ErrorCode.BAD_FRAME
    assert "HELLO reply" in ev.error.message
    assert conn.state is ConnState.CLOSING


@pytest.mark.parametrize("flags, cmd", [(int(Flag.EVENT), int(Command.SUBMIT_RECVS)),
                                        (int(Flag.REPLY), int(Command.GET_DEVICES))])
def test_a_lying_server_cannot_make_the_client_allocate_what_it_announces(flags: int,
                                                                           cmd: int) -> None:
    """Found by these properties' fuzz target: a payload nobody set memory up for was
    collected into bytearray(payload_len): a server's EVENT (or GET_DEVICES reply) announcing
    8 GiB had the client zero 8 GiB. Now BAD_FRAME and the connection is lost."""
    import asyncio

    from client import Client
    from tests.helpers import lying_server, run
    from transferd.protocol.frames import encode_header

    def announce(writer: asyncio.StreamWriter) -> None:
        if flags & int(Flag.EVENT):
            writer.write(encode_header(cmd, flags, 0, 0, 8 << 30))

    def lie(f: Frame, writer: asyncio.StreamWriter) -> None:
        # the reply to a request that takes no payload back
        writer.write(encode_header(f.cmd, flags, f.seq, 0, 8 << 30))

    async def main() -> None:
        async with lying_server(lie, max_payload=1 << 34, hello=announce) as url:
            c = await Client.connect(url)
            try:
                await _lost(c)
            finally:
                with contextlib.suppress(Exception):
                    await c.close()

    async def _lost(c: Client) -> None:
        if flags & int(Flag.REPLY):
            with pytest.raises(TransferdError) as info:
                await c.get_devices()
            err: Any = info.value
        else:
            for _ in range(200):
                if c._conn is not None and c._conn.lost is not None:
                    break
                await asyncio.sleep(0.01)
            err = c._conn.lost if c._conn is not None else None
        assert err is not None and err.code is ErrorCode.BAD_FRAME, err
        assert "nothing asked for" in err.message

    run(main(), timeout=20)
