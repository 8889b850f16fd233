"""The transfer-engine examples: two daemons, A (127.0.0.1) and B (127.0.0.2), and a peer link."""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import msgpack

from capture.live import Capture, Conn, Daemons
from capture.registry import (
    _body_of,
    _with_buffer,
    example,
    off_record,
    request_example,
    session,
)
from transferd.domains.rails import parse_rail, rail_bytes
from transferd.protocol import HEADER, Command, Flag, command_name
from transferd.protocol.frames import Frame, FrameDecoder
from transferd.protocol.peer_handshake import PeerHandshake, PeerIdentity, Role
from transferd.protocol.peer_wire import encode_send, encode_write

A_NAME, B_NAME = "daemon A", "daemon B"


def _ask(c: Conn, cmd: int, seq: int, body: dict[str, Any] | None = None,
         payload: bytes = b"", flags: int = 0) -> dict[str, Any]:
    """A request off the record; the body of the frame that answers it."""
    with off_record(c):
        c.send(cmd, seq, body, payload, flags)
        raw = c.recv()
    _, _, rflags, _, _, _, _ = HEADER.unpack_from(raw)
    body_out = msgpack.unpackb(_body_of(raw), raw=False) if _body_of(raw) else {}
    if rflags & Flag.ERROR:
        raise AssertionError(f"{command_name(cmd)} failed off the record: {body_out}")
    return dict(body_out)


def _region(c: Conn, data: bytes = b"", size: int = 64) -> tuple[int, list[Any]]:
    """A buffer registered off the record (filled with ``data``): (mr, desc)."""
    buf = _with_buffer(c, size)
    if data:
        _ask(c, Command.SET_TENSOR, 91, {"tensor": [buf, 0, len(data)]}, data)
    r = _ask(c, Command.REG_MR, 92, {"buffer": buf})
    return int(r["mr"]), r["desc"]


def _address(c: Conn) -> bytes:
    return bytes(_ask(c, Command.MAIN_ADDRESS, 93)["addr"])


@contextlib.contextmanager
def nodes(ds: Daemons, title: str) -> Iterator[tuple[Conn, Conn, Capture]]:
    """Connections to daemons A and B (started side by side), off the record.

    Set ``conn.capture = cap`` to put a connection's frames on the record.
    """
    ds.start("main", "b")
    cap = Capture(title)
    with session(ds["main"], title, server=A_NAME) as (a, _), session(
        ds["b"], title, server=B_NAME
    ) as (b, _):
        a.capture = b.capture = None
        yield a, b, cap


DATA = b"0123456789abcdef"


def _a_to_b(a: Conn, b: Conn) -> tuple[int, list[Any]]:
    """A region on A holding ``DATA`` and an empty one on B: (A's mr, B's desc)."""
    mr, _ = _region(a, DATA)
    _, desc = _region(b)
    return mr, desc


def _two_pages(mr: int, desc: list[Any]) -> dict[str, Any]:
    """PAGED_WRITES' body: A's pages 0 and 2 (4 bytes, stride 4) to B's 1 and 3 (stride 8),
    immediate 8."""
    return {"page_len": 4, "imm": 8, "src": [mr, [[0, 2], 4, 0]], "dst": [desc, [[1, 3], 8, 0]]}


request_example(
    "ENGINE_MAIN_ADDRESS",
    "MAIN_ADDRESS",
    Command.MAIN_ADDRESS,
    volatile=True,
    note="`addr` is the msgpack array `[2, node, group, [rail, ...]]`: format 2, the "
    "daemon's random 64-bit node id, domain group 0 (host memory), and its one rail's "
    'address, opaque bytes its Domain reads (tcp: `b"host:port"`).',
)
request_example(
    "ENGINE_REG_MR",
    "REG_MR of buffer 1 (64 bytes)",
    Command.REG_MR,
    lambda b: {"buffer": b},
    volatile=True,
    note="`desc` is the MrDesc `[ptr, size, [[rail NetAddr, rkey], ...]]`: one rail here, so "
    "one NetAddr (naming that rail only) and one random 64-bit rkey.",
)


@example("ENGINE_DEREG_MR")
def ex_dereg_mr(ds: Daemons) -> Capture:
    with session(ds["main"], "DEREG_MR of region 1") as (c, cap):
        mr, _ = _region(c)
        c.send(Command.DEREG_MR, 3, {"mr": mr})
        c.recv()
    return cap


