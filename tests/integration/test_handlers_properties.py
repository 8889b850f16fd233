"""Property tests of every command handler (issue 11, hostile input), through the real
dispatch: a real Session over a real socket, the real BufferTable and engine.

For every command code (and codes nobody serves), bodies with fields missing, of the
wrong type, huge, negative or nested, extra keys, any flags and payload sizes: every
frame the daemon sends back is a reply or an event, every error carries a known code
and is never INTERNAL (an untyped exception out of a handler), the connection either
answers the STATS probe sent after the hostile frames or was closed after a fatal error,
nothing is logged at ERROR, and a fresh client is served afterwards.

Most examples run against :class:`fuzzing.harness.InProcessDaemon` (the daemon's own
objects in this process: fast); a few go to a live ``rpc-server`` subprocess.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzzing.harness import Exchange, InProcessDaemon
from tests.helpers import RawConn, start_daemon
from tests.hostile import EDGE_INTS, U32, bodies, floats, ints, values
from transferd.protocol.constants import DEFAULT_MAX_BODY, DEFAULT_MAX_PAYLOAD, Command, Flag
from transferd.protocol.frames import encode_frame

# What the strategies name: filled in (and kept current) by the harness.
KNOWN: dict[str, Any] = {}


def known(name: str, i: int | None = None) -> st.SearchStrategy[Any]:
    """A real object of the daemon, looked up when drawn (reset() may renew them)."""
    return st.just(None).map(lambda _: KNOWN[name] if i is None else KNOWN[name][i])


buffer_ids = st.one_of(st.integers(0, 2).flatmap(lambda i: known("buffers", i)),
                       st.integers(0, 64), st.sampled_from(EDGE_INTS))
offsets = st.one_of(st.sampled_from([0, 1, 8, 4095, 4096, 4097, (1 << 20) - 1, 1 << 20]),
                    st.sampled_from(EDGE_INTS), floats)
tensor = st.one_of(st.tuples(buffer_ids, offsets, offsets).map(list), values)
u32s = st.one_of(st.integers(0, 8), st.sampled_from(EDGE_INTS), floats)
small = st.one_of(st.integers(0, 4096), st.sampled_from(EDGE_INTS), floats)


def netaddr(node: int, group: int, rails: list[Any], fmt: int = 2) -> bytes:
    return msgpack.packb([fmt, node, group, rails])


addr_bytes = st.one_of(
    known("addr"),
    st.builds(netaddr, st.integers(1, 5), st.integers(0, 3),
              st.lists(st.sampled_from([b"127.0.0.1:1", b"127.0.0.1:99999", b"::1:0", b"x",
                                        b"", b"127.0.0.1"]), max_size=3)),
    st.builds(netaddr, ints, ints, st.lists(st.tuples(st.sampled_from(["127.0.0.1", "h"]),
                                                      st.one_of(ints, st.floats())).map(list),
                                            max_size=2), st.just(1)),
    st.binary(max_size=24), values,
)
desc = st.one_of(known("desc"), st.tuples(ints, ints, st.lists(
    st.tuples(addr_bytes, ints).map(list), max_size=2)).map(list), values)
pages = st.one_of(st.tuples(st.lists(u32s, max_size=4), small, small).map(list), values)

FIELDS: dict[int, dict[str, st.SearchStrategy[Any]]] = {
    Command.HELLO: {"major": st.just(1), "minor": u32s, "client": st.text(max_size=4)},
    Command.ALLOC_BUFFER: {"device": st.sampled_from(["cpu", "shm", "cuda:0", "x", ""]),
                           "size": small, "ipc_handle": st.binary(max_size=8),
                           "ipc_offset": small},
    Command.FREE_BUFFER: {"buffer": st.integers(4, 40)},
    Command.BUFFER_CLEAR: {"buffer": buffer_ids, "value": st.sampled_from([0, 7, 255, 256, -1])},
    Command.SET_TENSOR: {"tensor": tensor},
    Command.GET_TENSOR: {"tensor": tensor},
    Command.COPY_TENSOR: {"src": tensor, "dst": tensor},
    Command.STATS: {"buffers": st.sampled_from([True, False, 1])},
    Command.AUTH: {"mac": st.binary(max_size=32)},
    Command.GET_TENSORS: {"tensors": st.lists(tensor, max_size=5)},
    Command.SET_TENSORS: {"tensors": st.lists(tensor, max_size=5)},
    Command.REG_MR: {"buffer": buffer_ids},
    Command.DEREG_MR: {"mr": st.one_of(known("mr"), u32s)},
    Command.SINGLE_WRITE: {"len": small, "imm": st.one_of(st.none(), u32s),
                           "src": st.tuples(st.one_of(known("mr"), u32s), small).map(list),
                           "dst": st.tuples(desc, small).map(list)},
    Command.PAGED_WRITES: {"page_len": small, "imm": st.one_of(st.none(), u32s),
                           "src": st.tuples(st.one_of(known("mr"), u32s), pages).map(list),
                           "dst": st.tuples(desc, pages).map(list)},
    Command.EXPECT_IMM_COUNT: {"imm": u32s, "count": u32s},
    Command.ADD_PEER_GROUP: {"addrs": st.lists(addr_bytes, max_size=3)},
    Command.SCATTER: {"mr": st.one_of(known("mr"), u32s), "imm": st.one_of(st.none(), u32s),
                      "group": st.one_of(st.none(), u32s),
                      "dsts": st.lists(st.tuples(small, small, desc, small).map(list),
                                       max_size=3)},
    Command.BARRIER: {"imm": u32s, "group": st.one_of(st.none(), u32s),
                      "dsts": st.lists(desc, max_size=3)},
    Command.SEND: {"addr": addr_bytes},
    Command.SUBMIT_RECVS: {"len": small, "count": u32s},
    Command.ALLOC_UVM_WATCHER: {"buffer": st.one_of(st.none(), buffer_ids), "offset": offsets},
    Command.IMM_COUNT: {"imm": u32s},
}
deadline = {"timeout_ms": st.one_of(st.sampled_from([1, 50, 1000]), u32s)}
for _c in (Command.SINGLE_WRITE, Command.PAGED_WRITES, Command.SCATTER, Command.BARRIER,
           Command.SEND, Command.EXPECT_IMM_COUNT):
    FIELDS[_c].update(deadline)
FIELDS[Command.ALLOC_BUFFER].update(
    owner=st.sampled_from(["daemon", "connection", "lease", "x"]),
    lease=st.sampled_from(["a", "b" * 129, ""]))
# Commands newer than this file get their fields where they exist (leases, CANCEL).
for _name, _fields in (("LEASE", {"lease": st.sampled_from(["a", "b", "c" * 129, ""]),
                                  "ttl_ms": small}),
                       ("END_LEASE", {"lease": st.sampled_from(["a", "b", ""])}),
                       ("CANCEL", {"seq": st.one_of(st.integers(0, 12), u32s)})):
    if hasattr(Command, _name):
        FIELDS[int(getattr(Command, _name))] = _fields
# Every command (new ones get bodies of hostile values), codes nobody serves, and the peer
# plane's codes on a client connection.
CODES = sorted({int(c) for c in Command} | {0x0B, 0x12, 0x2D, 0x3E, 0x40, 0x41, 0x45, 0xFF})
EXAMPLES = 12  # per command code (make fuzz goes deeper)
TAKES_PAYLOAD = {int(Command.SET_TENSOR), int(Command.SET_TENSORS), int(Command.SEND)}


@st.composite
def hostile_frame(draw: st.DrawFn, codes: st.SearchStrategy[int] | None = None) -> bytes:
    cmd = draw(codes if codes is not None else st.sampled_from(CODES))
    body = draw(bodies(FIELDS.get(cmd, {"x": values}),
                       optional=frozenset({"imm", "group", "ipc_handle", "ipc_offset",
                                           "timeout_ms", "owner", "lease"})))
    flags = draw(st.sampled_from([0, 0, 0, int(Flag.NO_REPLY), int(Flag.NO_REPLY),
                                  int(Flag.REPLY), int(Flag.EVENT), 0x10]))
    if cmd in TAKES_PAYLOAD:
        plen = draw(st.sampled_from([0, 1, 8, 4095, 4096, 4097]))
    else:
        plen = draw(st.sampled_from([0, 0, 0, 1, 100]))
    return encode_frame(cmd, flags, draw(st.integers(2, U32 - 64)), body, plen) + bytes(plen)


@pytest.fixture(scope="module")
def inproc() -> Iterator[InProcessDaemon]:
    with InProcessDaemon() as d:
        KNOWN.clear()
        KNOWN.update(d.known)
        d.known = KNOWN  # reset() renews the objects in place
        yield d
        assert d.alive()


def check(d: InProcessDaemon, ex: Exchange) -> None:
    try:
        ex.check()
        assert not (errors := d.take_errors()), errors
    finally:
        d.reset()


@pytest.mark.parametrize("cmd", CODES, ids=[f"0x{c:02x}" for c in CODES])
def test_every_command_answers_hostile_bodies(inproc: InProcessDaemon, cmd: int) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(hostile_frame(st.just(cmd)), st.lists(hostile_frame(), max_size=2))
    def one(frame: bytes, more: list[bytes]) -> None:
        check(inproc, inproc.exchange(frame + b"".join(more)))

    one()


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.sampled_from(CODES), st.one_of(st.integers(0, 64), st.integers(0, (1 << 34) + 1)),
       st.one_of(st.integers(0, 64), st.integers(0, 1 << 23)),
       st.sampled_from([0, int(Flag.NO_REPLY)]))
def test_every_command_code_with_any_announced_size(inproc: InProcessDaemon, cmd: int,
                                                    payload_len: int, body_len: int,
                                                    flags: int) -> None:
    """A header announcing any body and payload size, followed by at most 64 bytes: over
    a limit it is TOO_LARGE from the header alone and closed; a frame sent whole gets a
    typed answer; one sent in part is waited for, and closed at the client's EOF with
    nothing answered out of nothing."""
    from transferd.protocol.frames import encode_header

    head = encode_header(cmd, flags, 9, body_len, payload_len)
    sent = min(body_len + payload_len, 64)
    ex = inproc.exchange(head + bytes(sent), timeout=30.0)
    ex.check()
    if body_len > inproc.config.server.max_body or payload_len > inproc.config.server.max_payload:
        assert ex.closed and [e["code"] for e in ex.errors()] == ["TOO_LARGE"], ex
    elif sent < body_len + payload_len and body_len > sent:
        assert not ex.probed and ex.closed and not ex.frames, ex  # the body never came
    assert not inproc.take_errors()
    inproc.reset()


# -- against a live daemon subprocess ------------------------------------------------------


@pytest.fixture(scope="module")
def live() -> Iterator[Any]:
    d = start_daemon(["-m", "64"])
    try:
        yield d
    finally:
        d.stop()


def live_exchange(d: Any, data: bytes) -> Exchange:
    """HELLO, ``data``, a STATS probe over a fresh socket, as the harness's exchange."""
    c = RawConn.to(d, timeout=30.0)
    out = Exchange()
    try:
        c.hello()
        c.send_raw(data)
        c.send(Command.STATS, seq=0xFFFFFFF0)
        while True:
            try:
                f = c.recv()
            except ConnectionError:
                out.closed = True
                return out
            except TimeoutError:
                return out  # neither answered nor closed: check() calls it a hang
            out.frames.append(f)
            if f.seq == 0xFFFFFFF0 and f.cmd == Command.STATS:
                out.probed = True
                return out
    finally:
        c.close()


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(hostile_frame(st.sampled_from([c for c in CODES if c not in (
    Command.SINGLE_WRITE, Command.PAGED_WRITES, Command.SCATTER, Command.BARRIER)])),
    min_size=1, max_size=3))
