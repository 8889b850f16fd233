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
(within the sweep, 0.5 s).  docs/protocol.md has the reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from transferd.engine.watchers import WORD, Watcher, Watchers, WordPage, buffer_words
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import BadRequest
from transferd.protocol.frames import Frame
from transferd.protocol.messages import uint_field

from .handlers import Reply, handler

if TYPE_CHECKING:
    from transferd.config import EngineConfig

    from .context import ServerContext
    from .session import Session

# One watcher set per daemon (hung on its context), one word page per connection.
_ATTR = "_uvm_watchers"
_PAGES: weakref.WeakKeyDictionary[Session, WordPage] = weakref.WeakKeyDictionary()


def _alive(owner: object) -> bool:
    from .session import State

    return getattr(owner, "state", None) is not State.CLOSED


def configure(ctx: ServerContext, engine: EngineConfig) -> None:
    """The daemon's watcher set, with its configured caps and idle pace."""
    w = Watchers(alive=_alive, idle_poll_s=engine.watcher_idle_poll_ms / 1000.0,
                 max_watchers=engine.max_watchers,
                 max_per_owner=engine.max_watchers_per_connection)
    setattr(ctx, _ATTR, w)
    ctx.metrics.registry.register(w)


def watchers_of(ctx: ServerContext) -> Watchers:
    w: Watchers | None = getattr(ctx, _ATTR, None)
    if w is None:
        w = Watchers(alive=_alive)
        setattr(ctx, _ATTR, w)
    return w


def session_closed(session: Session) -> None:
    """The connection is gone: its watchers and its page go now."""
    w: Watchers | None = getattr(session.ctx, _ATTR, None)
    if w is not None:
        w.owner_closed(session)
    page = _PAGES.pop(session, None)
    if page is not None:
        page.close()


# Per connection: watchers whose last EVENT still waits in its write buffer.
_UNSENT: weakref.WeakKeyDictionary[Session, list[Watcher]] = weakref.WeakKeyDictionary()


def _when_drained(session: Session, w: Watcher) -> None:
    waiting = _UNSENT.get(session)
    if waiting is None:
        waiting = _UNSENT[session] = []

        def drained() -> None:
            session.drained_hooks.discard(drained)
            for x in _UNSENT.pop(session, ()):
                x.delivered()

        session.drained_hooks.add(drained)
    waiting.append(w)


@handler(Command.ALLOC_UVM_WATCHER)
def alloc_uvm_watcher(session: Session, frame: Frame) -> Reply:
    if session.ctx.minor < 2:  # pragma: no cover - the session refuses minor-2 commands first
        raise BadRequest("ALLOC_UVM_WATCHER needs protocol minor 2")
    body = frame.body
    loop = asyncio.get_running_loop()
    seq = frame.seq
    watchers = watchers_of(session.ctx)
    reply: dict[str, object] = {}
    keep: Any
    watchers.check_room(session)  # before a word of the page is taken
    if body.get("buffer") is not None:
        buf = session.ctx.buffers.get(uint_field(body, "buffer"))
        offset = uint_field(body, "offset") if "offset" in body else 0
        try:
            view = buf.view(0, buf.size)
        except (AttributeError, TypeError):
            raise BadRequest(f"buffer {buf.id} has no host view to watch") from None
        (words, index), keep = buffer_words(view, offset), view
        key: Hashable = ("buffer", buf.id)
        # Ends once the buffer is freed: its view would hold the memory and the charge.
        gone: Any = lambda: buf.freed
    else:
        page = _PAGES.get(session)
        if page is None or page.closed:
            try:
                page = _PAGES[session] = WordPage()
            except OSError as exc:
                raise BadRequest(f"cannot make a shared word page: {exc}") from None
        offset = page.take()
        words, index, keep, key, gone = page.words, offset // WORD, page, page, None
        reply.update(path=str(page.path), offset=offset, page_size=len(page.words) * 8)
    box: list[Watcher] = []

    def deliver(old: int, new: int) -> None:
        w = box[0]
        session.send_frame(Command.ALLOC_UVM_WATCHER, Flag.EVENT, seq,
                           {"watcher": w.id, "old": old, "new": new})
        if session.write_blocked:
            # Not out yet (a client that does not read): the next change waits, merged,
            # until this one is, so a connection holds one EVENT per watcher at most.
            _when_drained(session, w)
        else:
            w.delivered()

    def changed(old: int, new: int) -> None:  # on the watcher thread
        with contextlib.suppress(RuntimeError):  # the daemon's loop is gone
            loop.call_soon_threadsafe(deliver, old, new)

    w = watchers.add(session, key, words, index, changed, keep, handoff=True, gone=gone)
    box.append(w)
    reply.update(watcher=w.id, value=w.last)
    return Reply(reply)
