"""One error hierarchy for the whole project; each class carries its wire code.

The server turns an exception into ``{"code", "message"}`` with
:meth:`TransferdError.to_body`; the client turns that body back into the same
class with :func:`error_from_body`, so ``except OutOfBounds`` works on both
sides of the wire.

Classes are registered by code, as asyncpg registers its exception classes by
SQLSTATE: a class that sets ``code`` in its own body is the class of that code
(:data:`BY_CODE`), found by ``(code, fatal)``, so one code may have a fatal and
a non-fatal class (TOO_LARGE: :class:`TooLarge` closes the connection,
:class:`OverLimit` does not).  A subclass that does not set ``code`` refines its
base without a wire identity of its own; ``register=False`` keeps a class that
never comes off the wire (:class:`ConnectionLost`) out of the table.  Two
classes for the same ``(code, fatal)`` are a TypeError at import.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from .constants import ErrorCode

# (code, fatal) -> the class of that code; filled by TransferdError.__init_subclass__.
BY_CODE: dict[tuple[str, bool], type[TransferdError]] = {}


class TransferdError(Exception):
    """Base class.  ``code`` is the wire code; ``fatal`` closes the connection."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL
    fatal: ClassVar[bool] = False

    def __init_subclass__(cls, register: bool = True, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if not register or "code" not in cls.__dict__:
            return
        key = (cls.code.value, cls.fatal)
        other = BY_CODE.get(key)
        if other is not None:
            raise TypeError(f"{cls.__name__}: wire code {key[0]} "
                            f"({'fatal' if key[1] else 'not fatal'}) is already "
                            f"{other.__name__}'s")
        BY_CODE[key] = cls

    def __init__(self, message: str = "", *, seq: int | None = None) -> None:
        super().__init__(message or self.code.value)
        self.message = message or self.code.value
        # The seq of the request this error answers, where there is one (it
        # matters for NO_REPLY commands whose failure arrives as an EVENT).
        self.seq = seq

    def to_body(self) -> dict[str, Any]:
        return {"code": self.code.value, "message": self.message}

    def __str__(self) -> str:
        where = f" (seq {self.seq})" if self.seq is not None else ""
        return f"{self.code.value}: {self.message}{where}"


class ProtocolError(TransferdError):
    """The peer broke the framing rules; the connection cannot continue."""

    fatal = True


class BadFrame(ProtocolError):
    code = ErrorCode.BAD_FRAME


class TooLarge(ProtocolError):
    code = ErrorCode.TOO_LARGE


class OverLimit(TooLarge):
    """A request over a per-request or per-connection cap (TOO_LARGE): refused whole,
    before anything is allocated; unlike a frame too large, the connection goes on."""

    code = ErrorCode.TOO_LARGE
    fatal = False


class NoHello(ProtocolError):
    code = ErrorCode.NO_HELLO


class VersionMismatch(ProtocolError):
    code = ErrorCode.VERSION_MISMATCH


class Unauthorized(ProtocolError):
    code = ErrorCode.UNAUTHORIZED


class UnknownCommand(TransferdError):
    code = ErrorCode.UNKNOWN_COMMAND


class BadRequest(TransferdError):
    code = ErrorCode.BAD_REQUEST


class NotFound(TransferdError):
    code = ErrorCode.NOT_FOUND


class OutOfBounds(TransferdError):
    code = ErrorCode.OUT_OF_BOUNDS


class OutOfMemory(TransferdError):
    code = ErrorCode.OUT_OF_MEMORY


class PeerUnreachable(TransferdError):
    code = ErrorCode.PEER_UNREACHABLE


class PeerAnswered(PeerUnreachable):
    """PEER_UNREACHABLE as a peer's own answer to a part (its ACK or READ_DATA says so),
    not a link of ours that failed: the transfer's error like any answer, never re-sent
    on another rail nor a rail marked down for it (domains/failover.py).  No code of its
    own: a client sees PEER_UNREACHABLE with the peer's message."""


class IntegrityError(PeerUnreachable):
    """A part's bytes did not match its checksum (CRC32C) where they were placed: that
    range was not counted.  Its own code only on the peer wire (an ACK's
    ``INTEGRITY``, so the initiator re-sends the part once); a client sees
    PEER_UNREACHABLE (PROTOCOL.md's codes are fixed) with a message saying so."""

    peer_code = "INTEGRITY"


class Timeout(TransferdError):
    """A deadline passed.  For an engine write the outcome is unknown: the daemon stopped
    waiting, but parts already sent may still land and count at the destination later.
    Retry a write with the same write id (``wid=``) to have it applied and counted at
    most once, or check the destination before retrying one that counts an immediate."""

    code = ErrorCode.TIMEOUT


class Cancelled(TransferdError):
    """Ended by the client's own CANCEL (``await completion.cancel()``).  For a write the
    outcome is unknown, as after a Timeout: parts already sent may still land."""

    code = ErrorCode.CANCELLED


class Internal(TransferdError):
    code = ErrorCode.INTERNAL


class ConnectionLost(TransferdError, register=False):
    """Client side only: the connection closed with requests outstanding."""

    code = ErrorCode.CANCELLED


E = TypeVar("E", bound=BaseException)


def untraced(exc: E) -> E:
    """``exc`` and the exceptions it was raised from, without their tracebacks: to be
    kept (on a frame, an operation) past the handler that caught it. A traceback holds
    the frames it went through, and they what refers back to the keeper (the request's
    Frame, a connection): a reference cycle only the cyclic collector frees."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += (e.__cause__, e.__context__)
    return exc


def error_class(code: str, fatal: bool | None = None) -> type[TransferdError]:
    """The class registered for ``code``: the one ``fatal`` names where a code has both,
    else the fatal one if there is one (a frame's error where nothing says otherwise),
    else Internal for a code nobody registered."""
    if fatal is not None:
        cls = BY_CODE.get((code, fatal))
        if cls is not None:
            return cls
    return BY_CODE.get((code, True)) or BY_CODE.get((code, False)) or Internal


def error_from_body(body: dict[str, Any], *, seq: int | None = None,
                    fatal: bool | None = None) -> TransferdError:
    """Rebuild the typed exception from an ERROR frame's body.

    ``fatal``: what the caller knows of the frame (False where the protocol says the
    connection goes on: an EVENT|ERROR, or a TOO_LARGE to a request within the
    announced limits, which can only be a per-request cap: OverLimit).
    """
    code = str(body.get("code", "INTERNAL"))
    message = str(body.get("message", ""))
    cls = error_class(code, fatal)
    if cls is Internal and code != "INTERNAL":
        message = f"[{code}] {message}"
    return cls(message, seq=seq)
