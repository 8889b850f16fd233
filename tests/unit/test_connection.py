"""The sans-IO connections wired to each other in memory: no sockets, no loop, a number for a clock.

Modelled on aioquic's tests/test_connection.py: a client and a server
connection exchange ``data_to_send()`` until neither has anything to say.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from client import Client
from client.connection import Connection as ClientProtocol
from transferd.protocol import auth
from transferd.protocol.connection import (
    HANDSHAKE_BUFFER,
    TRANSITIONS,
    ClientConnection,
    ConnState,
    IllegalTransition,
    Input,
    Ready,
    Refused,
    Request,
    ServerConnection,
    ServerSettings,
    failure_frame,
)
from transferd.protocol.constants import Command, ErrorCode, Flag
from transferd.protocol.errors import BadFrame, NotFound, TransferdError
from transferd.protocol.frames import FrameDecoder, encode_frame, encode_header

SECRET = b"correct horse battery staple"


def counter_random() -> Any:
    """Deterministic 'random' bytes, different on every call."""
    n = itertools.count(1)
    return lambda k: next(n).to_bytes(k, "big")


def server(**kw: Any) -> ServerConnection:
    return ServerConnection(ServerSettings(**kw), now=100.0, random=counter_random())


def run(client: ClientConnection, srv: ServerConnection, *, limit: int = 10
        ) -> tuple[list[Any], list[Any]]:
    """Shuttle bytes both ways until quiet; every event each side saw."""
    c_events: list[Any] = []
    s_events: list[Any] = []
    for _ in range(limit):
        up = client.data_to_send()
        if up:
            s_events += srv.receive_data(up)
        down = srv.data_to_send()
        if down:
            c_events += client.receive_data(down)
        if not up and not down:
            return c_events, s_events
    raise AssertionError("the connections never went quiet")


def handshake(client: ClientConnection, srv: ServerConnection) -> tuple[list[Any], list[Any]]:
    client.start()
    return run(client, srv)


# -- HELLO and versions --------------------------------------------------------------------


def test_hello_with_nothing_required() -> None:
    c, s = ClientConnection(name="t"), server(minor=2, features=["batched_get"])
    ce, se = handshake(c, s)
    assert c.state is s.state is ConnState.READY
    assert [type(e) for e in ce] == [Ready] and [type(e) for e in se] == [Ready]
    assert ce[0].hello["features"] == ["batched_get"] and "auth" not in ce[0].hello
    assert se[0].client == "t" and se[0].method is None


@pytest.mark.parametrize(("client_minor", "server_minor"), [(1, 2), (2, 1), (2, 2), (1, 1)])
def test_version_fallback_both_ways(client_minor: int, server_minor: int) -> None:
    c, s = ClientConnection(max_minor=client_minor), server(minor=server_minor)
    ce, se = handshake(c, s)
    # Each reports its own minor; the smaller is what both speak.
    assert ce[0].minor == server_minor and se[0].minor == client_minor
    assert min(ce[0].minor, client_minor) == min(client_minor, server_minor)


def test_another_major_is_refused_and_closes() -> None:
    s = server()
    events = s.receive_data(encode_frame(Command.HELLO, 0, 1, {"major": 2, "minor": 0}))
    assert isinstance(events[0], Refused) and events[0].error.code == ErrorCode.VERSION_MISMATCH
    assert s.state is ConnState.CLOSING
    (f,) = FrameDecoder().feed(s.data_to_send())
    assert f.flags == Flag.REPLY | Flag.ERROR and f.seq == 1
    # Nothing more is read.
    assert s.receive_data(encode_frame(Command.HELLO, 0, 2, {"major": 1, "minor": 2})) == []


def test_a_message_transport_announces_max_message() -> None:
    c, s = ClientConnection(), server(max_message=65536)
    ce, _ = handshake(c, s)
    assert ce[0].hello["max_message"] == 65536


# -- hmac-sha256 -----------------------------------------------------------------------------


def test_hmac_handshake_proves_both_ways() -> None:
    c, s = ClientConnection(secret=SECRET), server(secret=SECRET)
    ce, se = handshake(c, s)
    assert c.state is s.state is ConnState.READY
    assert se[0].method == "hmac-sha256" and ce[0].method == "hmac-sha256"
    # READY: requests flow to the handlers as events.
    (ev,) = s.receive_data(encode_frame(Command.STATS, 0, 9))
    assert isinstance(ev, Request) and ev.frame.cmd == Command.STATS


def test_wrong_secret_the_client_stops_at_the_proof() -> None:
    c, s = ClientConnection(secret=b"wrong"), server(secret=SECRET)
    ce, _ = handshake(c, s)
    assert isinstance(ce[0], Refused) and "proof" in ce[0].error.message
    assert c.state is ConnState.CLOSING and s.state is ConnState.AUTH
    assert c.data_to_send() == b""  # no AUTH derived from the wrong secret goes out


def _to_auth(s: ServerConnection, nonce: bytes = b"n" * 32) -> dict[str, Any]:
    s.receive_data(encode_frame(Command.HELLO, 0, 1, {"major": 1, "minor": 2,
                                                       "auth": "hmac-sha256", "nonce": nonce}))
    (f,) = FrameDecoder().feed(s.data_to_send())
    assert s.state is ConnState.AUTH
    return f.body


@pytest.mark.parametrize(
    "mac", [b"\x00" * 32, b"short", "str", None, b"x" * 33], ids=["zero", "short", "str", "none",
                                                                  "long"]
)
def test_every_bad_mac_is_unauthorized(mac: Any) -> None:
    s = server(secret=SECRET)
    _to_auth(s)
    events = s.receive_data(encode_frame(Command.AUTH, 0, 2, {} if mac is None else {"mac": mac}))
    assert isinstance(events[0], Refused) and events[0].auth
    assert events[0].error.code == ErrorCode.UNAUTHORIZED
    assert s.state is ConnState.CLOSING


def test_a_mac_from_another_connection_does_not_replay() -> None:
    nonce = b"n" * 32
    first, second = server(secret=SECRET), server(secret=SECRET)
    c1 = _to_auth(first, nonce)["challenge"]
    mac = auth.client_mac(SECRET, c1, nonce)
    assert isinstance(first.receive_data(encode_frame(Command.AUTH, 0, 2, {"mac": mac}))[0],
                      Ready)
    second._random = lambda k: b"\x07" * k  # another connection, another challenge
    assert _to_auth(second, nonce)["challenge"] != c1
    (ev,) = second.receive_data(encode_frame(Command.AUTH, 0, 2, {"mac": mac}))
    assert isinstance(ev, Refused) and ev.error.message.startswith("wrong mac")


@pytest.mark.parametrize("nonce", [b"short", "str", None])
def test_a_bad_nonce_is_unauthorized(nonce: Any) -> None:
    s = server(secret=SECRET)
    body: dict[str, Any] = {"major": 1, "minor": 2, "auth": "hmac-sha256"}
    if nonce is not None:
        body["nonce"] = nonce
    (ev,) = s.receive_data(encode_frame(Command.HELLO, 0, 1, body))
    assert isinstance(ev, Refused) and ev.error.code == ErrorCode.UNAUTHORIZED


def test_a_server_that_proves_nothing_is_refused_by_the_client() -> None:
    c = ClientConnection(secret=SECRET)
    c.start()
    reply = {"major": 1, "minor": 2, "patch": 0, "auth": ["hmac-sha256"],
             "challenge": b"c" * 32, "proof": b"\x00" * 32}
    (ev,) = c.receive_data(encode_frame(Command.HELLO, Flag.REPLY, 1, reply))
    assert isinstance(ev, Refused) and c.state is ConnState.CLOSING


# -- the token method ----------------------------------------------------------------------


def test_token_where_offered() -> None:
    c = ClientConnection(secret=SECRET, method="token")
    s = server(secret=SECRET, token_allowed=True)
    ce, se = handshake(c, s)
    assert se[0].method == "token" and ce[0].hello["auth"] == ["hmac-sha256", "token"]


def test_token_where_not_offered_is_refused() -> None:
    c = ClientConnection(secret=SECRET, method="token")
    s = server(secret=SECRET, token_allowed=False)
    ce, se = handshake(c, s)
    assert isinstance(se[0], Refused) and "hmac-sha256" in se[0].error.message
    assert isinstance(ce[0], Refused) and ce[0].error.code == ErrorCode.UNAUTHORIZED


@pytest.mark.parametrize("token", ["", "nope", SECRET.decode() + " ", 12345])
def test_a_wrong_token_is_refused(token: Any) -> None:
    s = server(secret=SECRET, token_allowed=True)
    (ev,) = s.receive_data(encode_frame(Command.HELLO, 0, 1, {"major": 1, "minor": 2,
                                                               "token": token}))
    assert isinstance(ev, Refused) and ev.auth and s.state is ConnState.CLOSING


def test_no_secret_when_one_is_required() -> None:
    c, s = ClientConnection(), server(secret=SECRET)
    ce, se = handshake(c, s)
    assert isinstance(se[0], Refused) and "hmac-sha256" in se[0].error.message
    assert isinstance(ce[0], Refused)


# -- pre-auth limits, from the header alone ----------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (encode_header(Command.STATS, 0, 5, 0, 0), ErrorCode.NO_HELLO),
        (encode_header(Command.SET_TENSOR, 0, 5, 20, 1 << 34), ErrorCode.NO_HELLO),
        (encode_header(Command.HELLO, 0, 5, 4097, 0), ErrorCode.TOO_LARGE),
        (encode_header(Command.HELLO, 0, 5, 0xFFFFFFFF, 0), ErrorCode.TOO_LARGE),
        (encode_header(Command.HELLO, 0, 5, 10, 1), ErrorCode.TOO_LARGE),
        (b"XY" + encode_header(Command.HELLO, 0, 5, 0, 0)[2:], ErrorCode.BAD_FRAME),
    ],
    ids=["no-hello", "set-16g", "body-4097", "body-4g", "payload-1", "magic"],
)
def test_pre_auth_frames_are_judged_from_the_header(raw: bytes, code: ErrorCode) -> None:
    s = server()
    (ev,) = s.receive_data(raw)  # the header only: no body was ever sent
    assert isinstance(ev, Refused) and ev.error.code == code
    (f,) = FrameDecoder().feed(s.data_to_send())
    assert f.body["code"] == code and (f.seq == 5 or code == ErrorCode.BAD_FRAME)
    # The decoder never grew past its handshake buffer for the announced size.
    assert len(s.decoder._buf) == HANDSHAKE_BUFFER


def test_a_4096_byte_hello_is_accepted_and_4097_is_not() -> None:
    for pad, ok in ((4096, True), (4097, False)):
        body = {"major": 1, "minor": 2, "client": ""}
        raw = encode_frame(Command.HELLO, 0, 1, body)
        filler = pad - (len(raw) - 24)
        raw = encode_frame(Command.HELLO, 0, 1, {**body, "client": "c" * (filler - 2)})
        body_len = len(raw) - 24
        if body_len != pad:  # msgpack's str header grows at 256 bytes
            raw = encode_frame(Command.HELLO, 0, 1,
                               {**body, "client": "c" * (filler - 2 - (body_len - pad))})
        assert len(raw) - 24 == pad
        (ev,) = server().receive_data(raw)
        assert isinstance(ev, Ready) is ok, (pad, ev)


def test_only_auth_while_auth_is_due() -> None:
    s = server(secret=SECRET)
    _to_auth(s)
    (ev,) = s.receive_data(encode_header(Command.HELLO, 0, 3, 0, 0))
    assert ev.error.code == ErrorCode.UNAUTHORIZED


def test_after_ready_the_real_limits_apply() -> None:
    s = server(max_body=1 << 20, max_payload=1 << 30)
    handshake(ClientConnection(), s)
    assert s.decoder.gate is None and s.decoder.max_body == 1 << 20
    # Elastic, not READ_CHUNK for good: large only while bytes pour in (an idle
    # connection holds HANDSHAKE_BUFFER; tests/integration/test_attacks_idle_buffers.py).
    assert s.decoder._small == HANDSHAKE_BUFFER
    (ev,) = s.receive_data(encode_frame(Command.SET_TENSOR, 0, 4, {"tensor": [1, 0, 3]}, 3)
                           + b"abc")
    assert isinstance(ev, Request) and ev.frame.payload == bytearray(b"abc")


# -- timeouts, by advancing the clock --------------------------------------------------------


def test_the_handshake_times_out() -> None:
    s = ServerConnection(ServerSettings(handshake_timeout=2.0), now=50.0)
    assert s.deadline == 52.0
    assert s.handle_timeout(51.9) == []
    (ev,) = s.handle_timeout(52.0)
    assert isinstance(ev, Refused) and ev.error.code == ErrorCode.TIMEOUT
    assert s.state is ConnState.CLOSING
    (f,) = FrameDecoder().feed(s.data_to_send())
    assert f.body["code"] == "TIMEOUT"


def test_the_timeout_also_covers_auth_and_not_ready() -> None:
    s = ServerConnection(ServerSettings(secret=SECRET, handshake_timeout=1.0), now=0.0,
                         random=counter_random())
    _to_auth(s)
    assert s.handle_timeout(1.5)[0].error.code == ErrorCode.TIMEOUT
    ready = ServerConnection(ServerSettings(handshake_timeout=1.0), now=0.0)
    handshake(ClientConnection(), ready)
    assert ready.handle_timeout(100.0) == [] and ready.state is ConnState.READY


# -- the transition table ----------------------------------------------------------------------


def test_illegal_transitions_are_typed_errors() -> None:
    s = server()
    with pytest.raises(IllegalTransition) as e:
        s._go(Input.AUTH_ACCEPTED)  # AUTH accepted while HELLO is due
    assert isinstance(e.value, TransferdError) and e.value.code == ErrorCode.INTERNAL
    c = ClientConnection()
    with pytest.raises(IllegalTransition):
        c.auth_reply()
    c.start()
    with pytest.raises(IllegalTransition):
        # An AUTH reply where the HELLO reply is due.
        c.receive_data(encode_frame(Command.AUTH, Flag.REPLY, 1))


def test_every_state_can_be_lost_and_closed_is_final() -> None:
    for state, table in TRANSITIONS.items():
        assert table.get(Input.LOST) is ConnState.CLOSED, state
    assert set(TRANSITIONS[ConnState.CLOSED]) == {Input.LOST}
    s = server()
    s.connection_lost()
    assert s.state is ConnState.CLOSED
    with pytest.raises(IllegalTransition):
        s._go(Input.HELLO_ACCEPTED)


def test_ordering_frames_after_hello_in_one_read() -> None:
    """HELLO and requests pipelined in one read: the handshake first, then in order."""
    s = server()
    data = (encode_frame(Command.HELLO, 0, 1, {"major": 1, "minor": 2})
            + encode_frame(Command.STATS, 0, 2) + encode_frame(Command.SYNCHRONIZE, 0, 3))
    events = s.receive_data(data)
    assert [type(e) for e in events] == [Ready, Request, Request]
    assert [e.frame.seq for e in events[1:]] == [2, 3]


# -- EVENT frames for failed NO_REPLY commands ------------------------------------------------

_NR = int(Flag.NO_REPLY)
_REPLY_ERROR = int(Flag.REPLY | Flag.ERROR)
_EVENT_ERROR = int(Flag.EVENT | Flag.ERROR)


@pytest.mark.parametrize(("request_flags", "exc", "want"), [
    (0, NotFound("no buffer 9"), (_REPLY_ERROR, False)),
    (_NR, NotFound("no buffer 9"), (_EVENT_ERROR, False)),
    (0, BadFrame("bad magic"), (_REPLY_ERROR, True)),
    # A fatal error closes the connection: it is a reply even to a one-way command.
    (_NR, BadFrame("bad magic"), (_REPLY_ERROR, True)),
])
def test_which_frame_answers_a_failed_request(
    request_flags: int, exc: TransferdError, want: tuple[int, bool]
) -> None:
    assert failure_frame(request_flags, exc) == want


def _feed(proto: ClientProtocol, data: bytes) -> None:
    """Hand ``data`` to the client's protocol as its transport would (no socket)."""
    view = memoryview(data)
    while view:
        buf = proto.get_buffer(len(view))
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        proto.buffer_updated(n)
        view = view[n:]