def test_a_live_daemon_answers_hostile_frames_and_serves_the_next_client(
        live: Any, frames: list[bytes]) -> None:
    KNOWN.setdefault("buffers", [1, 2, 3])
    KNOWN.setdefault("mr", 1)
    KNOWN.setdefault("desc", [0, 0, []])
    KNOWN.setdefault("addr", b"")
    ex = live_exchange(live, b"".join(frames))
    ex.whole, ex.refused = InProcessDaemon._judge_with(DEFAULT_MAX_BODY, DEFAULT_MAX_PAYLOAD,
                                                       b"".join(frames))
    ex.check()
    assert live.alive(), live.output()
    with RawConn.to(live) as fresh:
        fresh.hello()
        assert fresh.request(Command.GET_DEVICES).flags == int(Flag.REPLY)
    assert "internal error" not in live.stderr, live.stderr


INF = float("inf")


@pytest.mark.parametrize("cmd, body", [
    # bytes(1 << 40) allocated (and zeroed) a TiB: MemoryError, or the OOM killer.
    (Command.ADD_PEER_GROUP, {"addrs": [1 << 40]}),
    (Command.ADD_PEER_GROUP, {"addrs": ["127.0.0.1:1"]}),  # bytes(str): TypeError
    # int(inf) is an OverflowError, which Pages, MrDesc and NetAddr did not catch.
    (Command.PAGED_WRITES, {"page_len": 1, "src": [1, [[0], INF, 0]],
                            "dst": [[0, 0, []], [[0], 1, 0]]}),
    (Command.SINGLE_WRITE, {"len": 1, "src": [1, 0], "dst": [[INF, 0, []], 0]}),
    (Command.BARRIER, {"imm": 1, "dsts": [[0, 0, [[netaddr(1, 0, [["127.0.0.1", INF]], 1),
                                                  1]]]]}),
], ids=["peers-huge-int", "peers-str", "pages-inf", "desc-inf", "netaddr-inf"])
def test_found_by_these_properties(inproc: InProcessDaemon, cmd: int, body: Any) -> None:
    """Each was INTERNAL (an untyped exception out of a handler, a traceback in the log)."""
    ex = inproc.exchange(encode_frame(cmd, 0, 5, body))
    check(inproc, ex)
    assert [e["code"] for e in ex.errors()] == ["BAD_REQUEST"], ex
