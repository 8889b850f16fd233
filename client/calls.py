"""What a part of the client may ask of its Client.

``Client`` is built from parts, each a small class holding what it needs:
engine operations (:mod:`.engine`), async device copies (:mod:`.copies`),
CUDA IPC registration (:mod:`.cuda_ipc`), leases (:mod:`.leases`) and UVM
watchers (:mod:`.watchers`).  A part is given the Client as one of the
protocols below, never the class itself: this module is a leaf, the parts
import it, client.py imports the parts, and nothing imports client.py back.

- :class:`Calls`: the connection, the client's request timeout, and calls
  that are flush points (queued reads and writes go first, one-way failures
  reported meanwhile are raised there).
- :class:`Queue`: that, plus the client's queue itself, for the async
  copies, whose SETs wait in it for their device copies.

Once the client closes, its parts hold it as a :class:`Closed` (weakly): a part held
the client and the client its parts, a reference cycle only the cyclic collector frees.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from transferd.protocol.errors import ConnectionLost

if TYPE_CHECKING:
    from transferd.protocol.constants import Command
    from transferd.protocol.frames import Frame

    from .connection import Connection
    from .queue import QueuedGet, QueuedSet
    from .switches import Switches


class Calls(Protocol):
    """The Client as its parts see it."""

    timeout: float | None

    @property
    def conn(self) -> Connection:
        """The connection (TransferdError when not connected)."""
        ...

    def _call(self, cmd: Command, body: dict[str, Any] | None = None, payload: Sequence[Any] = (),
              sink: Any = None) -> Awaitable[Frame]:
        """A synchronous command: a flush point, then one round trip."""
        ...

    async def flush(self) -> None:
        """Send everything queued and wait for its reads."""

    def _queued(self) -> bool:
        """Whether reads or writes wait in the queue (a flush would send them)."""
        ...


class Queue(Calls, Protocol):
    """The Client with its queue of reads and writes (for the async copies)."""

    switches: Switches
    _queue: list[QueuedSet | QueuedGet]

    def _send_now(self, ops: list[QueuedSet | QueuedGet]) -> None:
        """Send ``ops`` now (their reads resolve when their replies come)."""

    def _op_queue(self) -> list[QueuedSet | QueuedGet]:
        """The queue as ops (what was queued as columns first), for a copy to join."""

    async def set_tensor(self, t: Any, data: Any) -> None: ...

    async def get_tensor(self, t: Any, out: Any = None) -> Any: ...


class Closed:
    """A closed Client as its parts hold it: weakly. Every attribute is the client's
    while something else refers to it (a call after the close fails as it did, a
    reopened client works as before); once the client is gone, ConnectionLost."""

    __slots__ = ("_ref",)

    def __init__(self, client: object) -> None:
        self._ref = weakref.ref(client)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # (what vars(), copy, pickle look for: not the client's)
            raise AttributeError(name)
        c = self._ref()
        if c is None:
            raise ConnectionLost("this client was closed")
        return getattr(c, name)


def weak_method(held: Closed, name: str) -> Callable[..., Any]:
    """The client's method ``name`` through ``held``, looked up at each call (a bound
    method would hold the client)."""

    def call(*args: Any, **kw: Any) -> Any:
        return getattr(held, name)(*args, **kw)

    return call