def test_a_failed_no_reply_command_is_raised_at_the_clients_next_flush_point() -> None:
    c, s = ClientConnection(), server()
    handshake(c, s)
    assert s.state is ConnState.READY
    (req,) = s.receive_data(encode_frame(Command.FREE_BUFFER, Flag.NO_REPLY, 7, {"id": 9}))
    assert isinstance(req, Request)
    # The handler failed; a one-way command's failure goes out unasked and the
    # connection keeps serving.
    assert s.request_failed(req.frame, NotFound("FREE_BUFFER: no buffer 9")) is False
    assert s.state is ConnState.READY
    down = s.data_to_send()
    (frame,) = FrameDecoder().feed(down)
    assert (int(frame.flags), frame.cmd, frame.seq) == (_EVENT_ERROR, Command.FREE_BUFFER, 7)

    # The client library's protocol, fed those bytes in memory: nothing is raised
    # until its next flush point, which raises it once.
    client = Client("tcp://in-memory")
    proto = ClientProtocol()
    client._conn = proto
    _feed(proto, down)
    assert [type(e) for e in proto.failed] == [NotFound]
    with pytest.raises(NotFound, match="no buffer 9") as info:
        asyncio.run(client.flush())
    assert info.value.seq == 7
    asyncio.run(client.flush())  # raised once, not again

    # The same command asking for a reply gets REPLY|ERROR; a fatal error closes.
    (req,) = s.receive_data(encode_frame(Command.FREE_BUFFER, 0, 8, {"id": 9}))
    assert s.request_failed(req.frame, NotFound("FREE_BUFFER: no buffer 9")) is False
    (frame,) = FrameDecoder().feed(s.data_to_send())
    assert (int(frame.flags), frame.seq) == (_REPLY_ERROR, 8)
    (req,) = s.receive_data(encode_frame(Command.FREE_BUFFER, Flag.NO_REPLY, 9, {"id": 9}))
    assert s.request_failed(req.frame, BadFrame("bad magic")) is True
    assert s.state is ConnState.CLOSING
    (frame,) = FrameDecoder().feed(s.data_to_send())
    assert int(frame.flags) == _REPLY_ERROR
