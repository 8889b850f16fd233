"""The peer handshake, two ends wired to each other in memory: no sockets, the clock a number."""

from __future__ import annotations

from typing import Any

import pytest

from transferd.protocol.errors import (
    BadFrame,
    BadRequest,
    NoHello,
    Timeout,
    TooLarge,
    TransferdError,
    Unauthorized,
)
from transferd.protocol.frames import Frame, FrameDecoder, encode_frame, encode_header
from transferd.protocol.peer import PeerCommand
from transferd.protocol.peer_handshake import (
    MAX_HANDSHAKE_BODY,
    TRANSITIONS,
    VERSION,
    PeerHandshake,
    PeerIdentity,
    Probe,
    Ready,
    Role,
    State,
    node_of,
    parse_probe,
)

# Node ids their addresses' (what one must be without a secret: peer_handshake.node_of).
A = PeerIdentity(node_of(((b"127.0.0.2:1000", b"127.0.0.3:1001"),)), 0,
                 (b"127.0.0.2:1000", b"127.0.0.3:1001"))
B = PeerIdentity(node_of(((b"127.0.0.4:2000", b"127.0.0.5:2001"),)), 0,
                 (b"127.0.0.4:2000", b"127.0.0.5:2001"))
SECRET = b"the cluster secret"


def frames(data: bytes) -> list[Frame]:
    d = FrameDecoder(max_body=MAX_HANDSHAKE_BODY, max_payload=0)
    return d.feed(data)


def pair(secret_a: bytes | None = SECRET, secret_b: bytes | None = SECRET, rail: int = 1,
         expect: tuple[int, int, bytes] | None = None, now: float = 0.0,
         ) -> tuple[PeerHandshake, PeerHandshake]:
    ini = PeerHandshake(Role.INITIATOR, A, rail, secret_a, now,
                        expect=expect or (B.node, B.group, B.addrs[rail]))
    res = PeerHandshake(Role.RESPONDER, B, rail, secret_b, now)
    return ini, res


def pump(src: PeerHandshake, dst: PeerHandshake, now: float = 0.0) -> list[Frame]:
    """Move what ``src`` queued into ``dst``; the frames moved."""
    moved = frames(src.data_to_send())
    for f in moved:
        dst.receive(f, now)
    return moved


def deliver_probes(res: PeerHandshake, ini: PeerHandshake, now: float = 0.0) -> int:
    """What the I/O layer does with Probe events: dial the address, hand the token over."""
    n = 0
    for ev in res.events():
        if isinstance(ev, Probe):
            assert ev.addr == ini.me.addrs[res.rail]
            (f,) = frames(ev.data)
            nonce, token = parse_probe(f.body)
            assert nonce == ini.nonce
            ini.probe(token, now)
            n += 1
    return n


def ready(h: PeerHandshake) -> PeerIdentity:
    (ev,) = [e for e in h.events() if isinstance(e, Ready)]
    return ev.peer


def test_with_a_secret_both_ends_prove_it() -> None:
    ini, res = pair()
    ini.start()
    pump(ini, res)  # HELLO
    assert res.state is State.AWAIT_AUTH
    pump(res, ini)  # HELLO reply with the responder's proof
    assert ini.state is State.AUTH_SENT
    pump(ini, res)  # AUTH with the initiator's mac
    assert res.state is State.READY and ready(res) == A
    pump(res, ini)  # AUTH reply
    assert ini.state is State.READY and ready(ini) == B
    assert not ini.data_to_send() and not res.data_to_send()


def test_without_a_secret_the_initiator_echoes_the_probe_sent_to_its_address() -> None:
    ini, res = pair(None, None)
    ini.start()
    pump(ini, res)
    pump(res, ini)
    assert ini.state is State.AWAIT_PROBE and not ini.data_to_send()
    assert deliver_probes(res, ini) == 1
    assert ini.state is State.AUTH_SENT
    pump(ini, res)
    assert ready(res) == A
    pump(res, ini)
    assert ready(ini) == B


def test_a_probe_may_overtake_the_hello_reply() -> None:
    ini, res = pair(None, None)
    ini.start()
    pump(ini, res)
    deliver_probes(res, ini)  # the probe's connection was faster
    assert ini.state is State.HELLO_SENT
    pump(res, ini)
    assert ini.state is State.AUTH_SENT
    pump(ini, res)
    pump(res, ini)
    assert ini.state is State.READY and res.state is State.READY


