"""What is in flight on this daemon, and what has stayed in one stage too long.

Every submit (a transfer: single, paged, scatter, barrier, send) has an
:class:`Entry` from the moment it is taken until it ends, and so has every
expectation a client waits on; a read (issue 19) registers its own through
:meth:`InFlight.add` with ``kind="read"`` and a ``progress`` of its own.  An entry
says who (the owner: the connection), to whom (the peer node, the rails), how much
(bytes done of total), its trace id, its age, and its :class:`Stage` with how long it
has been in it.

A peer's work here is listed too, from sources read when listed (:attr:`InFlight.
sources`): a WRITE being received (LANDING), a READ being answered (ANSWERING: bytes
sent of its answer, owner the peer), a message waiting for a receive (WAITING_RECV)
or handed to a connection whose transport has not drained (DELIVERING).

A transfer's stage moves QUEUED (a write from device memory while its staging copy is
made) -> WAITING_PEER (engine.max_inflight_per_peer reached for its peer) -> SENT
(handed to the rails, nothing acknowledged) -> PARTLY_ACKED (some parts acknowledged)
and then it ends.  The first three are set by the engine as they happen; SENT and
PARTLY_ACKED are read off the transfer's own count of parts when looked at (no call
per acknowledgement on the hot path).

With engine.stall_warn_s, :meth:`InFlight.stalled` (on a timer of the engine) finds the
entries whose stage has lasted longer than that: each is logged at WARNING once per
stage, with all of the above, and counted (``transferd_engine_stalls_total``).

Everything here runs on the daemon's loop; a transfer's count of parts is written on
its group's worker and only read here (a snapshot).  The table is bounded by what
bounds transfers and expectations (engine slots, the peer-slot queue,
engine.max_expectations); a listing is cut at :data:`MAX_LISTED`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from transferd.logs import trace_fields
from transferd.parts import Transfer
from transferd.protocol.trace import trace_id

log = logging.getLogger("transferd.engine")

MAX_LISTED = 10_000
# A listing that took longer than this to make is handed again, as it was, to whoever
# asks within nine times what it cost (InFlight.listing): however many connections ask
# at once, listing a large table takes at most about a tenth of the loop.
REUSE_OVER_S = 0.005


class Stage(enum.Enum):
    QUEUED = "queued"
    WAITING_PEER = "waiting for a peer slot"
    SENT = "sent"
    PARTLY_ACKED = "partly acknowledged"
    LANDING = "landing"
    EXPECTING = "expecting"
    # A peer's message here, waiting for one of a connection's receives; handed to the
    # connection, its transport not drained yet (receives.py).
    WAITING_RECV = "waiting for a receive"
    DELIVERING = "delivering"
    # A peer's READ answered here, its bytes not all sent yet.
    ANSWERING = "answering"


@dataclass(slots=True, eq=False)
class Entry:
    """One thing in flight (see the module docstring).  A transfer's peer, rails and
    bytes are read off its ``plan`` (its parts) when listed, not when it starts."""

    # "write", "send", "expectation", "read"; a peer's here: "incoming write",
    # "incoming send", "incoming read"
    kind: str
    op: int
    owner: Any
    trace: bytes | None
    started: float
    stage: Stage
    since: float
    # A transfer's parts (WritePart / SendPart): where it goes and how much.
    plan: Sequence[Any] = ()
    # Once handed to a worker: its parts' count (SENT / PARTLY_ACKED and bytes done).
    transfer: Transfer | None = None
    # Anything else's progress: () -> (done, total) in its own unit (bytes; an
    # expectation's count), for reads and expectations; and its peer and rails.
    progress: Callable[[], tuple[int, int]] | None = None
    peer_node: int | None = None
    rail_list: tuple[int, ...] = ()
    what: str = ""  # a few words more (an expectation's immediate)
    warned: Stage | None = None

    @property
    def parts(self) -> int:
        return len(self.plan)

    @property
    def nbytes(self) -> int:
        return sum(getattr(p, "nbytes", 0) for p in self.plan)

    @property
    def peer(self) -> str:
        if self.peer_node is not None:
            return f"{self.peer_node:016x}"
        nodes = {p.dst.node for p in self.plan}
        if len(nodes) == 1:
            return f"{next(iter(nodes)):016x}"
        return f"{len(nodes)} peers" if nodes else ""

    @property
    def rails(self) -> tuple[int, ...]:
        return self.rail_list or tuple(sorted({p.rail for p in self.plan}))

    def move(self, stage: Stage, now: float) -> None:
        if stage is not self.stage:
            self.stage, self.since = stage, now

    def refresh(self, now: float) -> None:
        """A started transfer's stage, from its count of parts."""
        t = self.transfer
        if t is not None and not t.finished and self.parts:
            self.move(Stage.PARTLY_ACKED if t.remaining < self.parts else Stage.SENT, now)

    def done(self) -> tuple[int, int]:
        """(done, total): bytes of a transfer (by its parts acknowledged)."""
        if self.progress is not None:
            return self.progress()
        t = self.transfer
        if t is None or not self.parts:
            return 0, self.nbytes
        acked = max(0, self.parts - max(0, t.remaining))
        return self.nbytes * acked // self.parts, self.nbytes

    def to_body(self, now: float) -> dict[str, Any]:
        done, total = self.done()
        return {"kind": self.kind, "op": self.op, "stage": self.stage.value,
                "age_s": round(now - self.started, 3),
                "in_stage_s": round(now - self.since, 3), "peer": self.peer,
                "rails": list(self.rails), "done": done, "total": total,
                "parts": self.parts, "trace_id": trace_id(self.trace),
                "owner": owner_name(self.owner), "what": self.what}

    def describe(self, now: float) -> str:
        """All of it in a line (its trace id goes with the log record: trace_fields)."""
        done, total = self.done()
        unit = "" if self.kind == "expectation" else " bytes"
        rails = ",".join(map(str, self.rails)) or "-"
        return (f"{self.kind} {self.op}{' ' + self.what if self.what else ''}: "
                f"{self.stage.value} for {now - self.since:.1f} s (age {now - self.started:.1f} "
                f"s), peer {self.peer or '-'} rail(s) {rails}, {done:,} of {total:,}{unit} "
                f"done, owner {owner_name(self.owner) or '-'}")


