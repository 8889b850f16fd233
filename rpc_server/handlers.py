"""Command handlers for the core (minor 1 and 2) commands.

A handler takes the session and the frame and returns a :class:`Reply`, None
(an empty reply), or an awaitable of either; it raises a TransferdError for a
failure.  Every tensor is checked against its buffer before any byte moves,
and a batch is checked whole before its first byte moves.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from transferd.copies import COUNTING
from transferd.memory import Ref, memory_class
from transferd.protocol.constants import Command
from transferd.protocol.errors import BadRequest, OverLimit, TransferdError
from transferd.protocol.frames import Frame, Sink
from transferd.protocol.messages import (
    Tensor,
    fast_tensor,
    str_field,
    tensor_field,
    tensors_field,
    uint_field,
)

from . import device_io
from .ownership import owner_for, owner_name, session_closed

__all__ = ["HANDLERS", "SINKS", "Reply", "handler", "session_closed"]

if TYPE_CHECKING:
    from transferd.memory import Buffer, BufferTable

    from .session import Session


class Reply(NamedTuple):
    body: dict[str, Any] | None = None
    payload: Sequence[memoryview] = ()
    # Holds on the memory the payload views lie in: the session releases them
    # once the transport has sent the bytes (or the connection is gone), so
    # a buffer freed meanwhile keeps its memory, and its charge, until then.
    hold: Sequence[Ref] = ()
    # File descriptors sent with the reply (unix and seqpacket connections
    # only): a shared buffer's memfd.  Kept open by ``hold`` until sent.
    fds: Sequence[int] = ()
    # True: the handler wrote the reply itself (a GET streamed from device memory).
    sent: bool = False
    # The buffers the payload views lie in, not yet held: the session takes a Ref on
    # each only where its carrier keeps the views past the write (Carrier.keeps; a
    # small reply on a stream is copied into one write, so a GET of 4 KiB takes no
    # Ref at all).  Taken in the same turn as the views, so no free comes between.
    lies_in: Sequence[Buffer] = ()


_mk = tuple.__new__

Handler = Callable[["Session", Frame], "Reply | Awaitable[Reply | None] | None"]
HANDLERS: dict[Command, Handler] = {}
# Commands that carry a payload, and how to find where it goes.
# Keyed by Command; looked up by the frame's int cmd (an IntEnum key matches its int).
SINKS: dict[int, Callable[[Session, Frame], Sink]] = {}


def handler(cmd: Command) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        HANDLERS[cmd] = fn
        return fn

    return register


def payload_sink(session: Session, frame: Frame) -> Sink:
    """Where a request's payload goes: checked tensor views, in order."""
    sink = SINKS.get(frame.cmd)
    if sink is None:
        raise BadRequest(f"{Command(frame.cmd).name} takes no payload")
    return sink(session, frame)


# A run of a checked batch: the buffer's id, the buffer, where the run starts and ends.
Run = tuple[int, "Buffer", int, int]
# The most runs a session keeps of its last batch (a decode step's rows lie side by
# side: a run or a few); a batch of more is checked again when it repeats.
REPEAT_RUNS = 64