def test_without_the_probe_an_initiator_cannot_finish() -> None:
    """A raw socket claiming an address it does not listen on never sees the token."""
    ini, res = pair(None, None)
    ini.start()
    pump(ini, res)
    pump(res, ini)
    res.events()  # the probe went to the claimed address, not to us
    liar = encode_frame(PeerCommand.AUTH, 0, 0, {"token": bytes(32)})
    with pytest.raises(Unauthorized, match="did not echo the probe"):
        res.receive(frames(liar)[0], 0.0)
    assert res.state is State.CLOSED
    (err,) = frames(res.data_to_send())
    assert err.is_error and err.body["code"] == "UNAUTHORIZED"


def _run_until_failure(ini: PeerHandshake, res: PeerHandshake) -> TransferdError:
    ini.start()
    for src, dst in [(ini, res), (res, ini), (ini, res), (res, ini)]:
        try:
            pump(src, dst)
        except TransferdError as exc:
            return exc
    raise AssertionError("the handshake did not fail")


def test_wrong_secret_on_the_responder_fails_at_the_initiator() -> None:
    ini, res = pair(SECRET, b"another secret")
    exc = _run_until_failure(ini, res)
    assert isinstance(exc, Unauthorized) and "did not prove the cluster secret" in str(exc)
    assert ini.state is State.CLOSED and not ini.data_to_send()
    assert res.state is State.AWAIT_AUTH  # it never heard an AUTH


def test_wrong_secret_on_the_initiator_is_refused_and_told() -> None:
    """The initiator checks the responder's proof first, so a responder with the right
    secret meets a bad mac only from an initiator that skips that check: forge one."""
    ini, res = pair()
    ini.start()
    pump(ini, res)
    pump(res, ini)
    ini.data_to_send()
    forged = encode_frame(PeerCommand.AUTH, 0, 0, {"mac": bytes(32)})
    with pytest.raises(Unauthorized, match="did not prove the cluster secret"):
        res.receive(frames(forged)[0], 0.0)
    (err,) = frames(res.data_to_send())
    assert err.cmd == PeerCommand.AUTH and err.is_error and err.is_reply
    # The initiator gets the responder's words as a typed error.
    with pytest.raises(Unauthorized, match=r"refused the handshake.*cluster secret"):
        ini.receive(err, 0.0)


@pytest.mark.parametrize("secrets", [(SECRET, None), (None, SECRET)])
def test_one_end_without_a_secret_cannot_link(secrets: tuple[bytes | None, ...]) -> None:
    ini, res = pair(*secrets)
    exc = _run_until_failure(ini, res)
    assert isinstance(exc, Unauthorized) and "secret" in str(exc)
    if res.state is State.CLOSED:  # the responder refused: its reason reaches the initiator
        with pytest.raises(Unauthorized, match=r"refused the handshake.*secret"):
            pump(res, ini)
    assert ini.state is State.CLOSED


def test_replayed_frames_fail() -> None:
    """A recorded good initiator, replayed to a new responder, cannot pass its AUTH; a
    recorded responder, replayed to a new initiator, cannot pass its proof."""
    ini, res = pair()
    ini.start()
    hello = pump(ini, res)
    reply = pump(res, ini)
    auth = pump(ini, res)
    pump(res, ini)
    assert ini.done and res.done
    # The initiator's frames to a fresh responder (a fresh challenge).
    res2 = PeerHandshake(Role.RESPONDER, B, 1, SECRET, 0.0)
    res2.receive(hello[0], 0.0)
    with pytest.raises(Unauthorized):
        res2.receive(auth[0], 0.0)
    # The responder's reply to a fresh initiator (a fresh nonce).
    ini2 = PeerHandshake(Role.INITIATOR, A, 1, SECRET, 0.0, expect=(B.node, 0, B.addrs[1]))
    ini2.start()
    with pytest.raises(Unauthorized, match="did not prove"):
        ini2.receive(reply[0], 0.0)
    # And a finished end takes no second HELLO.
    with pytest.raises(BadFrame, match="after the handshake"):
        res.receive(hello[0], 0.0)


def test_timeout_by_advancing_the_clock() -> None:
    ini, res = pair(now=100.0)
    ini.start()
    pump(ini, res, now=101.0)
    ini.tick(104.9)
    res.tick(104.9)
    with pytest.raises(Timeout):
        res.tick(105.0)
    assert res.state is State.CLOSED
    # A frame that arrives late is a timeout too, whatever it holds.
    with pytest.raises(Timeout):
        pump(res, ini, now=200.0)
    assert ini.state is State.CLOSED