@example("ENGINE_SINGLE_WRITE", volatile=True)
def ex_single_write(ds: Daemons) -> Capture:
    with nodes(
        ds, "SINGLE_WRITE of 8 bytes from A's region 1 to offset 16 of B's region, "
        "NO_REPLY, immediate 7; then B reads them back"
    ) as (a, b, cap):
        mr, desc = _a_to_b(a, b)
        a.capture = b.capture = cap
        a.send(Command.SINGLE_WRITE, 3,
               {"len": 8, "imm": 7, "src": [mr, 0], "dst": [desc, 16]}, flags=Flag.NO_REPLY)
        a.recv()
        b.send(Command.GET_TENSOR, 3, {"tensor": [1, 16, 8]})
        b.recv()
    cap.note = (
        "The EVENT carries the submit's cmd and seq; it comes once B has acknowledged that "
        "the bytes are in place."
    )
    return cap


@example("ENGINE_PAGED_WRITES", volatile=True)
def ex_paged_writes(ds: Daemons) -> Capture:
    with nodes(
        ds, "PAGED_WRITES of source pages 0 and 2 (4 bytes, stride 4) to destination pages "
        "1 and 3 (stride 8) of B's region, NO_REPLY, immediate 8"
    ) as (a, b, cap):
        mr, desc = _a_to_b(a, b)
        a.capture = cap
        a.send(Command.PAGED_WRITES, 3, _two_pages(mr, desc), flags=Flag.NO_REPLY)
        a.recv()
    cap.note = "`0123` lands at offset 8 and `89ab` at offset 24 of B's region; B counts 2."
    return cap


@example("ENGINE_EXPECT_IMM_COUNT")
def ex_expect_imm_count(ds: Daemons) -> Capture:
    with nodes(ds, "EXPECT_IMM_COUNT on B: immediate 8, count 2") as (a, b, cap):
        mr, desc = _a_to_b(a, b)
        b.capture = cap
        b.send(Command.EXPECT_IMM_COUNT, 3, {"imm": 8, "count": 2})
        b.recv()
        _ask(a, Command.PAGED_WRITES, 94, _two_pages(mr, desc), flags=Flag.NO_REPLY)
        b.recv()
    cap.note = (
        "Between the reply and the EVENT, A wrote two pages to B with immediate 8 (one "
        "PAGED_WRITES, which counts 1 per page). The EVENT carries the seq of the "
        "EXPECT_IMM_COUNT; the two counts are consumed."
    )
    return cap


@example("ENGINE_IMM_COUNT")
def ex_imm_count(ds: Daemons) -> Capture:
    with nodes(ds, "IMM_COUNT on B after one SINGLE_WRITE with immediate 7 landed") as (
        a,
        b,
        cap,
    ):
        mr, desc = _a_to_b(a, b)
        _ask(a, Command.SINGLE_WRITE, 94,
             {"len": 8, "imm": 7, "src": [mr, 0], "dst": [desc, 0]}, flags=Flag.NO_REPLY)
        b.capture = cap
        b.send(Command.IMM_COUNT, 3, {"imm": 7})
        b.recv()
    return cap


@example("ENGINE_ADD_PEER_GROUP", volatile=True)
def ex_add_peer_group(ds: Daemons) -> Capture:
    with nodes(ds, "ADD_PEER_GROUP of B, on A") as (a, b, cap):
        addr = _address(b)
        a.capture = cap
        a.send(Command.ADD_PEER_GROUP, 2, {"addrs": [addr]})
        a.recv()
    return cap


@example("ENGINE_SCATTER", volatile=True)
def ex_scatter(ds: Daemons) -> Capture:
    with nodes(
        ds, "SCATTER of A's bytes 0-3 and 4-7 to offsets 0 and 32 of B's region, no peer "
        "group, NO_REPLY, immediate 5"
    ) as (a, b, cap):
        mr, desc = _a_to_b(a, b)
        a.capture = cap
        a.send(Command.SCATTER, 3, {
            "group": None, "imm": 5, "mr": mr,
            "dsts": [[4, 0, desc, 0], [4, 4, desc, 32]]}, flags=Flag.NO_REPLY)
        a.recv()
    cap.note = "B counts 2 on immediate 5 (one per destination)."
    return cap


@example("ENGINE_BARRIER", volatile=True)
def ex_barrier(ds: Daemons) -> Capture:
    with nodes(ds, "BARRIER to B's region in peer group 1, NO_REPLY, immediate 9") as (
        a,
        b,
        cap,
    ):
        _, desc = _region(b)
        _ask(a, Command.ADD_PEER_GROUP, 94, {"addrs": [_address(b)]})
        a.capture = cap
        a.send(Command.BARRIER, 3, {"group": 1, "imm": 9, "dsts": [desc]}, flags=Flag.NO_REPLY)
        a.recv()
    cap.note = "A zero-byte write: B counts 1 on immediate 9 and no memory changes."
    return cap