def _fast_views(
    table: BufferTable, wire: Any, used: dict[int, Buffer] | None, runs: list[Run]
) -> list[memoryview] | None:
    """A batch's views in one pass, for a well-formed batch; None otherwise.

    Tensors that follow each other in one buffer (the usual batch: rows side by side)
    become one view, so a batch costs a view per run, not per tensor: its payload is
    received into (or sent from) the buffer in as many pieces as it has runs, which
    are put in ``runs``.  With ``used``, every buffer the views lie in is put there by id.
    """
    if type(wire) is not list:
        return None
    out: list[memoryview] = []
    append = out.append
    buf_id = -1
    buf: Buffer | None = None
    whole = _EMPTY
    limit = 0
    start = end = 0  # the run being built: whole[start:end]
    for item in wire:
        if type(item) is not list or len(item) != 3:
            return None
        b, o, n = item
        if type(b) is not int or type(o) is not int or type(n) is not int or o < 0 or n < 0:
            return None
        if b != buf_id:
            if end > start:
                append(whole[start:end])
                runs.append((buf_id, buf, start, end))  # type: ignore[arg-type]
            buf = table.get(b)
            if buf.staging is not None:
                return None  # device memory: batch_views says so
            whole = buf.view(0, buf.size)
            limit = len(whole)
            buf_id = b
            start = end = o
            if used is not None:
                used[b] = buf
        e = o + n
        if e > limit:
            return None
        if not n:
            # No bytes, no view; but a repeat must find its buffer still there, this
            # offset still inside it (as a first sending's check does): an empty run.
            runs.append((b, buf, o, o))  # type: ignore[arg-type]
            continue
        if o != end:  # not adjacent to the run: it ends, another begins
            if end > start:
                append(whole[start:end])
                runs.append((buf_id, buf, start, end))  # type: ignore[arg-type]
            start = o
        end = e
    if end > start:
        append(whole[start:end])
        runs.append((buf_id, buf, start, end))  # type: ignore[arg-type]
    return out


def _repeat_views(table: BufferTable, runs: list[Run],
                  used: dict[int, Buffer] | None) -> list[memoryview] | None:
    """The views of a batch that is its command's last batch again (the same list: the
    decoder found its bytes unchanged), from that batch's runs: None unless every run's
    buffer is still the one that was checked (not freed, not replaced under its id).
    Each view is taken again, bounds checked by the buffer as any view is."""
    out: list[memoryview] = []
    for b, buf, start, end in runs:
        try:
            if table.get(b) is not buf:
                return None
        except TransferdError:  # freed: the full check says so
            return None
        view = buf.view(start, end - start)
        if end > start:  # (an empty tensor's run: checked, no view)
            out.append(view)
        if used is not None:
            used[b] = buf
    return out


_EMPTY = memoryview(b"")


def batch_views(
    session: Session, frame: Frame, used: dict[int, Buffer] | None = None
) -> list[memoryview] | None:
    """The views of a GET_TENSORS / SET_TENSORS body's ``tensors``, checked; None
    when a tensor lies in memory reached through staging (device memory), whose
    batch the caller hands to device_io instead.

    A batch of many small tensors is the hot case, so it is looked up in one
    pass; anything unusual (or failing) is redone the checked way, so a bad
    batch gets exactly the error it always did (BadRequest for a malformed
    tensor anywhere before NotFound / OutOfBounds for the first bad one).
    """
    table = session.ctx.buffers
    wire = frame.body.get("tensors")
    cap = session.ctx.max_tensors
    if type(wire) is list and len(wire) > cap:
        # Refused before a tensor is looked up: the work of one frame is bounded.
        raise OverLimit(f"a batch of {len(wire)} tensors is over this server's max_tensors "
                        f"({cap}, announced in HELLO): split it")
    memo = session.batches.get(frame.cmd)
    views = None
    if memo is not None and memo[0] is wire:
        views = _repeat_views(table, memo[1], used)
    if views is None:
        if used:
            used.clear()
        runs: list[Run] = []
        try:
            views = _fast_views(table, wire, used, runs)
        except TransferdError:
            views = None
        if views is not None and type(wire) is list and len(runs) <= REPEAT_RUNS:
            # What the decoder hands back for a repeat of this body (frames.py).
            session.batches[frame.cmd] = (wire, runs)
    if views is None:
        if used is not None:
            used.clear()
        views = []
        for t in tensors_field(frame.body):
            buf = table.get(t.buffer)
            if buf.staging is not None:
                return None
            views.append(buf.view(t.offset, t.size))
            if used is not None:
                used[t.buffer] = buf
    return views


