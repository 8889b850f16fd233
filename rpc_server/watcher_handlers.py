"""ALLOC_UVM_WATCHER (0x2B): a 64-bit word the daemon watches for its client.

Request body, either form:

- ``{}``: a word of this connection's shared word page (a file in /dev/shm,
  mode 0600, removed when the connection closes).  The reply says where:
  ``path`` and ``offset``; a local client maps the page, and its GPU kernels
  write the word through a mapped, pinned registration of it.
- ``{"buffer": id, "offset": off}``: the 8-byte aligned word at ``off`` of a
  daemon buffer with a host view (SET_TENSOR or a peer's write moves it).

Reply: ``watcher`` (id), ``value`` (the word now), and for the page form
``path``, ``offset``, ``page_size``.  Every change the watcher thread sees is
an EVENT with the request's cmd and seq: ``{"watcher", "old", "new"}``.  At
most one EVENT per watcher is in flight; changes seen meanwhile are merged.
Watchers end with their connection, and one on a buffer's word also with that buffer
(within the sweep, 0.5 s).

ARM_PAGED_WRITES (0x39): a paged write armed on one of the connection's watchers,
fired by the daemon when the word reaches a value (transferd/service/armed.py).
docs/protocol.md has the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transferd.engine.watchers import Watcher
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import BadRequest
from transferd.protocol.frames import Frame
from transferd.protocol.messages import uint_field
from transferd.protocol.values import MrDesc, Pages
from transferd.service.armed import PagedWrite
from transferd.service.service import few_pages

from .engine_handlers import U64, _ended, _opt_imm, _pair, _service, _tags, _timeout, _uint
from .handlers import Reply, handler

if TYPE_CHECKING:
    from .session import Session

@handler(Command.ALLOC_UVM_WATCHER)
def alloc_uvm_watcher(session: Session, frame: Frame) -> Reply:
    if session.ctx.minor < 2:  # pragma: no cover - the session refuses minor-2 commands first
        raise BadRequest("ALLOC_UVM_WATCHER needs protocol minor 2")
    body = frame.body
    seq = frame.seq
    buffer_id = offset = None
    if body.get("buffer") is not None:
        buffer_id = uint_field(body, "buffer")
        offset = uint_field(body, "offset") if "offset" in body else 0

    def changed(w: Watcher, old: int, new: int) -> None:
        session.send_frame(Command.ALLOC_UVM_WATCHER, Flag.EVENT, seq,
                           {"watcher": w.id, "old": old, "new": new})
        if session.write_blocked:
            # Not out yet (a client that does not read): the next change waits, merged,
            # until this one is, so a connection holds one EVENT per watcher at most.
            session.at_next_drain.append(w.delivered)
        else:
            w.delivered()

    w, where = session.ctx.service.alloc_uvm_watcher(session.caller, changed, buffer_id,
                                                     offset or 0)
    return Reply({**where, "watcher": w.id, "value": w.last})


@handler(Command.ARM_PAGED_WRITES)
def arm_paged_writes(session: Session, frame: Frame) -> Reply | None:
    """A PAGED_WRITES held until watcher ``watcher``'s word reads ``value`` or more, then
    submitted by the daemon itself (transferd/service/armed.py).  Checked whole now; the
    reply says it is armed; its completion is the ordinary EVENT with this seq."""
    b = frame.body
    service = _service(session)
    if b.get("wid") is not None:
        raise BadRequest("an armed write fires once: it takes no 'wid'")
    watcher = uint_field(b, "watcher")
    value = uint_field(b, "value", U64)
    page_len = uint_field(b, "page_len")
    imm = _opt_imm(b)
    mr, src_pages = _pair(b, "src")
    desc, dst_pages = _pair(b, "dst")
    assert service.engine is not None  # (_service: a daemon with its engine)
    few_pages(service.engine, src_pages, "ARM_PAGED_WRITES")  # counted before decoding
    few_pages(service.engine, dst_pages, "ARM_PAGED_WRITES")
    write = PagedWrite(page_len, imm, (_uint(mr, "src mr"), Pages.from_wire(src_pages)),
                       (MrDesc.from_wire(desc), Pages.from_wire(dst_pages)),
                       timeout=_timeout(frame), **_tags(b))
    service.arm_paged_writes(session.caller, frame.seq, watcher, value, write,
                             on_end=_ended(session, frame))
    return None if frame.no_reply else Reply({"watcher": watcher, "value": value})
