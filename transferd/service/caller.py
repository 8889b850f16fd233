"""One caller of a :class:`~transferd.service.Service`: an RPC connection or an inproc client.

A Caller is the owner key of what it makes (buffers it owns, leases it holds,
expectations, peer groups, posted receives, watchers, published names: each table
holds it as an opaque key) and holds the state every kind of caller needs alike:
its pending operations by key (:mod:`.ops`), the submits it has in flight (its
share of the engine's slots; SYNCHRONIZE waits for them), and whether it is open.
What differs between callers (how a completion reaches them: an EVENT frame or a
future resolved in the process) is the callback each operation is given.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any

from .ops import Ops


class CallerState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class Caller:
    """One caller: who it is (``peer``, ``source``) and what it has pending."""

    def __init__(self, peer: str = "?", source: str = "?") -> None:
        # Who, for messages and listings ("host:port", "local", "inproc").
        self.peer = peer
        # Where from: leases made are counted per source (memory.max_leases_per_source).
        self.source = source
        self.state = CallerState.OPEN
        self.ops = Ops()
        # Submits started and not finished: this caller's share of the engine's slots
        # (engine.max_inflight_per_client), and what SYNCHRONIZE waits for.
        self.pending: set[asyncio.Future[Any]] = set()
        # Resolved when one of this caller's submits ends (a submit waits at its share).
        self.room: asyncio.Future[None] | None = None
        # This caller's page of watched words (engine/watchers.py), made on first use.
        self.word_page: Any = None

    @property
    def closed(self) -> bool:
        return self.state is CallerState.CLOSED

    def finished_one(self, fut: asyncio.Future[Any]) -> None:
        """A submit of this caller ended: its share has room again."""
        self.pending.discard(fut)
        room, self.room = self.room, None
        if room is not None and not room.done():
            room.set_result(None)

    async def wait_room(self, cap: int) -> None:
        """Until fewer than ``cap`` of this caller's submits are in flight."""
        while len(self.pending) >= cap:
            room = self.room
            if room is None or room.done():
                room = self.room = asyncio.get_running_loop().create_future()
            await room

    def __repr__(self) -> str:
        return f"<Caller {self.peer} {self.state.value}>"