def _set_views(session: Session, frame: Frame, views: list[memoryview]) -> list[memoryview]:
    total = sum(map(len, views))
    if total != frame.payload_len:
        raise BadRequest(f"tensors hold {total} bytes but the payload has {frame.payload_len}")
    return views


def _set_tensor_sink(session: Session, frame: Frame) -> Sink:
    t = tensor_field(frame.body, "tensor")
    buf = session.ctx.buffers.get(t.buffer)
    if buf.staging is not None:
        return device_io.set_sink(session, frame, [(buf, t)])
    return _set_views(session, frame, [buf.view(t.offset, t.size)])


def _pairs(session: Session, frame: Frame) -> list[tuple[Buffer, Tensor]]:
    table = session.ctx.buffers
    return [(table.get(t.buffer), t) for t in tensors_field(frame.body)]


def _set_tensors_sink(session: Session, frame: Frame) -> Sink:
    views = batch_views(session, frame)
    if views is None:
        return device_io.set_sink(session, frame, _pairs(session, frame))
    return _set_views(session, frame, views)


SINKS[Command.SET_TENSOR] = _set_tensor_sink
SINKS[Command.SET_TENSORS] = _set_tensors_sink


@handler(Command.HELLO)
def hello(session: Session, frame: Frame) -> Reply:
    return session.hello(frame)


@handler(Command.GET_DEVICES)
def get_devices(session: Session, frame: Frame) -> Reply:
    return Reply({"devices": session.ctx.buffers.device_info()})


def carries_fds(session: Session) -> bool:
    """Whether this connection can pass file descriptors (unix, seqpacket): its
    transport kind's carrier has a descriptor channel."""
    return session.carrier is not None and session.carrier.fds is not None


@handler(Command.ALLOC_BUFFER)
def alloc_buffer(session: Session, frame: Frame) -> Reply:
    device = str_field(frame.body, "device", "cpu")
    size = uint_field(frame.body, "size")
    service = session.ctx.service
    service.buffers.pool(device)  # an unknown device is NOT_FOUND before anything else
    if "ipc_handle" in frame.body:  # a client's own GPU memory (CUDA IPC)
        if owner_for(session, frame.body, "connection") is not session.caller:
            raise BadRequest("a CUDA IPC registration is the client's own memory: its owner "
                             "is the connection that registered it (owner 'connection')")
        return device_io.register_ipc(session, frame, device, size)
    shared = memory_class(device).needs_fd_passing
    asked = "owner" in frame.body or "lease" in frame.body
    if shared:
        # Shared memory: the client maps the memfd that comes with the reply.
        if not carries_fds(session):
            raise BadRequest(f"a {device!r} buffer is shared memory: it needs a connection "
                             "that passes file descriptors (unix:// or seqpacket://), not "
                             "this one")
        if frame.no_reply:
            raise BadRequest(f"a {device!r} buffer's descriptor comes with the reply: "
                             "ALLOC_BUFFER cannot be one-way")
    # Who owns it (docs/engine.md): asked for, else the daemon's default; a shared
    # buffer's is its connection (the client maps it) unless asked.
    buf = service.alloc_buffer(session.caller, device, size, owner=frame.body.get("owner"),
                               lease=frame.body.get("lease"))
    body: dict[str, Any] = {"buffer": buf.id, "size": buf.size}
    if not shared:
        if asked:  # echoed only when asked: a reply older clients know stays byte for byte
            body["owner"] = owner_name(buf.owner)
        return Reply(body)
    memory = buf.memory
    assert memory is not None
    fd = memory.fd()
    assert fd is not None
    held = buf.ref()

    def sent() -> None:
        # The descriptor is out (or the connection is gone): ours can close.
        memory.handed_over()
        held.release()

    body.update(fds=1, **memory.describe())
    if asked:
        body["owner"] = owner_name(buf.owner)
    return Reply(body, (), [Ref(sent)], [fd])


