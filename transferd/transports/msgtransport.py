"""An asyncio transport of frames over any carrier of whole messages.

:class:`MessageTransport` drives an ``asyncio.BufferedProtocol`` (the server's session,
the client's connection) exactly as the loop's transports do, over a :class:`Carrier`
that moves whole messages both ways: the RC SEND/RECV channel of ``rdma://``
(``transferd.rdma.channel.RcChannel``), or, in the tests, an AF_UNIX SOCK_SEQPACKET socket.
Frames are cut and judged by :mod:`.continuation` (PROTOCOL.md's message transport:
header and body one message, payload continuation, each message received whole then
scattered, short, long or merged = BAD_FRAME).  ``get_extra_info("transferd_message")``
is true; writers use :meth:`MessageTransport.write_frame`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from transferd.protocol.errors import BadRequest, ProtocolError, TransferdError

from .continuation import (
    GONE,
    MIN_MAX_MESSAGE,
    MessageReader,
    cut,
    report_refused,
    scatter,
    write_limits,
)


class Carrier(Protocol):
    """Whole messages both ways (an RC queue pair, or a SOCK_SEQPACKET socket)."""

    on_message: Callable[[memoryview], None]
    on_close: Callable[[TransferdError | None], None]
    on_drain: Callable[[], None] | None
    queued: int

    def send(self, views: Sequence[memoryview]) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def close(self) -> None: ...


def _ignore(arg: object) -> None:
    """A lost transport's carrier callbacks."""


class MessageTransport(asyncio.Transport):
    """An asyncio transport of frames over a carrier of whole messages."""

    def __init__(self, loop: asyncio.AbstractEventLoop, carrier: Carrier,
                 protocol: asyncio.BufferedProtocol, *, max_message: int = MIN_MAX_MESSAGE,
                 recv_limit: int | None = None, extra: dict[str, Any] | None = None,
                 on_lost: Callable[[], None] | None = None) -> None:
        super().__init__(extra)
        self._loop = loop
        self._carrier = carrier
        self._protocol = protocol
        # Where the frame arriving is, and its sizes (raised by the session after HELLO).
        self.continuation = MessageReader(self._scatter, max_message=max_message,
                                          first_limit=recv_limit or max_message)
        self._extra = {"transferd_message": True, "transferd_fds": False, **(extra or {})}
        self._high = 64 * 1024
        self._low = 16 * 1024
        self._protocol_paused = False
        self._reading = True
        self._closing = False
        self._lost = False
        self._stash: memoryview | None = None
        self._on_lost = on_lost
        carrier.on_message = self._on_message
        carrier.on_close = self._on_close
        carrier.on_drain = self._maybe_resume_protocol
        self._protocol.connection_made(self)

    # -- asyncio.Transport ---------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def is_closing(self) -> bool:
        return self._closing

    def is_reading(self) -> bool:
        return self._reading

    def pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._carrier.pause()

    def resume_reading(self) -> None:
        if self._reading or self._closing:
            return
        self._reading = True
        if self._stash is not None:
            stash, self._stash = self._stash, None
            self._scatter(stash)
            if not self._reading or self._closing:
                return
        self._carrier.resume()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high, self._low = write_limits(high, low)
        self._maybe_pause_protocol()

    def get_write_buffer_size(self) -> int:
        return self._carrier.queued

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        assert isinstance(protocol, asyncio.BufferedProtocol)
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._carrier.close()

    def abort(self) -> None:
        self.close()

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        raise NotImplementedError("this transport cannot half-close")

    # -- writing ----------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        raise RuntimeError("a message transport takes whole frames: use write_frame")

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        raise RuntimeError("a message transport takes whole frames: use write_frame")

    def write_frame(self, head: bytes, payload: Sequence[memoryview], payload_len: int) -> None:
        """One frame: ``head`` (header and body), then ``payload`` (views of its bytes)."""
        if self._closing or self._lost:
            return
        if len(head) > self.continuation.max_message:
            raise BadRequest(f"a frame head of {len(head)} bytes is over max_message "
                             f"{self.continuation.max_message}")
        for views in cut(head, payload, payload_len, self.continuation.max_message):
            self._carrier.send(views)
        self._maybe_pause_protocol()

    def _maybe_pause_protocol(self) -> None:
        if not self._protocol_paused and self._carrier.queued > self._high:
            self._protocol_paused = True
            self._protocol.pause_writing()

    def _maybe_resume_protocol(self) -> None:
        if self._protocol_paused and self._carrier.queued <= self._low:
            self._protocol_paused = False
            self._protocol.resume_writing()

    # -- reading ----------------------------------------------------------------------

    def _on_message(self, msg: memoryview) -> None:
        if self._closing:
            return
        try:
            self.continuation.feed(msg)
        except ProtocolError as exc:
            report_refused(self._protocol, exc, self._extra.get("peername"))
            self.close()

    def _scatter(self, data: memoryview) -> None:
        # The receive slot is reposted when this returns: what a pause left is kept.
        self._stash = scatter(data, self._protocol, self)

    def _on_close(self, err: TransferdError | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._closing = True
        try:
            self._protocol.connection_lost(err)
        finally:
            # Nothing comes in again: no reference cycle (the protocol holding this
            # transport, the carrier and the reader holding its methods) is left behind.
            self._protocol = GONE
            self.continuation.close()
            carrier = self._carrier
            carrier.on_message, carrier.on_close, carrier.on_drain = _ignore, _ignore, None
            if self._on_lost is not None:
                self._on_lost()
