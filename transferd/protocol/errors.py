"""One error hierarchy for the whole project; each class carries its wire code.

The server turns an exception into ``{"code", "message"}`` with
:meth:`TransferdError.to_body`; the client turns that body back into the same
class with :func:`error_from_body`, so ``except OutOfBounds`` works on both
sides of the wire.
"""

from __future__ import annotations

from typing import Any

from .constants import ErrorCode


class TransferdError(Exception):
    """Base class.  ``code`` is the wire code; ``fatal`` closes the connection."""

    code: ErrorCode = ErrorCode.INTERNAL
    fatal: bool = False

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


class ConnectionLost(TransferdError):
    """Client side only: the connection closed with requests outstanding."""

    code = ErrorCode.CANCELLED


_BY_CODE: dict[str, type[TransferdError]] = {
    cls.code.value: cls
    for cls in (
        BadFrame,
        TooLarge,
        NoHello,
        VersionMismatch,
        Unauthorized,
        UnknownCommand,
        BadRequest,
        NotFound,
        OutOfBounds,
        OutOfMemory,
        PeerUnreachable,
        Timeout,
        Cancelled,
        Internal,
    )
}


def error_from_body(body: dict[str, Any], *, seq: int | None = None) -> TransferdError:
    """Rebuild the typed exception from an ERROR frame's body."""
    code = str(body.get("code", "INTERNAL"))
    message = str(body.get("message", ""))
    cls = _BY_CODE.get(code, Internal)
    if cls is Internal and code != "INTERNAL":
        message = f"[{code}] {message}"
    return cls(message, seq=seq)
