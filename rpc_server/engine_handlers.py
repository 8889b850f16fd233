"""Handlers for the transfer-engine commands (0x20-0x3F, minor 2).

Submits (SINGLE_WRITE, PAGED_WRITES, SCATTER, BARRIER, SEND) are checked and
handed to the engine at once; their completion comes later as an EVENT frame
with the request's cmd and seq: body ``{"ok": true}``, or ERROR set and
``{"code", "message"}``.  Sent with NO_REPLY (what the client library does)
the completion EVENT is the only answer; otherwise an immediate empty reply
says the submit was accepted.  docs/protocol.md has every body field.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from transferd.engine.limits import MAX_MESSAGE
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import (
    BadRequest,
    Cancelled,
    NotFound,
    TransferdError,
    UnknownCommand,
)
from transferd.protocol.frames import Frame
from transferd.protocol.messages import bytes_field, field, uint_field
from transferd.protocol.values import MrDesc, NetAddr, Pages, ScatterDst

from .handlers import SINKS, Reply, handler, patience, wait_drained
from .ops import Op, ops_of, timeout_of

if TYPE_CHECKING:
    from transferd.engine import TransferEngine

    from .session import Session

U32 = 0xFFFFFFFF


def _engine(session: Session) -> TransferEngine:
    if session.ctx.engine is None:
        raise UnknownCommand("this daemon runs without the transfer engine")
    return session.ctx.engine


def _opt_imm(body: dict[str, Any]) -> int | None:
    if body.get("imm") is None:
        return None
    return uint_field(body, "imm", U32)


def _opt_wid(body: dict[str, Any]) -> int | None:
    """A write id (u64, the client's choice): a retry with the same one lands once."""
    if body.get("wid") is None:
        return None
    return uint_field(body, "wid", (1 << 64) - 1)


def _pair(body: dict[str, Any], name: str) -> tuple[Any, Any]:
    v = field(body, name)
    if not isinstance(v, list | tuple) or len(v) != 2:
        raise BadRequest(f"field {name!r} must be a pair")
    return v[0], v[1]


def _uint(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadRequest(f"{what} must be an unsigned integer")
    return v


def _submit(
    session: Session, frame: Frame, start: Callable[[], asyncio.Future[None]]
) -> Reply | Awaitable[Reply | None] | None:
    """Hand a checked submit to the engine; wait for a worker slot only when full.

    Its deadline: ``timeout_ms`` if it names one (at most engine.peer_timeout_s,
    which bounds every transfer anyway); a write from device memory, whose
    staging wait comes before the transfer's own clock starts, gets twice
    engine.peer_timeout_s unless it names one.
    """
    engine = _engine(session)
    peer_timeout = engine.config.peer_timeout_s
    timeout = None
    if "timeout_ms" in frame.body:
        timeout = timeout_of(frame.body, None, peer_timeout, f"a {Command(frame.cmd).name}",
                             "engine.peer_timeout_s")

    def go() -> Reply | None:
        fut = start()
        session.pending.add(fut)
        op = Op(frame.seq, frame.cmd, lambda err: engine.cancel(fut, err))
        staged = timeout is None and isinstance(fut, asyncio.Task)
        ops_of(session).add(op, 2 * peer_timeout if staged else timeout)
        fut.add_done_callback(lambda f: _completed(session, frame, f, op))
        return None if frame.no_reply else Reply({})

    cap = engine.config.max_inflight_per_client
    if len(session.pending) < cap and engine.has_slot():
        return go()

    async def later() -> Reply | None:
        # This connection's own share first (its frames wait meanwhile, others'
        # do not), then a slot of the worker shared by all.
        while len(session.pending) >= cap:
            room = session.room
            if room is None or room.done():
                room = session.room = asyncio.get_running_loop().create_future()
            await room
        await engine.wait_slot()
        return go()

    return later()


def _completed(session: Session, frame: Frame, fut: asyncio.Future[None], op: Op) -> None:
    session.pending.discard(fut)
    room, session.room = session.room, None
    if room is not None and not room.done():
        room.set_result(None)
    if fut.cancelled():  # a write from device memory stopped while staging: nothing sent
        exc: BaseException | None = op.reason or Cancelled(f"{op.what} was cancelled")
    else:
        exc = fut.exception()
    ops_of(session).finished(op, exc if isinstance(exc, TransferdError) else None)
    if exc is None:
        session.send_frame(frame.cmd, Flag.EVENT, frame.seq, {"ok": True})
    elif isinstance(exc, TransferdError):
        session.ctx.metrics.error(exc.code)
        session.send_frame(frame.cmd, Flag.EVENT | Flag.ERROR, frame.seq, exc.to_body())
    else:
        session.send_frame(frame.cmd, Flag.EVENT | Flag.ERROR, frame.seq,
                           {"code": "INTERNAL", "message": repr(exc)})


@handler(Command.MAIN_ADDRESS)
def main_address(session: Session, frame: Frame) -> Reply:
    return Reply({"addr": _engine(session).main_address().to_bytes()})


@handler(Command.REG_MR)
def reg_mr(session: Session, frame: Frame) -> Reply:
    buf = session.ctx.buffers.get(uint_field(frame.body, "buffer"))
    # Device memory too: the engine reaches it through its group's staging (docs/gpu.md).
    # ``access``: what peers may do through its rkeys ("w", the default; "r"; "rw").
    access = frame.body.get("access", "w")
    if not isinstance(access, str):
        raise BadRequest("field 'access' must be 'w', 'r' or 'rw'")
    region, desc = _engine(session).reg_mr(buf, access)
    return Reply({"mr": region.id, "desc": desc.to_wire()})


@handler(Command.DEREG_MR)
def dereg_mr(session: Session, frame: Frame) -> Awaitable[None] | None:
    engine = _engine(session)
    region = engine.regions.get(uint_field(frame.body, "mr"))
    engine.dereg_mr(region.id)
    # Replies once the writes admitted before are in place: after it, no
    # byte of a peer write lands in this memory.
    return wait_drained([region], patience(session))


@handler(Command.SINGLE_WRITE)
def single_write(session: Session, frame: Frame) -> Reply | Awaitable[Reply | None] | None:
    b = frame.body
    engine = _engine(session)
    length = uint_field(b, "len")
    imm = _opt_imm(b)
    mr, src_off = _pair(b, "src")
    desc, dst_off = _pair(b, "dst")
    src = (_uint(mr, "src mr"), _uint(src_off, "src offset"))
    dst = (MrDesc.from_wire(desc), _uint(dst_off, "dst offset"))
    wid = _opt_wid(b)
    # Checked now, so a bad request is answered before anything is queued.
    return _submit(session, frame,
                   lambda: engine.submit_single_write(length, imm, src, dst, wid, session))


@handler(Command.PAGED_WRITES)
def paged_writes(session: Session, frame: Frame) -> Reply | Awaitable[Reply | None] | None:
    b = frame.body
    engine = _engine(session)
    page_len = uint_field(b, "page_len")
    imm = _opt_imm(b)
    mr, src_pages = _pair(b, "src")
    desc, dst_pages = _pair(b, "dst")
    src = (_uint(mr, "src mr"), Pages.from_wire(src_pages))
    dst = (MrDesc.from_wire(desc), Pages.from_wire(dst_pages))
    wid = _opt_wid(b)
    return _submit(session, frame,
                   lambda: engine.submit_paged_writes(page_len, imm, src, dst, wid, session))


@handler(Command.ADD_PEER_GROUP)
def add_peer_group(session: Session, frame: Frame) -> Reply:
    addrs = field(frame.body, "addrs")
    if not isinstance(addrs, list) or not addrs:
        raise BadRequest("field 'addrs' must be a non-empty list of NetAddr bytes")
    if not all(isinstance(a, bytes) for a in addrs):
        # Never bytes(a) of what the client sent: bytes(1 << 40) allocates a TiB.
        raise BadRequest("field 'addrs' must be a non-empty list of NetAddr bytes")
    peers = [NetAddr.from_bytes(a) for a in addrs]
    return Reply({"group": _engine(session).add_peer_group(peers, session)})


def _group(body: dict[str, Any]) -> int | None:
    return None if body.get("group") is None else uint_field(body, "group")


@handler(Command.SCATTER)
def scatter(session: Session, frame: Frame) -> Reply | Awaitable[Reply | None] | None:
    b = frame.body
    engine = _engine(session)
    mr = uint_field(b, "mr")
    raw = field(b, "dsts")
    if not isinstance(raw, list):
        raise BadRequest("field 'dsts' must be a list of [len, src, desc, dst_offset]")
    dsts = []
    for i, d in enumerate(raw):
        if not isinstance(d, list) or len(d) != 4:
            raise BadRequest(f"dsts[{i}] must be [len, src, desc, dst_offset]")
        dsts.append(ScatterDst(_uint(d[0], f"dsts[{i}].len"), _uint(d[1], f"dsts[{i}].src"),
                               (MrDesc.from_wire(d[2]), _uint(d[3], f"dsts[{i}].dst"))))
    imm, gid = _opt_imm(b), _group(b)
    return _submit(session, frame, lambda: engine.submit_scatter(gid, imm, mr, dsts))


@handler(Command.BARRIER)
def barrier(session: Session, frame: Frame) -> Reply | Awaitable[Reply | None] | None:
    b = frame.body
    engine = _engine(session)
    imm = uint_field(b, "imm", U32)
    raw = field(b, "dsts")
    if not isinstance(raw, list):
        raise BadRequest("field 'dsts' must be a list of MrDesc")
    dsts = [MrDesc.from_wire(d) for d in raw]
    gid = _group(b)
    return _submit(session, frame, lambda: engine.submit_barrier(gid, imm, dsts))


def _send_sink(session: Session, frame: Frame) -> None:
    # Messages are small control messages: collected, then handed on.
    if frame.payload_len > MAX_MESSAGE:
        raise BadRequest(f"message of {frame.payload_len} bytes is over the limit of {MAX_MESSAGE}")


SINKS[Command.SEND] = _send_sink


@handler(Command.SEND)
def send(session: Session, frame: Frame) -> Reply | Awaitable[Reply | None] | None:
    engine = _engine(session)
    addr = NetAddr.from_bytes(bytes_field(frame.body, "addr"))
    msg = bytes(frame.payload or b"")
    return _submit(session, frame, lambda: engine.submit_send(addr, msg))


@handler(Command.SUBMIT_RECVS)
def submit_recvs(session: Session, frame: Frame) -> Reply | None:
    engine = _engine(session)
    length = uint_field(frame.body, "len")
    count = uint_field(frame.body, "count")
    seq = frame.seq

    def arrived(peer: tuple[int, int], msg: bytes) -> bool:
        # True: the transport took it all (the sender's ACK goes now); else the
        # engine waits for this connection's write buffer to drain.
        sent = session.send_frame(Command.SUBMIT_RECVS, Flag.EVENT, seq,
                                  {"from": [peer[0], peer[1]], "len": len(msg)},
                                  [memoryview(msg)])
        return bool(sent) and not session.write_blocked

    engine.submit_recvs(session, length, count, arrived)
    return None if frame.no_reply else Reply({})


@handler(Command.EXPECT_IMM_COUNT)
def expect_imm_count(session: Session, frame: Frame) -> Reply | None:
    engine = _engine(session)
    imm = uint_field(frame.body, "imm", U32)
    count = uint_field(frame.body, "count", U32)
    cfg = engine.config
    timeout = timeout_of(frame.body, cfg.expect_timeout_s, cfg.max_expect_timeout_s,
                         "an EXPECT_IMM_COUNT", "engine.max_expect_timeout_s")
    seq = frame.seq
    ops = ops_of(session)

    def reached() -> None:
        session.send_frame(Command.EXPECT_IMM_COUNT, Flag.EVENT, seq,
                           {"imm": imm, "count": count})
        ops.finished(op, None)

    def stop(err: TransferdError) -> bool:
        # Dropped before it fired: nothing of the count is consumed.
        if not engine.cancel_expectation(session, handle):
            return False
        session.send_frame(Command.EXPECT_IMM_COUNT, Flag.EVENT | Flag.ERROR, seq,
                           err.to_body())
        ops.finished(op, err)
        return True

    # Fires at the earliest on the loop's next turn, after op exists.
    handle = engine.expect_imm_count(session, imm, count, reached)
    op = ops.add(Op(seq, f"EXPECT_IMM_COUNT of {count} on {imm}", stop, with_connection=True),
                 timeout)
    return None if frame.no_reply else Reply({})


@handler(Command.IMM_COUNT)
def imm_count(session: Session, frame: Frame) -> Reply:
    imm = uint_field(frame.body, "imm", U32)
    return Reply({"imm": imm, "value": _engine(session).imm_value(imm)})


@handler(Command.CANCEL)
def cancel(session: Session, frame: Frame) -> Reply | Awaitable[Reply]:
    """End one of this connection's pending operations; reply once its final EVENT went."""
    seq = uint_field(frame.body, "seq", U32)
    op = ops_of(session).get(seq)
    if op is None:
        raise NotFound(f"no pending operation with seq {seq} on this connection (never "
                       "sent here, already ended, or one CANCEL does not end)")
    op.halt(Cancelled(f"{op.what} (seq {seq}) cancelled by the client"))

    def reply() -> Reply:
        ours = isinstance(op.reason, Cancelled) and op.outcome is op.reason
        return Reply({"seq": seq, "cancelled": ours})

    if op.ended:
        return reply()

    async def after() -> Reply:
        # Bounded: a transfer ends as soon as its worker sees the cancel.
        await op.wait_ended()
        return reply()

    return after()
