"""The data phase of the sans-IO connections, in memory (issue 18.1): no sockets, no loop.

A ClientConnection and a ServerConnection wired to each other through their decoders, a
toy command table on the server side (memory of 64 bytes: SET_TENSOR lands its payload
through the sink, GET_TENSOR answers with a view of it, SYNCHRONIZE is answered later,
anything else an error), and the clock as a number.  What is checked: requests pipeline
on the client and run one at a time, in order, on the server (the gate); a frame split
at every byte decodes the same; limits both ways; NO_REPLY and EVENT frames; the verdict
timing given an admission; close and loss in every phase.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest

from transferd.protocol import auth
from transferd.protocol.connection import (
    CLIENT_TRANSITIONS,
    SERVER_TRANSITIONS,
    Answer,
    ClientConnection,
    ConnState,
    IllegalTransition,
    Input,
    Notice,
    Outgoing,
    Phase,
    Ready,
    Refused,
    ServerConnection,
    ServerSettings,
)
from transferd.protocol.constants import Command, ErrorCode, Flag
from transferd.protocol.errors import (
    BadFrame,
    ConnectionLost,
    NotFound,
    OverLimit,
    TooLarge,
    TransferdError,
)
from transferd.protocol.frames import Frame, FrameDecoder, Sink, encode_frame, encode_header

SECRET = b"correct horse battery staple"
_REPLY = int(Flag.REPLY)
_NR = int(Flag.NO_REPLY)


def counter_random() -> Any:
    n = itertools.count(1)
    return lambda k: next(n).to_bytes(k, "big")


@dataclass(eq=False)
class Token:
    """What the client registers with a request (ClientConnection's Pending)."""

    cmd: int
    sink: Any = None


class Toy:
    """A server's dispatch for a few commands over 64 bytes of memory."""

    def __init__(self) -> None:
        self.memory = bytearray(64)
        self.sunk: list[int] = []  # seqs whose payload sink was asked for, in order
        self.ran: list[int] = []

    def sink(self, frame: Frame) -> Sink:
        self.sunk.append(frame.seq)
        _b, o, n = frame.body["tensor"]
        if o + n > len(self.memory):
            raise NotFound(f"no {n} bytes at {o}")
        return [memoryview(self.memory)[o:o + n]]

    def run(self, conn: ServerConnection, f: Frame) -> bool:
        """Run one request (what it answers is written: queued in ``conn.out`` here);
        False when it is left running (SYNCHRONIZE)."""
        self.ran.append(f.seq)
        if f.cmd == Command.SET_TENSOR:
            written(conn, conn.answer(f))
        elif f.cmd == Command.GET_TENSOR:
            _, o, n = f.body["tensor"]
            written(conn, conn.answer(f, payload=[memoryview(self.memory)[o:o + n]]))
        elif f.cmd == Command.SYNCHRONIZE:
            return False
        elif f.cmd == Command.FREE_BUFFER:
            written(conn, conn.fail(f, NotFound("no such buffer")))
        else:
            written(conn, conn.answer(f, {"cmd": f.cmd}))
        return True


def written(conn: ServerConnection | ClientConnection, out: Outgoing | None) -> bool:
    """What the I/O layer does with a frame a method returns: write it (here: queue it
    with the connection's own frames, for take_output)."""
    if out is None:
        return False
    conn.out.append(out)
    return True


def req(c: ClientConnection, *args: Any, **kw: Any) -> int:
    written(c, c.request(*args, **kw))
    return c.last_seq


def server(toy: Toy, **kw: Any) -> ServerConnection:
    kw.setdefault("limits", {"max_tensors": 4})
    return ServerConnection(ServerSettings(**kw), now=0.0, random=counter_random(),
                            payload_sink=toy.sink)


def wire(out: list[Any]) -> bytes:
    return b"".join(o.head + b"".join(bytes(p) for p in o.payload) for o in out)


def feed(d: FrameDecoder, data: bytes) -> None:
    view = memoryview(data)
    while view:
        buf = d.get_buffer(len(view))
        n = min(len(buf), len(view))
        assert n, "the decoder took no bytes"
        buf[:n] = view[:n]
        d.buffer_updated(n)
        view = view[n:]


def pump(srv: ServerConnection, toy: Toy, *, now: float = 0.0) -> list[Any]:
    """The session's loop: every event the gate lets out; requests run by the toy (one
    refused by the connection's checks is answered with its error, as the session does)."""
    events = []
    while (ev := srv.next_event(now)) is not None:
        if isinstance(ev, Frame) and ev.refused is not None:
            written(srv, srv.fail(ev, ev.refused))
            continue
        events.append(ev)
        if isinstance(ev, Frame) and not toy.run(srv, ev):
            break
    return events


def ready_pair(toy: Toy, **kw: Any) -> tuple[ClientConnection, ServerConnection]:
    c = ClientConnection(random=counter_random(), secret=kw.pop("client_secret", None))
    s = server(toy, **kw)
    c.start()
    for _ in range(4):
        feed(s.decoder, wire(c.take_output()))
        pump(s, toy)
        feed(c.decoder, wire(s.take_output()))
        while c.next_event() is not None:
            pass
    assert c.state is ConnState.READY and s.state is ConnState.READY
    return c, s


def client_events(c: ClientConnection) -> list[Any]:
    out = []
    while (ev := c.next_event()) is not None:
        out.append(ev)
    return out


# -- pipelining and the gate -----------------------------------------------------------------


def test_requests_pipeline_and_run_one_at_a_time_in_order() -> None:
    toy = Toy()
    c, s = ready_pair(toy)
    tokens = []
    for i in range(6):  # SET i, then GET of what it wrote, three times over
        t = Token(int(Command.SET_TENSOR))
        req(c, Command.SET_TENSOR, {"tensor": [1, 8 * i, 4]}, [bytes([i]) * 4], token=t)
        tokens.append(t)
        g = Token(int(Command.GET_TENSOR))
        req(c, Command.GET_TENSOR, {"tensor": [1, 8 * i, 4]}, token=g)
        tokens.append(g)
    feed(s.decoder, wire(c.take_output()))  # all twelve in the server's buffer at once
    pump(s, toy)
    assert toy.ran == list(range(2, 14))  # seqs in wire order (HELLO was 1)
    feed(c.decoder, wire(s.take_output()))
    answers = client_events(c)
    assert [a.token for a in answers] == tokens
    assert all(isinstance(a, Answer) and a.error is None for a in answers)
    for i in range(6):
        assert answers[2 * i + 1].frame.payload == bytes([i]) * 4
    assert c.pending == {}


def test_a_running_request_holds_the_frames_behind_it_and_their_payloads() -> None:
    """The gate: while SYNCHRONIZE runs, the SET behind it is not handed out, and its
    payload's sink is not even asked (it may overwrite what an earlier command reads)."""
    toy = Toy()
    c, s = ready_pair(toy)
    req(c, Command.SYNCHRONIZE, token=Token(int(Command.SYNCHRONIZE)))
    req(c, Command.SET_TENSOR, {"tensor": [1, 0, 8]}, [b"x" * 8],
              token=Token(int(Command.SET_TENSOR)))
    feed(s.decoder, wire(c.take_output()))
    (sync,) = pump(s, toy)
    assert isinstance(sync, Frame) and sync.cmd == Command.SYNCHRONIZE
    assert s.phase is Phase.RUNNING and not s.wants_read
    assert s.next_event() is None and s.next_event() is None and toy.sunk == []
    assert written(s, s.answer(sync))  # it finished
    assert s.phase is Phase.IDLE and s.wants_read
    (set_,) = pump(s, toy)
    assert set_.cmd == Command.SET_TENSOR and toy.sunk == [set_.seq]
    assert toy.memory[:8] == b"x" * 8


def test_blocked_output_stops_the_gate_until_it_drains() -> None:
    toy = Toy()
    c, s = ready_pair(toy)
    for _ in range(3):
        req(c, Command.STATS, token=Token(int(Command.STATS)))
    feed(s.decoder, wire(c.take_output()))
    f = s.next_event()
    assert isinstance(f, Frame)
    s.output_blocked()  # the reply about to be written filled the transport
    toy.run(s, f)
    assert s.next_event() is None and not s.wants_read
    s.output_drained()
    assert len(pump(s, toy)) == 2


@pytest.mark.parametrize("cut_every", [1, 2, 7, 24, 25])
def test_a_stream_split_anywhere_decodes_the_same(cut_every: int) -> None:
    """HELLO, a SET with its payload, a GET and a one-way failure, fed in pieces of every
    size down to one byte: the same requests, the same replies."""
    frames = (encode_frame(Command.HELLO, 0, 1, {"major": 1, "minor": 2, "client": "c"})
              + encode_frame(Command.SET_TENSOR, 0, 2, {"tensor": [1, 4, 5]}, 5) + b"hello"
              + encode_frame(Command.GET_TENSOR, 0, 3, {"tensor": [1, 4, 5]})
              + encode_frame(Command.FREE_BUFFER, _NR, 4, {"buffer": 9}))
    results = []
    for split in (None, cut_every):
        toy = Toy()
        s = server(toy)
        events: list[Any] = []
        pieces = [frames] if split is None else [frames[i:i + split]
                                                 for i in range(0, len(frames), split)]
        for p in pieces:
            feed(s.decoder, p)
            events += pump(s, toy)
        results.append(([type(e).__name__ for e in events], toy.ran, bytes(toy.memory),
                         wire(s.take_output())))
    assert results[0] == results[1]
    names, ran, memory, out = results[1]
    assert names == ["Ready", "Frame", "Frame", "Frame"] and ran == [2, 3, 4]
    assert memory[4:9] == b"hello"
    replies = FrameDecoder().feed(out)
    assert [(r.seq, int(r.flags)) for r in replies] == [
        (1, _REPLY), (2, _REPLY), (3, _REPLY), (4, int(Flag.EVENT | Flag.ERROR))]
    assert replies[2].payload == b"hello"


# -- checks, limits, NO_REPLY, EVENT ---------------------------------------------------------


def test_every_request_is_checked_before_it_runs() -> None:
    toy = Toy()
    _c, s = ready_pair(toy, minor=1, served={int(Command.STATS), int(Command.SET_TENSOR)})
    bad = [
        encode_frame(Command.STATS, int(Flag.REPLY), 2),  # a reply's flag on a request
        encode_frame(0x7E, 0, 3),  # no such command
        encode_frame(Command.GET_TENSORS, 0, 4, {"tensors": []}),  # minor 2, server acts 1
        encode_frame(Command.AUTH, 0, 5, {"mac": b"x" * 32}),  # already authenticated
        encode_frame(Command.GET_DEVICES, 0, 6),  # not served here
        encode_frame(Command.SET_TENSOR, 0, 7, {"tensor": [1, 60, 8]}, 8) + b"12345678",
    ]
    feed(s.decoder, b"".join(bad) + encode_frame(Command.STATS, 0, 8))
    events = pump(s, toy)
    assert [e.seq for e in events] == [8]  # only the good one ran
    assert toy.sunk == [7]  # the SET's sink was asked and refused: its payload dropped
    out = FrameDecoder().feed(wire(s.take_output()))
    assert [(f.seq, f.body.get("code")) for f in out] == [
        (2, "BAD_REQUEST"), (3, "UNKNOWN_COMMAND"), (4, "UNKNOWN_COMMAND"),
        (5, "BAD_REQUEST"), (6, "UNKNOWN_COMMAND"), (7, "NOT_FOUND"), (8, None)]
    assert s.state is ConnState.READY


def test_limits_both_ways() -> None:
    toy = Toy()
    c, s = ready_pair(toy, max_body=4096, max_payload=1024)
    # The client never sends a frame over the announced limits (the server would close).
    with pytest.raises(OverLimit, match="max_payload"):
        req(c, Command.SET_TENSOR, {"tensor": [1, 0, 1025]}, [bytes(1025)])
    with pytest.raises(OverLimit, match="max_body"):
        req(c, Command.STATS, {"x": "y" * 5000})
    assert c.take_output() == [] and c.pending == {} and c.state is ConnState.READY
    # A per-request cap (max_tensors 4, enforced by the decoder): refused, the connection
    # goes on, and the client raises it as OverLimit.
    t = Token(int(Command.GET_TENSORS))
    req(c, Command.GET_TENSORS, {"tensors": [[1, 0, 1]] * 5}, token=t)
    req(c, Command.STATS, token=Token(int(Command.STATS)))
    feed(s.decoder, wire(c.take_output()))
    assert [e.seq for e in pump(s, toy)] == [3]
    feed(c.decoder, wire(s.take_output()))
    refused, ok = client_events(c)
    assert refused.token is t and type(refused.error) is OverLimit and ok.error is None
    # The same cap on a SET_TENSORS with its payload: refused before its sink is asked,
    # the payload read and dropped, the next frame served.
    feed(s.decoder, encode_frame(Command.SET_TENSORS, 0, 7, {"tensors": [[1, 0, 1]] * 5}, 5)
         + b"xxxxx" + encode_frame(Command.STATS, 0, 8))
    assert [e.seq for e in pump(s, toy)] == [8] and toy.sunk == []
    over, _ = FrameDecoder().feed(wire(s.take_output()))
    assert over.seq == 7 and over.body["code"] == "TOO_LARGE" and s.state is ConnState.READY
    # A raw frame over max_body: TOO_LARGE from its header, and the connection closes.
    feed(s.decoder, encode_header(Command.STATS, 0, 9, 4097, 0))
    (ev,) = pump(s, toy)
    assert isinstance(ev, Refused) and type(ev.error) is TooLarge
    assert s.state is ConnState.CLOSING and s.should_close
    (f,) = FrameDecoder().feed(wire(s.take_output()))
    assert f.seq == 9 and f.body["code"] == "TOO_LARGE"


def test_no_reply_answers_nothing_and_its_failure_is_an_event() -> None:
    toy = Toy()
    c, s = ready_pair(toy)
    req(c, Command.SET_TENSOR, {"tensor": [1, 0, 2]}, [b"ok"], flags=_NR)
    req(c, Command.FREE_BUFFER, {"buffer": 9}, flags=_NR)
    assert c.pending == {}  # one-way: nothing to wait for
    feed(s.decoder, wire(c.take_output()))
    pump(s, toy)
    (f,) = FrameDecoder().feed(wire(s.take_output()))
    assert int(f.flags) == int(Flag.EVENT | Flag.ERROR) and f.seq == 3
    feed(c.decoder, wire([*s.take_output()]) or encode_frame(f.cmd, f.flags, f.seq, f.body))
    (n,) = client_events(c)
    assert isinstance(n, Notice) and isinstance(n.error, NotFound) and not n.error.fatal
    # A fatal failure of a one-way command is a REPLY|ERROR and closes.
    req(c, Command.FREE_BUFFER, {"buffer": 9}, flags=_NR)
    feed(s.decoder, wire(c.take_output()))
    f = s.next_event()
    assert isinstance(f, Frame)
    assert written(s, s.fail(f, BadFrame("that was not a frame")))
    assert s.state is ConnState.CLOSING
    (r,) = FrameDecoder().feed(wire(s.take_output()))
    assert int(r.flags) == int(Flag.REPLY | Flag.ERROR)


def test_event_frames_go_out_only_while_ready() -> None:
    toy = Toy()
    pre = server(toy)
    assert pre.event(Command.EVENT, 0, {"x": 1}) is None
    c, s = ready_pair(toy)
    assert written(s, s.event(Command.SUBMIT_RECVS, 42, {"len": 3},
                              payload=[memoryview(b"abc")]))
    assert written(s, s.event(Command.SINGLE_WRITE, 43, {"code": "TIMEOUT", "message": "m"},
                              error=True))
    feed(c.decoder, wire(s.take_output()))
    a, b = client_events(c)
    assert isinstance(a, Notice) and a.error is None and a.frame.payload == b"abc"
    assert isinstance(b, Notice) and b.error is not None and b.error.code is ErrorCode.TIMEOUT
    s.close()
    assert s.event(Command.EVENT, 0) is None and s.take_output() == []


def test_the_client_matches_replies_and_loses_what_waits() -> None:
    toy = Toy()
    c, s = ready_pair(toy)
    t1, t2 = Token(int(Command.STATS)), Token(int(Command.STATS))
    seq1 = req(c, Command.STATS, token=t1)
    req(c, Command.STATS, token=t2)
    assert c.forget(seq1) is t1  # timed out: its late reply is dropped
    feed(s.decoder, wire(c.take_output()))
    pump(s, toy)
    feed(c.decoder, wire(s.take_output()))
    (ans,) = client_events(c)
    assert ans.token is t2
    # An error for a seq nobody waits for: a Refused (the asyncio layer keeps it).
    feed(c.decoder, encode_frame(Command.STATS, int(Flag.REPLY | Flag.ERROR), 99,
                                 {"code": "NOT_FOUND", "message": "?"}))
    (r,) = client_events(c)
    assert isinstance(r, Refused) and isinstance(r.error, NotFound)
    t3 = Token(int(Command.STATS))
    req(c, Command.STATS, token=t3)
    assert c.lose(ConnectionLost("gone")) == [t3] and c.state is ConnState.CLOSED
    with pytest.raises(ConnectionLost, match="gone"):
        req(c, Command.STATS)


def test_a_broken_stream_is_refused_once() -> None:
    toy = Toy()
    c, _ = ready_pair(toy)
    feed(c.decoder, b"XX" + bytes(30))
    (r,) = client_events(c)
    assert isinstance(r, Refused) and isinstance(r.error, BadFrame)
    assert c.state is ConnState.CLOSING and c.next_event() is None


# -- the end: half-close, close and loss in every phase ---------------------------------------


def test_a_half_close_runs_what_was_sent_then_closes() -> None:
    toy = Toy()
    c, s = ready_pair(toy)
    req(c, Command.SYNCHRONIZE, token=Token(int(Command.SYNCHRONIZE)))
    req(c, Command.STATS, token=Token(int(Command.STATS)))
    feed(s.decoder, wire(c.take_output()))
    assert s.eof()
    (sync,) = pump(s, toy)
    assert not s.should_close  # SYNCHRONIZE runs, the STATS behind it is still due
    written(s, s.answer(sync))
    assert [e.cmd for e in pump(s, toy)] == [Command.STATS]
    assert s.state is ConnState.CLOSING and s.should_close
    assert len(FrameDecoder().feed(wire(s.take_output()))) == 2
    # Before READY a half-close means nothing more will come: close now.
    assert not server(Toy()).eof()


def _in_phase(phase: Phase) -> ServerConnection:
    toy = Toy()
    s = server(toy, secret=SECRET, token_allowed=True)
    if phase is Phase.HELLO:
        return s
    if phase is Phase.AUTH:
        feed(s.decoder, encode_frame(Command.HELLO, 0, 1, {
            "major": 1, "minor": 2, "auth": auth.HMAC_SHA256, "nonce": b"n" * 32}))
        pump(s, toy)
    elif phase is Phase.VERDICT:
        s.verdicts = FixedVerdicts(held_until=3.0)
        feed(s.decoder, encode_frame(Command.HELLO, 0, 1, {"major": 1, "minor": 2,
                                                           "token": SECRET.decode()}))
        pump(s, toy)
    else:
        feed(s.decoder, encode_frame(Command.HELLO, 0, 1, {"major": 1, "minor": 2,
                                                           "token": SECRET.decode()}))
        pump(s, toy)
        if phase is Phase.RUNNING:
            feed(s.decoder, encode_frame(Command.SYNCHRONIZE, 0, 2))
            pump(s, toy)
        elif phase is Phase.CLOSING:
            s.close()
    s.take_output()
    assert s.phase is phase
    return s


@pytest.mark.parametrize("phase", [p for p in Phase if p is not Phase.CLOSED])
def test_close_and_loss_in_every_phase(phase: Phase) -> None:
    s = _in_phase(phase)
    s.close()
    assert s.state is ConnState.CLOSING and s.next_event() is None and not s.wants_read
    # A request that was running may still end: its answer is dropped.
    assert s.answer(Frame(int(Command.SYNCHRONIZE), 0, 2, {})) is None
    assert s.event(Command.EVENT, 0) is None
    s.connection_lost()
    assert s.state is ConnState.CLOSED
    assert s.next_event() is None and s.handle_timeout(1e9) == []
    with pytest.raises(IllegalTransition):
        s._go(Input.CLOSE)
    # Lost without a close first, from the same phase.
    t = _in_phase(phase)
    t.connection_lost()
    assert t.state is ConnState.CLOSED


def test_both_tables_end_in_closed_from_everywhere() -> None:
    for table in (SERVER_TRANSITIONS, CLIENT_TRANSITIONS):
        for phase, row in table.items():
            assert row[Input.LOST] is Phase.CLOSED, phase
            if phase is not Phase.CLOSED:
                assert row[Input.CLOSE] is Phase.CLOSING, phase
        assert set(table[Phase.CLOSED]) == {Input.LOST}
    # Only the server has a request gate (RUNNING) and a held verdict (VERDICT).
    assert Phase.RUNNING not in CLIENT_TRANSITIONS and Phase.VERDICT not in CLIENT_TRANSITIONS


# -- verdicts held by the admission ---------------------------------------------------------


@dataclass
class FixedVerdicts:
    """An admission's answers, fixed: failures answered at ``fail_at`` (None: never),
    successes held until ``held_until``."""

    fail_at: float | None = 2.0
    held_until: float = 0.0

    def failed(self, now: float) -> tuple[float | None, int]:
        return self.fail_at, 3

    def success_at(self, now: float) -> float | None:
        return max(now, self.held_until) if self.held_until < 1e9 else None


def _token_hello(token: str) -> bytes:
    return encode_frame(Command.HELLO, 0, 1, {"major": 1, "minor": 2, "token": token})


def test_a_wrong_guess_is_answered_at_its_turn() -> None:
    toy = Toy()
    s = server(toy, secret=SECRET, token_allowed=True, handshake_timeout=5.0)
    s.verdicts = FixedVerdicts(fail_at=2.0)
    feed(s.decoder, _token_hello("wrong"))
    (ev,) = pump(s, toy)
    assert isinstance(ev, Refused) and ev.guess and ev.answer_at == 2.0 and ev.failures == 3
    assert s.state is ConnState.CLOSING and not s.should_close and s.timer_at == 2.0
    assert s.take_output() == [] and s.handle_timeout(1.9) == []
    s.handle_timeout(2.0)
    (f,) = FrameDecoder().feed(wire(s.take_output()))
    assert f.body["code"] == "UNAUTHORIZED" and s.should_close


def test_an_unanswerable_guess_and_a_late_success_get_the_same_timeout() -> None:
    answers = []
    for token, verdicts in (("wrong", FixedVerdicts(fail_at=None)),
                            (SECRET.decode(), FixedVerdicts(held_until=1e9))):
        toy = Toy()
        s = server(toy, secret=SECRET, token_allowed=True, handshake_timeout=5.0)
        s.verdicts = verdicts
        feed(s.decoder, _token_hello(token))
        pump(s, toy)
        assert s.timer_at == 5.0 and s.take_output() == []
        (ev,) = s.handle_timeout(5.0)
        assert isinstance(ev, Refused) and ev.error.code is ErrorCode.TIMEOUT
        (f,) = FrameDecoder().feed(wire(s.take_output()))
        answers.append((f.cmd, f.seq, f.flags, f.body))
        assert s.should_close
    assert answers[0] == answers[1]  # nothing tells a guesser which one was right


def test_a_good_token_waits_behind_failures_then_runs_what_followed_it() -> None:
    toy = Toy()
    s = server(toy, secret=SECRET, token_allowed=True)
    s.verdicts = FixedVerdicts(held_until=3.0)
    feed(s.decoder, _token_hello(SECRET.decode()) + encode_frame(Command.STATS, 0, 2))
    assert pump(s, toy, now=1.0) == []
    assert s.phase is Phase.VERDICT and s.state is ConnState.AUTH and not s.wants_read
    assert s.timer_at == 3.0 and s.take_output() == []
    (ready,) = s.handle_timeout(3.0)
    assert isinstance(ready, Ready) and ready.method == "token"
    assert [e.seq for e in pump(s, toy, now=3.0)] == [2]  # the pipelined STATS
    hello, stats = FrameDecoder().feed(wire(s.take_output()))
    assert hello.cmd == Command.HELLO and hello.body["auth"] and stats.seq == 2


def test_a_slot_that_gives_way_is_told_why() -> None:
    toy = Toy()
    s = server(toy, secret=SECRET)
    (ev,) = s.give_way("the cap per source")
    assert isinstance(ev, Refused) and "cap per source" in ev.error.message
    (f,) = FrameDecoder().feed(wire(s.take_output()))
    assert f.body["code"] == "TIMEOUT" and s.should_close
    _c, ready = ready_pair(Toy())
    assert ready.give_way("late") == []  # authenticated: it holds no slot


def test_an_error_reply_during_the_handshake_is_typed() -> None:
    c = ClientConnection(secret=SECRET, address="tcp://h:1")
    c.start()
    c.take_output()
    feed(c.decoder, encode_frame(Command.STATS, _REPLY, 7, {"x": 1}))
    (r,) = client_events(c)
    assert isinstance(r, Refused) and isinstance(r.error, TransferdError)
    assert "tcp://h:1" in r.error.message and c.state is ConnState.CLOSING