def owner_name(owner: Any) -> str:
    """How a listing names an owner (a connection: its peer address)."""
    if owner is None:
        return ""
    if isinstance(owner, str):  # (a peer's, as its link names it)
        return owner
    return str(getattr(owner, "peer", None) or type(owner).__name__)


class InFlight:
    """The table (see the module docstring); ``clock`` is the daemon loop's time."""

    def __init__(self, clock: Callable[[], float], stall_warn_s: float = 0.0) -> None:
        self.clock = clock
        self.stall_warn_s = stall_warn_s
        self._entries: dict[Hashable, Entry] = {}
        self.stalls = 0  # entries logged as stalled (transferd_engine_stalls_total)
        # Other sources of entries (the Domains' writes landing here): () -> (key, the
        # entry's fields) of each now; an entry lives as long as its key is there.
        self.sources: list[Callable[[], Iterable[tuple[Hashable, dict[str, Any]]]]] = []
        self._sourced: dict[Hashable, Entry] = {}
        self._timer: asyncio.TimerHandle | None = None
        self.reuse_over_s = REUSE_OVER_S
        # The last costly listing: (its limit, until when it is handed again (a
        # perf_counter time), the body).
        self._last: tuple[int, float, dict[str, Any]] | None = None

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """With engine.stall_warn_s: look for stalls a few times per that period."""
        period = max(0.05, self.stall_warn_s / 4)
        if self.stall_warn_s <= 0:
            return

        def look() -> None:
            self.stalled()
            self._timer = loop.call_later(period, look)

        self._timer = loop.call_later(period, look)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: Hashable, kind: str, *, op: int = 0, owner: Any = None,
            plan: Sequence[Any] = (), trace: bytes | None = None,
            stage: Stage = Stage.QUEUED, progress: Callable[[], tuple[int, int]] | None = None,
            peer: int | None = None, rails: tuple[int, ...] = (), what: str = "") -> Entry:
        """A new entry under ``key`` (a transfer's op; anything hashable for others)."""
        now = self.clock()
        e = Entry(kind, op, owner, trace, now, stage, now, plan, progress=progress,
                  peer_node=peer, rail_list=rails, what=what)
        self._entries[key] = e
        return e

    def add_transfer(self, op: int, kind: str, owner: Any, plan: Sequence[Any],
                     trace: bytes | None, stage: Stage) -> Entry:
        """:meth:`add` for a submit (keyed by its op), as cheap as it can be: one per
        transfer on the daemon's loop."""
        now = self.clock()
        e = self._entries[op] = Entry(kind, op, owner, trace, now, stage, now, plan)
        return e

    def get(self, key: Hashable) -> Entry | None:
        return self._entries.get(key)

    def remove(self, key: Hashable) -> None:
        self._entries.pop(key, None)

    def entries(self) -> list[Entry]:
        out = list(self._entries.values())
        if self.sources:
            out.extend(self._from_sources())
        return out

    def _from_sources(self) -> list[Entry]:
        now: dict[Hashable, Entry] = {}
        for source in self.sources:
            for key, f in source():
                e = self._sourced.get(key)
                if e is None:
                    e = Entry(f["kind"], f.get("op", 0), f.get("owner"), f.get("trace"),
                              f.get("started", f["since"]), f["stage"], f["since"],
                              what=f.get("what", ""), peer_node=f.get("peer"),
                              rail_list=f.get("rails", ()))
                elif e.stage is not f["stage"]:
                    e.stage, e.since = f["stage"], f["since"]  # (a message handed on)
                done = f["progress"]
                e.progress = lambda done=done: done
                now[key] = e
        self._sourced = now
        return list(now.values())

    def listing(self, limit: int = MAX_LISTED) -> dict[str, Any]:
        """The STATS ``inflight`` body: every entry, oldest first (cut at ``limit``).

        One that cost more than ``reuse_over_s`` is the answer again for nine times its
        cost (the same body, at most that old): 131,072 expectations are about 0.1 s of
        the loop to list, and twenty connections asking at once held every other client
        0.5 s, the 5 ms turn bounding each connection, not their sum."""
        began = time.perf_counter()
        last = self._last
        if last is not None and last[0] == limit and began < last[1]:
            return last[2]
        now = self.clock()
        entries = self.entries()
        for e in entries:
            e.refresh(now)
        entries.sort(key=lambda e: e.started)
        body = {"entries": [e.to_body(now) for e in entries[:limit]],
                "truncated": len(entries) > limit, "stall_warn_s": self.stall_warn_s,
                "stalls": self.stalls}
        done = time.perf_counter()
        cost = done - began
        self._last = (limit, done + 9 * cost, body) if cost > self.reuse_over_s else None
        return body

    def stalled(self) -> list[Entry]:
        """Entries newly in one stage longer than engine.stall_warn_s: logged at WARNING
        (once per stage each) and counted."""
        if self.stall_warn_s <= 0:
            return []
        now = self.clock()
        out = []
        for e in self.entries():
            e.refresh(now)
            if e.warned is e.stage or now - e.since < self.stall_warn_s:
                continue
            e.warned = e.stage
            self.stalls += 1
            out.append(e)
            log.warning("stalled: %s (engine.stall_warn_s = %g)", e.describe(now),
                        self.stall_warn_s,
                        extra={"op": e.op, "stage": e.stage.value, "peer_node": e.peer,
                               **trace_fields(e.trace)})
        return out


def incoming(groups: Callable[[], Sequence[Any]]
             ) -> Callable[[], list[tuple[Hashable, dict[str, Any]]]]:
    """A source of entries: the peer writes being received now by every domain group,
    and the peer READs being answered (``DomainGroup.incoming()``:
    :class:`~transferd.protocol.peer_link.Incoming`; a read's owner is the peer)."""

    def now() -> list[tuple[Hashable, dict[str, Any]]]:
        out: list[tuple[Hashable, dict[str, Any]]] = []
        for group in list(groups()):
            for w in group.incoming():
                read = w.kind == "read"
                out.append(((group.index, w.peer, w.rail, w.ref, w.kind), {
                    "kind": "incoming read" if read else "incoming write", "op": w.ref[0],
                    "trace": w.trace, "since": w.since,
                    "stage": Stage.ANSWERING if read else Stage.LANDING, "peer": w.peer[0],
                    "rails": (w.rail,), "progress": (w.received, w.nbytes),
                    "what": f"part {w.ref[1]}", "owner": w.owner or None}))
        return out

    return now


__all__ = ["MAX_LISTED", "Entry", "InFlight", "Stage", "incoming", "owner_name"]