@handler(Command.FREE_BUFFER)
def free_buffer(session: Session, frame: Frame) -> Awaitable[None] | None:
    return session.ctx.service.free_buffer(session.caller, uint_field(frame.body, "buffer"))


@handler(Command.BUFFER_CLEAR)
def buffer_clear(session: Session, frame: Frame) -> Awaitable[None] | None:
    return session.ctx.service.buffer_clear(session.caller, uint_field(frame.body, "buffer"),
                                            uint_field(frame.body, "value", 255))


@handler(Command.SET_TENSOR)
@handler(Command.SET_TENSORS)
def set_tensors(session: Session, frame: Frame) -> Awaitable[None] | None:
    # The payload was already read into place by the sink.  A frame with no
    # payload never met the sink, so its (zero-size) tensors are checked here.
    if frame.payload_len == 0:
        payload_sink(session, frame)
    if session.landings:  # bytes for device memory wait in staging
        return device_io.finish_set(session, frame)
    return None


@handler(Command.GET_TENSOR)
def get_tensor(session: Session, frame: Frame) -> Reply | Awaitable[Reply]:
    # The usual request takes the fast check; anything unusual the full one,
    # whose errors name what is wrong.
    t = fast_tensor(frame.body.get("tensor")) or tensor_field(frame.body, "tensor")
    buf = session.ctx.service.buffers.get(t.buffer)  # ctx.buffers, without the property
    if buf.staging is not None:
        return device_io.get_reply(session, frame, [(buf, t)])
    view = buf.view(t.offset, t.size)
    if t.size > session.ctx.max_reply:
        _check_reply(session, t.size)  # raises OverLimit (the test inlined: per GET)
    return _mk(Reply, (None, [view], (), (), False, (buf,)))  # no Python __new__: per GET


def _check_reply(session: Session, nbytes: int) -> None:
    if nbytes > session.ctx.max_reply:
        raise OverLimit(f"a reply of {nbytes} bytes is over this server's max_reply "
                        f"({session.ctx.max_reply}, announced in HELLO): split the request")


@handler(Command.GET_TENSORS)
def get_tensors(session: Session, frame: Frame) -> Reply | Awaitable[Reply]:
    used: dict[int, Buffer] = {}
    views = batch_views(session, frame, used)
    if views is None:
        return device_io.get_reply(session, frame, _pairs(session, frame))
    _check_reply(session, sum(map(len, views)))
    return Reply(None, views, (), (), False, tuple(used.values()))


@handler(Command.COPY_TENSOR)
def copy_tensor(session: Session, frame: Frame) -> Awaitable[None] | None:
    return session.ctx.service.copy_tensor(session.caller, tensor_field(frame.body, "src"),
                                           tensor_field(frame.body, "dst"))


@handler(Command.SYNCHRONIZE)
def synchronize(session: Session, frame: Frame) -> Awaitable[None] | None:
    # Failures of those operations were already reported as events.
    return session.ctx.service.synchronize(session.caller)


@handler(Command.STATS)
def stats(session: Session, frame: Frame) -> Reply:
    body = session.ctx.stats.to_body()
    if COUNTING:  # TRANSFERD_COUNT_COPIES=1 (transferd/copies.py, docs/protocol.md)
        from transferd.copies import snapshot

        body["copies"] = snapshot()
    if frame.body.get("summary") is True:  # uptime, connections, errors (docs/protocol.md)
        body.update(session.ctx.metrics.summary())
    service = session.ctx.service
    if frame.body.get("discovery") is True:  # where the names live, whether it is up
        body["discovery"] = service.names.status()
    if frame.body.get("buffers") is True:  # the listing extension (docs/protocol.md)
        body.update(service.buffer_listing(session.caller))
    if frame.body.get("inflight") is True:
        # What is in flight (docs/protocol.md, docs/integrity.md); none without an engine.
        listing = service.inflight()
        if listing is not None:
            body["inflight"] = listing
    return Reply(body)
