"""Where a directory's names live beyond this daemon: the Backend interface.

A backend is attached to one :class:`~.directory.Directory`.  The directory
tells it which local name changed (:meth:`Backend.changed`); the backend
carries the change out when it can and feeds what other daemons published
back into the directory.  A publish may wait for the backend to confirm
(:meth:`Backend.confirmed`) but never longer than the backend's timeout, and
nothing else ever waits on it: when the store is away the directory goes on
serving what it knows.

:class:`Embedded` (``discovery.url = ""``) is this daemon alone, in memory:
nothing to carry, nothing comes in.  The etcd backend is :mod:`.etcd`.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .directory import Directory


class State(enum.StrEnum):
    """Where a backend stands with its store."""

    EMBEDDED = "embedded"      # nothing beyond this daemon
    CONNECTING = "connecting"  # first contact not made yet
    UP = "up"                  # registered, mirror current, watch running
    AWAY = "away"              # lost: serving what it knows, retrying
    CLOSED = "closed"


class Backend:
    kind = "embedded"

    def __init__(self) -> None:
        self.directory: Directory | None = None
        self.state = State.EMBEDDED

    def attach(self, directory: Directory) -> None:
        self.directory = directory

    async def start(self) -> None:
        """Begin (the node record is in ``directory.record``); never waits on the store."""

    def changed(self, name: str) -> None:
        """A local name was put, replaced or removed."""

    def record_changed(self) -> None:
        """This daemon's node record changed (``directory.record``)."""

    def confirmed(self, name: str) -> Awaitable[bool] | None:
        """Until the store holds ``name`` as the directory has it now: True, or False
        when it could not say within its timeout (the name stays queued); raises the
        typed error of a conflict.  None: nothing to wait for."""
        return None

    def fetch(self, name: str) -> Awaitable[tuple[str, bytes, str] | None] | None:
        """A name the mirror lacks, read from the store now: (kind, value, node), or None.
        None instead of an awaitable: nothing to ask (the store is away, or embedded)."""
        return None

    async def close(self) -> None:
        self.state = State.CLOSED

    def status(self) -> dict[str, Any]:
        return {"backend": self.kind, "state": self.state.value}


class Embedded(Backend):
    """This daemon alone: names and watchers serve its own clients."""
