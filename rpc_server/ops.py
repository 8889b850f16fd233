"""A connection's pending operations, by seq: their deadlines, and CANCEL of one.

Every operation that answers later than its frame (a submit's completion
EVENT, an EXPECT_IMM_COUNT's) is registered here under its request's seq, on
its own connection only: CANCEL names a seq of the connection it comes on, so
no connection can reach another's operations.  Each has a deadline (its
``timeout_ms``, else the default of its kind); when it passes the operation is
ended with TIMEOUT, as a CANCEL ends it with CANCELLED.  Either way exactly one
final EVENT goes out for it: ``ok``, the failure, TIMEOUT or CANCELLED.

The table is bounded by what it holds: submits by engine.max_inflight_per_client,
expectations by engine.max_expectations.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transferd.protocol.constants import command_name
from transferd.protocol.errors import BadRequest, Timeout, TransferdError

if TYPE_CHECKING:
    from .session import Session

# A deadline in ms fits in a u32 (49 days).
MAX_TIMEOUT_MS = 0xFFFFFFFF


@dataclass(eq=False, slots=True)
class Op:
    seq: int
    # What it is, for messages: a label, or the request's cmd (named only when needed).
    label: str | int
    # Ends the operation now with the error given; False if it had already ended.
    stop: Callable[[TransferdError], bool]
    # Ends with its connection (an expectation); a submit runs on to its end.
    with_connection: bool = False
    timer: asyncio.TimerHandle | None = None
    # Why it was stopped (the error given to stop), once it was.
    reason: TransferdError | None = None
    # The error its final EVENT carried (None: ok); set with ``ended``.
    outcome: TransferdError | None = None
    ended: bool = False
    # Awaited by a CANCEL: resolved once the final EVENT was sent.
    _waiters: list[asyncio.Future[None]] | None = None

    @property
    def what(self) -> str:
        label = self.label
        return label if isinstance(label, str) else command_name(label)

    def end(self, outcome: TransferdError | None) -> None:
        """The final EVENT was sent (with ``outcome``)."""
        if self.ended:
            return
        self.ended = True
        self.outcome = outcome
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        waiters, self._waiters = self._waiters, None
        for w in waiters or ():
            if not w.done():
                w.set_result(None)

    def halt(self, error: TransferdError) -> bool:
        if self.ended or self.reason is not None:
            return False
        self.reason = error
        if self.stop(error):
            return True
        self.reason = None  # it ended on its own meanwhile: not ours
        return False

    async def wait_ended(self) -> None:
        if self.ended:
            return
        w = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(w)
        await w


class Ops:
    def __init__(self) -> None:
        self.by_seq: dict[int, Op] = {}

    def add(self, op: Op, timeout_s: float | None) -> Op:
        # A seq reused while its first operation is pending: CANCEL names the first.
        self.by_seq.setdefault(op.seq, op)
        if timeout_s is not None:
            op.timer = asyncio.get_running_loop().call_later(timeout_s, _expire, op, timeout_s)
        return op

    def finished(self, op: Op, outcome: TransferdError | None) -> None:
        if self.by_seq.get(op.seq) is op:
            del self.by_seq[op.seq]
        op.end(outcome)

    def get(self, seq: int) -> Op | None:
        return self.by_seq.get(seq)


def _expire(op: Op, timeout_s: float) -> None:
    op.timer = None
    op.halt(Timeout(f"{op.what} not done within its deadline of {timeout_s:g} s "
                    "(timeout_ms); the outcome is unknown: parts already sent may still "
                    "land and count"))


_OPS: weakref.WeakKeyDictionary[Session, Ops] = weakref.WeakKeyDictionary()


def ops_of(session: Session) -> Ops:
    ops = _OPS.get(session)
    if ops is None:
        ops = _OPS[session] = Ops()
    return ops


def timeout_of(body: dict[str, Any], default_s: float | None, max_s: float,
               what: str, key: str) -> float | None:
    """The deadline a request asks for (``timeout_ms``), in seconds; else ``default_s``."""
    raw = body.get("timeout_ms")
    if raw is None:
        return default_s
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 < raw <= MAX_TIMEOUT_MS:
        raise BadRequest("field 'timeout_ms' must be a positive integer (milliseconds)")
    if raw > max_s * 1000:
        raise BadRequest(f"timeout_ms {raw} is over the longest deadline of {what} "
                         f"({max_s * 1000:g} ms, {key})")
    return raw / 1000.0


def session_closed(session: Session) -> None:
    """The connection is gone.  Its expectations went with it (the engine dropped them):
    their timers go too.  Its submits run on to their end, deadlines included."""
    ops = _OPS.get(session)
    if ops is None:
        return
    for op in list(ops.by_seq.values()):
        if op.with_connection:
            ops.finished(op, None)