@example("ENGINE_SEND_RECV", volatile=True)
def ex_send_recv(ds: Daemons) -> Capture:
    with nodes(
        ds, "SUBMIT_RECVS on B (4 receives of up to 64 bytes), SEND of 8 bytes from A, "
        "both NO_REPLY"
    ) as (a, b, cap):
        addr = _address(b)
        a.capture = b.capture = cap
        b.send(Command.SUBMIT_RECVS, 2, {"len": 64, "count": 4}, flags=Flag.NO_REPLY)
        # A round trip (not shown): the receives are posted before A sends.
        b.capture = None
        b.send(Command.IMM_COUNT, 3, {"imm": 0})
        b.recv()
        b.capture = cap
        a.send(Command.SEND, 2, {"addr": addr}, b"hello, B", flags=Flag.NO_REPLY)
        b.recv()
        a.recv()
    cap.note = (
        "B's message EVENT carries the SUBMIT_RECVS's seq, the sender's `[node, group]` and "
        "the message as payload; A's EVENT completes the SEND once B has handed the "
        "message to its client."
    )
    return cap


@example("ENGINE_ERR_RKEY", volatile=True)
def ex_err_rkey(ds: Daemons) -> Capture:
    with nodes(
        ds, "SINGLE_WRITE with a forged rkey: B refuses it, A's completion is EVENT|ERROR "
        "NOT_FOUND"
    ) as (a, b, cap):
        mr, desc = _a_to_b(a, b)
        ((rail, rkey),) = desc[2]
        forged = [desc[0], desc[1], [[rail, (rkey + 1) % (1 << 64)]]]
        a.capture = cap
        a.send(Command.SINGLE_WRITE, 3,
               {"len": 8, "imm": 7, "src": [mr, 0], "dst": [forged, 0]}, flags=Flag.NO_REPLY)
        a.recv()
    cap.note = "Nothing was written at B and its immediate 7 did not move."
    return cap


@example("ENGINE_ERR_SUBMIT", volatile=True)
def ex_err_submit(ds: Daemons) -> Capture:
    with session(
        ds["main"], "SINGLE_WRITE from a region that does not exist: refused on arrival, "
        "EVENT|ERROR NOT_FOUND"
    ) as (c, cap):
        _, desc = _region(c)
        c.send(Command.SINGLE_WRITE, 3,
               {"len": 8, "imm": None, "src": [9, 0], "dst": [desc, 0]}, flags=Flag.NO_REPLY)
        c.recv()
    cap.note = (
        "Without NO_REPLY the same failure is a REPLY|ERROR. Either way nothing was sent to "
        "any peer."
    )
    return cap


request_example(
    "ENGINE_ERR_UNKNOWN_COMMAND",
    "EVENT (0x3F, reserved) sent as a request: UNKNOWN_COMMAND",
    Command.EVENT,
    note="The connection stays open.",
)


@example("ENGINE_ALLOC_UVM_WATCHER", volatile=True)
def ex_alloc_uvm_watcher(ds: Daemons) -> Capture:
    with session(ds["main"], "ALLOC_UVM_WATCHER on the word at offset 0 of a buffer; another "
                 "connection's SET_TENSOR stores 5 there") as (c, cap):
        buf = _with_buffer(c)
        c.send(Command.ALLOC_UVM_WATCHER, 3, {"buffer": buf, "offset": 0})
        c.recv()
        with session(ds["main"], cap.title) as (other, _):
            other.send(Command.SET_TENSOR, 2, {"tensor": [buf, 0, 8]},
                       (5).to_bytes(8, "little"), Flag.NO_REPLY)
            c.recv()
    cap.note = (
        "The EVENT carries the ALLOC_UVM_WATCHER's cmd and seq, the watcher's id and the "
        "word's value before and after the change the watcher thread saw. Sent with `{}`, the "
        "reply also names the connection's shared word page: `path`, `offset`, `page_size`."
    )
    return cap