def test_the_initiator_checks_it_reached_whom_it_dialled() -> None:
    """A client naming node B at another address: whoever answers there is not B."""
    ini, res = pair(expect=(0xB, 0, b"127.0.0.9:9999"))
    exc = _run_until_failure(ini, res)
    assert isinstance(exc, Unauthorized)
    assert "127.0.0.9:9999" in str(exc) and "127.0.0.5:2001" in str(exc)
    ini, res = pair(expect=(0xC, 0, B.addrs[1]))
    exc = _run_until_failure(ini, res)
    assert isinstance(exc, Unauthorized) and "not as node 000000000000000c" in str(exc)


def _hello(**change: Any) -> Frame:
    body: dict[str, Any] = {"v": VERSION, "node": A.node, "group": 0, "rail": 1,
                            "addrs": list(A.addrs), "nonce": bytes(32), "auth": "hmac-sha256"}
    body.update(change)
    for k in [k for k, v in change.items() if v is None]:
        del body[k]
    return frames(encode_frame(PeerCommand.HELLO, 0, 0, body))[0]


@pytest.mark.parametrize(("change", "error", "words"), [
    ({"v": 1}, BadFrame, "version"),  # a daemon of the msgpack data phase
    ({"v": VERSION + 1}, BadFrame, "version"),
    ({"node": -1}, BadFrame, "'node'"),
    ({"node": 0}, BadFrame, "node id 0"),
    ({"node": "A"}, BadFrame, "'node'"),
    ({"group": 1 << 20}, BadFrame, "'group'"),
    ({"rail": 0}, BadRequest, "rail 0 on this daemon's rail 1"),
    ({"addrs": [b"x"]}, BadRequest, "rail count mismatch"),
    ({"addrs": "127.0.0.1"}, BadFrame, "'addrs'"),
    ({"addrs": [b"", b"y"]}, BadFrame, "'addrs'"),
    ({"addrs": [b"x" * 300, b"y"]}, BadFrame, "'addrs'"),
    ({"nonce": b"short"}, BadFrame, "'nonce'"),
    ({"nonce": None}, BadFrame, "'nonce'"),
    ({"auth": None}, Unauthorized, "requires the cluster secret"),
])
def test_malformed_hello_fields_are_typed_errors(change: dict[str, Any],
                                                 error: type[TransferdError], words: str) -> None:
    res = PeerHandshake(Role.RESPONDER, B, 1, SECRET, 0.0)
    with pytest.raises(error, match=words):
        res.receive(_hello(**change), 0.0)
    assert res.state is State.CLOSED
    (err,) = frames(res.data_to_send())
    assert err.is_error and err.body["code"] == error.code.value


def test_frames_out_of_turn() -> None:
    res = PeerHandshake(Role.RESPONDER, B, 1, SECRET, 0.0)
    write = frames(encode_frame(PeerCommand.WRITE, 0, 0, {"op": 1}))[0]
    with pytest.raises(NoHello):
        res.receive(write, 0.0)
    res = PeerHandshake(Role.RESPONDER, B, 1, SECRET, 0.0)
    res.receive(_hello(), 0.0)
    with pytest.raises(Unauthorized, match="where AUTH is due"):
        res.receive(write, 0.0)
    # An initiator takes no HELLO request, no probe once it has a secret.
    ini, _ = pair()
    ini.start()
    with pytest.raises(BadFrame):
        ini.receive(_hello(), 0.0)
    ini, _ = pair()
    ini.start()
    with pytest.raises(BadFrame, match="probe nobody expected"):
        ini.probe(bytes(32), 0.0)
    # A handshake frame with a payload is refused even where its cmd is due.
    res = PeerHandshake(Role.RESPONDER, B, 1, SECRET, 0.0)
    f = _hello()
    f.payload_len = 1
    with pytest.raises(BadFrame, match="no payload"):
        res.receive(f, 0.0)


def test_every_transition_is_in_the_table() -> None:
    """The table is the whole story: each row's source is a live state, and the two
    terminal states are reached by every role."""
    for (role, state, _what), to in TRANSITIONS.items():
        assert state is not State.CLOSED
        assert isinstance(role, Role) and isinstance(to, State)
    assert {to for to in TRANSITIONS.values()} >= {State.READY, State.CLOSED}


def test_pre_handshake_cap_is_small() -> None:
    """What a stranger can make a link hold before it authenticated: one 4 KiB body."""
    d = FrameDecoder(max_body=MAX_HANDSHAKE_BODY, max_payload=0)
    with pytest.raises(TooLarge):
        d.feed(encode_frame(PeerCommand.HELLO, 0, 0, None, payload_len=1))
    d = FrameDecoder(max_body=MAX_HANDSHAKE_BODY, max_payload=0)
    with pytest.raises(TooLarge):
        d.feed(encode_header(PeerCommand.HELLO, 0, 0, MAX_HANDSHAKE_BODY + 1, 0))
