"""A caller's pending operations: their deadlines, and how one is ended early.

Every operation that ends later than the call that started it (a submit's
completion, an expectation, a stream of changes) is registered in its caller's
:class:`Ops` under a key of the caller's choosing (an RPC connection's request
seq; an inproc client's own count), and only there: a caller can end only its own
operations.  Each has a deadline (its ``timeout``, else the default of its kind);
when it passes the operation is ended with TIMEOUT, as a cancel ends it with
CANCELLED.  Either way it ends exactly once: done, failed, timed out or cancelled.

The table is bounded by what it holds: submits by engine.max_inflight_per_client,
expectations by engine.max_expectations, streams by their own caps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from transferd.protocol.constants import command_name
from transferd.protocol.errors import BadRequest, Timeout, TransferdError


@dataclass(eq=False, slots=True)
class Op:
    key: int
    # What it is, for messages: a label, or the command it was asked by (named only
    # when needed: the per-frame path does not build strings).
    label: str | int
    # Ends the operation now with the error given; False if it had already ended.
    stop: Callable[[TransferdError], bool]
    # Ends with its caller (an expectation, a stream); a submit runs on to its end.
    with_caller: bool = False
    timer: asyncio.TimerHandle | None = None
    # Why it was stopped (the error given to stop), once it was.
    reason: TransferdError | None = None
    # The error it ended with (None: ok); set with ``ended``.
    outcome: TransferdError | None = None
    ended: bool = False
    # Awaited by a cancel: resolved once the operation has ended.
    _waiters: list[asyncio.Future[None]] | None = None

    @property
    def what(self) -> str:
        label = self.label
        return label if isinstance(label, str) else command_name(label)

    def end(self, outcome: TransferdError | None) -> None:
        """The operation ended (with ``outcome``): its final word was given."""
        if self.ended:
            return
        self.ended = True
        self.outcome = outcome
        # Its stop is never called again (halt checks ``ended`` first); it closes over
        # what refers back to this Op (an expectation's handle, a stream), a cycle that
        # only the collector could free: 65,536 expectations of a closing connection
        # left 1.9 million objects to a 2 s pass of it, every client waiting.
        self.stop = _stopped
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        waiters, self._waiters = self._waiters, None
        for w in waiters or ():
            if not w.done():
                w.set_result(None)

    def halt(self, error: TransferdError) -> bool:
        """End it now with ``error`` (CANCELLED, TIMEOUT); False if it had ended first."""
        if self.ended or self.reason is not None:
            return False
        self.reason = error
        if self.stop(error):
            return True
        self.reason = None  # it ended on its own meanwhile: not ours
        return False

    @property
    def cancelled_by_us(self) -> bool:
        """Whether it ended with the error a halt gave it (a cancel that won)."""
        return self.reason is not None and self.outcome is self.reason

    async def wait_ended(self) -> None:
        if self.ended:
            return
        w = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(w)
        await w


def _stopped(error: TransferdError) -> bool:
    """An ended Op's stop: it had ended already."""
    return False


class Ops:
    """One caller's pending operations, by key."""

    def __init__(self) -> None:
        self.by_key: dict[int, Op] = {}

    def __len__(self) -> int:
        return len(self.by_key)

    def check_free(self, key: int) -> None:
        """Refuse ``key`` while an operation of it is pending: the second's EVENTs would
        carry the first's seq and a CANCEL could name only one of them.  Called before an
        operation starts (nothing of it sent or held yet), so the first goes on."""
        op = self.by_key.get(key)
        if op is not None:
            raise BadRequest(f"seq {key} is already in flight on this connection "
                             f"({op.what}): an operation needs a seq of its own until "
                             "it ends")

    def add(self, op: Op, timeout_s: float | None) -> Op:
        # (A key still pending was refused by check_free before its operation started; an
        # operation started without that check keeps the first, which a cancel names.)
        self.by_key.setdefault(op.key, op)
        if timeout_s is not None:
            op.timer = asyncio.get_running_loop().call_later(timeout_s, _expire, op, timeout_s)
        return op

    def finished(self, op: Op, outcome: TransferdError | None) -> None:
        if self.by_key.get(op.key) is op:
            del self.by_key[op.key]
        op.end(outcome)

    def get(self, key: int) -> Op | None:
        return self.by_key.get(key)

    def caller_closed(self) -> None:
        """The caller is gone: what ends with it ends (their timers too); submits run on."""
        for op in list(self.by_key.values()):
            if op.with_caller:
                self.finished(op, None)


def _expire(op: Op, timeout_s: float) -> None:
    op.timer = None
    op.halt(Timeout(f"{op.what} not done within its deadline of {timeout_s:g} s "
                    "(timeout_ms); the outcome is unknown: parts already sent may still "
                    "land and count"))


def deadline(timeout_s: float | None, default_s: float | None, max_s: float, what: str,
             key: str) -> float | None:
    """The deadline an operation asks for, in seconds (``default_s`` when it names none),
    checked against the longest one its kind may have (``key`` names that setting)."""
    if timeout_s is None:
        return default_s
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) \
            or not timeout_s > 0:
        raise BadRequest(f"the deadline of {what} must be a positive number of seconds, "
                         f"not {timeout_s!r}")
    if timeout_s > max_s:
        raise BadRequest(f"timeout_ms {round(timeout_s * 1000)} is over the longest deadline "
                         f"of {what} ({max_s * 1000:g} ms, {key})")
    return float(timeout_s)