@example("ENGINE_ARM_PAGED_WRITES", volatile=True)
def ex_arm_paged_writes(ds: Daemons) -> Capture:
    with nodes(
        ds, "ARM_PAGED_WRITES on A: the PAGED_WRITES above, armed on watcher 1 (a buffer's "
        "word) at value 1; another connection's SET_TENSOR then stores 1 there"
    ) as (a, b, cap):
        mr, desc = _a_to_b(a, b)
        word = _with_buffer(a)
        watcher = _ask(a, Command.ALLOC_UVM_WATCHER, 94, {"buffer": word, "offset": 0})
        a.capture = cap
        a.send(Command.ARM_PAGED_WRITES, 3,
               {"watcher": watcher["watcher"], "value": 1, **_two_pages(mr, desc)})
        a.recv()
        with session(ds["main"], cap.title) as (other, _):
            other.send(Command.SET_TENSOR, 2, {"tensor": [word, 0, 8]},
                       (1).to_bytes(8, "little"), Flag.NO_REPLY)
            a.recv()
            a.recv()
    cap.note = (
        "The reply says it is armed. The watcher sees the word at 1 and daemon A submits "
        "the write itself: first the watcher's own EVENT (seq 94, off the record before), "
        "then the write's completion, an EVENT with the ARM_PAGED_WRITES' cmd and seq. "
        "`0123` lands at offset 8 and `89ab` at offset 24 of B's region; B counts 2."
    )
    return cap


# Daemon B of the peer-plane example proves a cluster secret, as a deployment does.
PEER_SECRET = b"capture cluster secret"
_SECRET_DIR = tempfile.mkdtemp(prefix="capture-secret-")
atexit.register(shutil.rmtree, _SECRET_DIR, True)


def _secret_config() -> str:
    secret = os.path.join(_SECRET_DIR, "cluster.secret")
    config = os.path.join(_SECRET_DIR, "b.toml")
    with open(secret, "wb") as f:
        f.write(PEER_SECRET + b"\n")
    os.chmod(secret, 0o600)  # the daemon refuses a secret others can read
    with open(config, "w") as f:
        f.write(f'[engine]\nsecret_file = "{secret}"\n')
    return config


Daemons.ARGS["b-secret"] = ("-c", _secret_config())
Daemons.HOSTS["b-secret"] = "127.0.0.2"


def _frame(raw: bytes) -> Frame:
    (f,) = FrameDecoder().feed(raw)
    return f


@example("PEER_PLANE", volatile=True)
def ex_peer_plane(ds: Daemons) -> Capture:
    cap = Capture(
        "A peer link to rail 0 of daemon B (cluster secret configured): HELLO, AUTH, a "
        "WRITE of 4 bytes with immediate 3, a WRITE with a forged rkey, a SEND"
    )
    with session(ds["b-secret"], cap.title) as (c, _):
        c.capture = None
        _, desc = _region(c)
        ptr, _, ((_rail, rkey),) = desc
        _, node, group, (rail,) = msgpack.unpackb(_address(c), raw=False)
        host, port = parse_rail(rail)
        # B's client posts a receive, so the SEND is delivered (and acknowledged) at once.
        c.send(Command.SUBMIT_RECVS, 90, {"len": 64, "count": 1}, flags=Flag.NO_REPLY)
        link = Conn(port, cap, host=host, server="daemon B rail 0", me="peer")
        me = PeerIdentity((1 << 63) | secrets.randbits(62), 0, (rail_bytes("127.0.0.1", 1),))
        hs = PeerHandshake(Role.INITIATOR, me, 0, PEER_SECRET, time.monotonic(),
                           expect=(node, group, rail))
        try:
            hs.start()
            while not hs.done:
                link.send(0, 0, raw=hs.data_to_send())
                hs.receive(_frame(link.recv()), time.monotonic())
            # The data phase: fixed headers, no msgpack.
            link.send(0, 0, raw=encode_write(1, 0, rkey, [ptr + 16], [4], 3) + b"ABCD")
            link.recv_data()
            forged = (rkey + 1) % (1 << 64)
            link.send(0, 0, raw=encode_write(2, 0, forged, [ptr + 16], [4], 3) + b"ABCD")
            link.recv_data()
            link.send(0, 0, raw=encode_send(3, 0, 4) + b"ping")
            link.recv_data()
        finally:
            link.close()
    cap.note = (
        "This script plays the initiating daemon, with the cluster secret. B's HELLO reply "
        "proves B knows the secret (`proof` over the peer's `nonce` and B's `challenge`); the "
        "peer's AUTH `mac` proves it knows it too, and B's empty AUTH reply opens the link. "
        "From then on the link speaks the data phase's fixed headers: a one-page WRITE is a "
        "64-byte header and its payload, an ACK 16 bytes (an error's code and message after "
        "them). The forged WRITE's 4 bytes are read and dropped; the SEND is acknowledged "
        "once B has handed it to the receive its client posted and it is out of B (without one "
        "posted it would be refused, NOT_FOUND)."
    )
    return cap
