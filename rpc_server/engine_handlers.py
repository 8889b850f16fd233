"""Handlers for the transfer-engine commands (0x20-0x3F, minor 2).

Submits (SINGLE_WRITE, PAGED_WRITES, SCATTER, BARRIER, SEND) are checked and
handed to the engine at once; their completion comes later as an EVENT frame
with the request's cmd and seq: body ``{"ok": true}``, or ERROR set and
``{"code", "message"}``.  Sent with NO_REPLY (what the client library does)
the completion EVENT is the only answer; otherwise an immediate empty reply
says the submit was accepted.  docs/protocol.md has every body field.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterator
from typing import TYPE_CHECKING, Any

from transferd.engine.limits import MAX_MESSAGE
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import (
    BadRequest,
    TransferdError,
    UnknownCommand,
)
from transferd.protocol.frames import Frame
from transferd.protocol.messages import bytes_field, field, uint_field
from transferd.protocol.values import MrDesc, NetAddr, Pages, ScatterDst
from transferd.service import Admitted, End, Op, Service
from transferd.service.service import few_enough, few_pages

from .handlers import SINKS, Reply, handler
from .ops import ms_field

if TYPE_CHECKING:
    from .session import Session

U32 = 0xFFFFFFFF
U64 = (1 << 64) - 1
# Hot-path constants: combining IntFlags runs Python code.
_EVENT = int(Flag.EVENT)
_EVENT_ERROR = int(Flag.EVENT | Flag.ERROR)
_OK = {"ok": True}


def _service(session: Session) -> Service:
    if session.ctx.engine is None:
        raise UnknownCommand("this daemon runs without the transfer engine")
    return session.ctx.service


def _opt_imm(body: dict[str, Any]) -> int | None:
    if body.get("imm") is None:
        return None
    return uint_field(body, "imm", U32)


def _opt_wid(body: dict[str, Any]) -> int | None:
    """A write id (u64, the client's choice): a retry with the same one lands once."""
    if body.get("wid") is None:
        return None
    return uint_field(body, "wid", (1 << 64) - 1)


def _tags(body: dict[str, Any]) -> dict[str, Any]:
    """A submit's ``verify`` (bool; absent: engine.verify) and ``traceparent`` (W3C
    text; the engine checks it) fields (docs/integrity.md)."""
    verify = body.get("verify")
    if verify is not None and not isinstance(verify, bool):
        raise BadRequest("field 'verify' must be true or false")
    tp = body.get("traceparent")
    return {"verify": verify, "traceparent": tp}


def _pair(body: dict[str, Any], name: str) -> tuple[Any, Any]:
    v = field(body, name)
    if not isinstance(v, list | tuple) or len(v) != 2:
        raise BadRequest(f"field {name!r} must be a pair")
    return v[0], v[1]


def _uint(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadRequest(f"{what} must be an unsigned integer")
    return v


def _timeout(frame: Frame) -> float | None:
    """A request's ``timeout_ms`` in seconds (the Service checks it against its kind's
    longest deadline); None when it names none."""
    raw = frame.body.get("timeout_ms")
    if raw is None:
        return None
    return ms_field(raw)


def _ended(session: Session, frame: Frame) -> End:
    """How a submit's end reaches the client: its completion EVENT (``ok``, or ERROR
    with the code and message), with the request's cmd and seq."""
    cmd, seq = frame.cmd, frame.seq

    def on_end(err: TransferdError | None) -> None:
        if err is None:
            session.send_event(cmd, _EVENT, seq, _OK)
        else:
            session.send_event(cmd, _EVENT_ERROR, seq, err.to_body())

    return on_end


def _admitted(frame: Frame, admitted: Admitted) -> Reply | Awaitable[Reply | None] | None:
    """A submit's answer: none (one-way, what the client library sends) or an empty
    reply, once the submit is taken (at once, unless it waits for a slot)."""
    if isinstance(admitted, Op):
        return None if frame.no_reply else Reply({})

    async def later() -> Reply | None:
        # This connection's frames wait meanwhile (they run in order), others' do not.
        await admitted
        return None if frame.no_reply else Reply({})

    return later()


@handler(Command.MAIN_ADDRESS)
def main_address(session: Session, frame: Frame) -> Reply:
    return Reply({"addr": _service(session).main_address().to_bytes()})


@handler(Command.REG_MR)
def reg_mr(session: Session, frame: Frame) -> Reply:
    # Device memory too: the engine reaches it through its group's staging (docs/gpu.md).
    # ``access``: what peers may do through its rkeys ("w", the default; "r"; "rw").
    access = frame.body.get("access", "w")
    if not isinstance(access, str):
        raise BadRequest("field 'access' must be 'w', 'r' or 'rw'")
    region, desc = _service(session).reg_mr(session.caller, uint_field(frame.body, "buffer"),
                                            access)
    return Reply({"mr": region.id, "desc": desc.to_wire()})


@handler(Command.DEREG_MR)
def dereg_mr(session: Session, frame: Frame) -> Awaitable[None] | None:
    # Replies once the writes admitted before are in place: after it, no
    # byte of a peer write lands in this memory.
    return _service(session).dereg_mr(session.caller, uint_field(frame.body, "mr"))


def _plain_uint(v: Any, limit: int = U64) -> bool:
    # ``type() is int``: a bool is not one (what _uint and uint_field refuse too).
    return type(v) is int and 0 <= v <= limit


@handler(Command.SINGLE_WRITE)
def single_write(session: Session, frame: Frame) -> Reply | Awaitable[Reply | None] | None:
    b = frame.body
    service = _service(session)
    length, s, d = b.get("len"), b.get("src"), b.get("dst")
    imm, wid, verify = b.get("imm"), b.get("wid"), b.get("verify")
    # The usual request, read in one pass (it is every small write's cost); anything
    # else takes the field-by-field checks below, which name what is wrong.
    if (type(s) is list and len(s) == 2 and type(d) is list and len(d) == 2
            and type(length) is int and 0 <= length <= U64
            and (imm is None or _plain_uint(imm, U32)) and (wid is None or _plain_uint(wid))
            and (verify is None or type(verify) is bool)
            and type(s[0]) is int and type(s[1]) is int and s[0] >= 0 and s[1] >= 0
            and type(d[1]) is int and d[1] >= 0):
        src: tuple[int, int] = (s[0], s[1])
        dst = (MrDesc.from_wire(d[0]), d[1])
    else:
        length = uint_field(b, "len")
        imm = _opt_imm(b)
        mr, src_off = _pair(b, "src")
        desc, dst_off = _pair(b, "dst")
        src = (_uint(mr, "src mr"), _uint(src_off, "src offset"))
        dst = (MrDesc.from_wire(desc), _uint(dst_off, "dst offset"))
        wid = _opt_wid(b)
        verify = _tags(b)["verify"]
    # Checked now, so a bad request is answered before anything is queued.
    return _admitted(frame, service.submit_single_write(
        session.caller, frame.seq, length, imm, src, dst, wid=wid, verify=verify,
        traceparent=b.get("traceparent"), timeout=_timeout(frame),
        on_end=_ended(session, frame)))


@handler(Command.PAGED_WRITES)
def paged_writes(session: Session, frame: Frame) -> Reply | Awaitable[Reply | None] | None:
    b = frame.body
    service = _service(session)
    page_len = uint_field(b, "page_len")
    imm = _opt_imm(b)
    mr, src_pages = _pair(b, "src")
    desc, dst_pages = _pair(b, "dst")
    assert service.engine is not None  # (_service: a daemon with its engine)
    few_pages(service.engine, src_pages, "PAGED_WRITES")  # counted before any is decoded
    few_pages(service.engine, dst_pages, "PAGED_WRITES")
    src = (_uint(mr, "src mr"), Pages.from_wire(src_pages))
    dst = (MrDesc.from_wire(desc), Pages.from_wire(dst_pages))
    return _admitted(frame, service.submit_paged_writes(
        session.caller, frame.seq, page_len, imm, src, dst, wid=_opt_wid(b), **_tags(b),
        timeout=_timeout(frame), on_end=_ended(session, frame)))


@handler(Command.ADD_PEER_GROUP)
def add_peer_group(session: Session, frame: Frame) -> Reply:
    service = _service(session)
    addrs = field(frame.body, "addrs")
    if not isinstance(addrs, list) or not addrs:
        raise BadRequest("field 'addrs' must be a non-empty list of NetAddr bytes")
    if not all(isinstance(a, bytes) for a in addrs):
        # Never bytes(a) of what the client sent: bytes(1 << 40) allocates a TiB.
        raise BadRequest("field 'addrs' must be a non-empty list of NetAddr bytes")
    peers = [NetAddr.from_bytes(a) for a in addrs]
    return Reply({"group": service.add_peer_group(session.caller, peers)})


def _fours(service: Service, body: dict[str, Any], name: str, shape: str, what: str,
           named: str = "destinations") -> Iterator[tuple[str, list[Any]]]:
    """A SCATTER's ``dsts`` or a GATHER's ``srcs``: a list, counted against
    engine.max_scatter_dsts before any entry is decoded, of lists of four (``shape``
    names them); each entry comes checked, with what to call it (``dsts[3]``), just
    before the caller decodes it."""
    raw = field(body, name)
    if not isinstance(raw, list):
        raise BadRequest(f"field {name!r} must be a list of {shape}")
    assert service.engine is not None  # (_service: a daemon with its engine)
    few_enough(service.engine, raw, what, named)
    for i, entry in enumerate(raw):
        if not isinstance(entry, list) or len(entry) != 4:
            raise BadRequest(f"{name}[{i}] must be {shape}")
        yield f"{name}[{i}]", entry


def _group(body: dict[str, Any]) -> int | None:
    return None if body.get("group") is None else uint_field(body, "group")


@handler(Command.SCATTER)
def scatter(session: Session, frame: Frame) -> Reply | Awaitable[Reply | None] | None:
    b = frame.body
    service = _service(session)
    mr = uint_field(b, "mr")
    dsts = []
    for at, d in _fours(service, b, "dsts", "[len, src, desc, dst_offset]", "SCATTER"):
        dsts.append(ScatterDst(_uint(d[0], f"{at}.len"), _uint(d[1], f"{at}.src"),
                               (MrDesc.from_wire(d[2]), _uint(d[3], f"{at}.dst"))))
    imm, gid = _opt_imm(b), _group(b)
    return _admitted(frame, service.submit_scatter(
        session.caller, frame.seq, gid, imm, mr, dsts, **_tags(b),
        timeout=_timeout(frame),
        on_end=_ended(session, frame)))


@handler(Command.BARRIER)
def barrier(session: Session, frame: Frame) -> Reply | Awaitable[Reply | None] | None:
    b = frame.body
    service = _service(session)
    imm = uint_field(b, "imm", U32)
    raw = field(b, "dsts")
    if not isinstance(raw, list):
        raise BadRequest("field 'dsts' must be a list of MrDesc")
    assert service.engine is not None
    few_enough(service.engine, raw, "BARRIER")  # counted before any is decoded
    dsts = [MrDesc.from_wire(d) for d in raw]
    return _admitted(frame, service.submit_barrier(
        session.caller, frame.seq, _group(b), imm, dsts, timeout=_timeout(frame),
        on_end=_ended(session, frame), traceparent=b.get("traceparent")))


def _send_sink(session: Session, frame: Frame) -> None:
    # Messages are small control messages: collected, then handed on.
    if frame.payload_len > MAX_MESSAGE:
        raise BadRequest(f"message of {frame.payload_len} bytes is over the limit of {MAX_MESSAGE}")


SINKS[Command.SEND] = _send_sink


@handler(Command.SEND)
def send(session: Session, frame: Frame) -> Reply | Awaitable[Reply | None] | None:
    service = _service(session)
    addr = NetAddr.from_bytes(bytes_field(frame.body, "addr"))
    msg = bytes(frame.payload or b"")
    return _admitted(frame, service.submit_send(
        session.caller, frame.seq, addr, msg, timeout=_timeout(frame),
        on_end=_ended(session, frame), traceparent=frame.body.get("traceparent")))


@handler(Command.SUBMIT_RECVS)
def submit_recvs(session: Session, frame: Frame) -> Reply | None:
    service = _service(session)
    length = uint_field(frame.body, "len")
    count = uint_field(frame.body, "count")
    traced = frame.body.get("trace", False)
    if type(traced) is not bool:
        raise BadRequest("field 'trace' must be true or false")
    seq = frame.seq

    def arrived(peer: tuple[int, int], msg: bytes, traceparent: str | None = None) -> bool:
        # True: the transport took it all (the sender's ACK goes now); else the
        # engine waits for this connection's write buffer to drain.
        body: dict[str, Any] = {"from": [peer[0], peer[1]], "len": len(msg)}
        if traceparent is not None:  # (asked for with "trace", and the SEND carried one)
            body["traceparent"] = traceparent
        sent = session.send_frame(Command.SUBMIT_RECVS, Flag.EVENT, seq, body,
                                  [memoryview(msg)])
        return bool(sent) and not session.write_blocked

    service.submit_recvs(session.caller, length, count, arrived, traced=traced)
    return None if frame.no_reply else Reply({})


@handler(Command.EXPECT_IMM_COUNT)
def expect_imm_count(session: Session, frame: Frame) -> Reply | None:
    service = _service(session)
    imm = uint_field(frame.body, "imm", U32)
    count = uint_field(frame.body, "count", U32)
    seq = frame.seq

    def on_end(err: TransferdError | None) -> None:
        if err is None:
            session.send_frame(Command.EXPECT_IMM_COUNT, Flag.EVENT, seq,
                               {"imm": imm, "count": count})
        else:
            session.send_frame(Command.EXPECT_IMM_COUNT, Flag.EVENT | Flag.ERROR, seq,
                               err.to_body())

    service.expect_imm_count(session.caller, seq, imm, count, timeout=_timeout(frame),
                             on_end=on_end)
    return None if frame.no_reply else Reply({})


@handler(Command.IMM_COUNT)
def imm_count(session: Session, frame: Frame) -> Reply:
    imm = uint_field(frame.body, "imm", U32)
    return Reply({"imm": imm, "value": _service(session).imm_count(imm)})


@handler(Command.CANCEL)
def cancel(session: Session, frame: Frame) -> Reply | Awaitable[Reply]:
    """End one of this connection's pending operations; reply once its final EVENT went."""
    seq = uint_field(frame.body, "seq", U32)
    ended = session.ctx.service.cancel(session.caller, seq)
    if isinstance(ended, bool):
        return Reply({"seq": seq, "cancelled": ended})

    async def after() -> Reply:
        # Bounded: a transfer ends as soon as its worker sees the cancel.
        return Reply({"seq": seq, "cancelled": await ended})

    return after()
