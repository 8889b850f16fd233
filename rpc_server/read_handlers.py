"""Handlers for the one-sided READ commands (0x36-0x38, minor 2; HELLO lists "read").

SINGLE_READ, PAGED_READS and GATHER are submits like the writes
(:mod:`.engine_handlers`, through the engine service, transferd/service): checked and
handed to the engine at once, answered by an
EVENT frame with the request's cmd and seq once every byte is in the local region
(``{"ok": true}``) or the read failed (ERROR, ``{"code", "message"}``); deadline
(``timeout_ms``) and CANCEL as for a write.  The local side (``dst``) is a region of
this daemon (its ``mr``); the remote side (``src``) an MrDesc of a region its owner
registered with ``access`` "r" or "rw".  ``verify`` and ``traceparent`` as a write's
(docs/integrity.md).  docs/protocol.md has every body field.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING

from transferd.protocol.constants import Command
from transferd.protocol.frames import Frame
from transferd.protocol.messages import uint_field
from transferd.protocol.values import MrDesc, Pages
from transferd.service.service import few_pages

from .engine_handlers import _admitted, _ended, _fours, _pair, _service, _tags, _timeout, _uint
from .handlers import Reply, handler

if TYPE_CHECKING:
    from .session import Session

@handler(Command.SINGLE_READ)
def single_read(session: Session, frame: Frame) -> Reply | Awaitable[Reply | None] | None:
    b = frame.body
    service = _service(session)
    length = uint_field(b, "len")
    mr, dst_off = _pair(b, "dst")
    desc, src_off = _pair(b, "src")
    dst = (_uint(mr, "dst mr"), _uint(dst_off, "dst offset"))
    src = (MrDesc.from_wire(desc), _uint(src_off, "src offset"))
    return _admitted(frame, service.submit_single_read(
        session.caller, frame.seq, length, dst, src, timeout=_timeout(frame),
        on_end=_ended(session, frame), **_tags(b)))


@handler(Command.PAGED_READS)
def paged_reads(session: Session, frame: Frame) -> Reply | Awaitable[Reply | None] | None:
    b = frame.body
    service = _service(session)
    page_len = uint_field(b, "page_len")
    mr, dst_pages = _pair(b, "dst")
    desc, src_pages = _pair(b, "src")
    assert service.engine is not None  # (_service: a daemon with its engine)
    few_pages(service.engine, dst_pages, "PAGED_READS")  # counted before any is decoded
    few_pages(service.engine, src_pages, "PAGED_READS")
    dst = (_uint(mr, "dst mr"), Pages.from_wire(dst_pages))
    src = (MrDesc.from_wire(desc), Pages.from_wire(src_pages))
    return _admitted(frame, service.submit_paged_reads(
        session.caller, frame.seq, page_len, dst, src, timeout=_timeout(frame),
        on_end=_ended(session, frame), **_tags(b)))


@handler(Command.GATHER)
def gather(session: Session, frame: Frame) -> Reply | Awaitable[Reply | None] | None:
    b = frame.body
    service = _service(session)
    mr = uint_field(b, "mr")
    srcs = []
    for at, s in _fours(service, b, "srcs", "[len, dst_offset, desc, src_offset]", "GATHER",
                        "sources"):
        srcs.append((_uint(s[0], f"{at}.len"), _uint(s[1], f"{at}.dst"),
                     MrDesc.from_wire(s[2]), _uint(s[3], f"{at}.src")))
    return _admitted(frame, service.submit_gather(
        session.caller, frame.seq, mr, srcs, timeout=_timeout(frame),
        on_end=_ended(session, frame), **_tags(b)))
