"""Named leases on the client: buffers that outlive this connection while someone renews them.

::

    async with client.lease("kv/req-42", ttl=10.0) as lease:   # LEASE, then renewed
        buf = await lease.alloc_buffer(1 << 20)                  # owned by the lease
        ...                                                      # every ttl/3 in the background
    # leaving the block ends the lease: its buffers are freed, their rkeys revoked

``lease.detach()`` inside the block stops renewing without ending it: the
buffers then stay until the ttl runs out, unless another connection (another
process) joins the lease and renews it: ``client.lease(name, ttl, join=True)`` or
``client.renew_lease(name, ttl, join=True)``.  Without ``join`` a name another
connection made is refused (BadRequest), so two clients that picked one name never
share and free each other's buffers.  docs/engine.md ("Owners and leases") has the
model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from transferd.protocol.constants import Command
from transferd.protocol.errors import NotFound, TransferdError

if TYPE_CHECKING:
    from .buffers import RemoteBuffer
    from .calls import Calls

    AllocBuffer = Callable[..., Awaitable[RemoteBuffer]]

log = logging.getLogger("transferd.client")


def _ttl_ms(ttl: float) -> int:
    return max(0, round(ttl * 1000))


class Lease:
    """A named lease this client renews until the block ends (or :meth:`detach`)."""

    def __init__(self, leases: Leases, name: str, ttl: float, *, end: bool = True,
                 join: bool = False) -> None:
        self.leases = leases
        self.name = name
        self.ttl = ttl
        # Take part in a lease another connection made (else that is refused).
        self.join = join
        # End the lease (free its buffers) when the block ends.
        self.end_on_exit = end
        self.created = False
        # The renewal that failed, if one did (the lease may then expire).
        self.error: TransferdError | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Lease:
        self.created = await self.leases.renew_lease(self.name, self.ttl, join=self.join)
        self._task = asyncio.ensure_future(self._renew_forever())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop()
        if self.end_on_exit and self.leases.client.conn.lost is None:
            with contextlib.suppress(NotFound):  # expired meanwhile: nothing left to end
                await self.leases.end_lease(self.name)

    def detach(self) -> None:
        """Stop renewing; the lease lives on until its ttl runs out or another renews it."""
        self.end_on_exit = False
        self._stop()

    def _stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def renew(self) -> None:
        await self.leases.renew_lease(self.name, self.ttl, join=self.join)

    async def alloc_buffer(self, size: int, device: str = "cpu") -> RemoteBuffer:
        """A buffer this lease owns."""
        return await self.leases.alloc(size, device, lease=self.name)

    async def _renew_forever(self) -> None:
        # A third of the ttl: two renewals may be lost (or late) before it runs out.
        period = self.ttl / 3
        while True:
            await asyncio.sleep(period)
            try:
                await self.leases.renew_lease(self.name, self.ttl, join=self.join)
            except TransferdError as exc:
                self.error = exc
                log.warning("lease %r: renewal failed: %s", self.name, exc)
                if self.leases.client.conn.lost is not None or isinstance(exc, NotFound):
                    return  # nothing more to renew on (or with)


class Leases:
    """The lease operations of a Client; ``alloc`` is its ``alloc_buffer``."""

    def __init__(self, client: Calls, alloc: AllocBuffer) -> None:
        self.client = client
        self.alloc = alloc

    def lease(self, name: str, ttl: float, *, end: bool = True, join: bool = False) -> Lease:
        """An async context manager: makes lease ``name`` (``join=True``: or joins the one
        another connection made), renews it meanwhile, and ends it when the block ends
        (``end=False``: leaves it to run out)."""
        return Lease(self, name, ttl, end=end, join=join)

    async def renew_lease(self, name: str, ttl: float, *, join: bool = False) -> bool:
        """LEASE: make ``name`` (True) or renew it (False) for ``ttl`` seconds from now;
        one another connection made is refused (BadRequest) unless ``join``.

        Not a flush point: sent at once, beside whatever is queued (a lease
        orders nothing).
        """
        client = self.client
        r = await client.conn.request(Command.LEASE, _body(name, join, ttl_ms=_ttl_ms(ttl)),
                                      timeout=client.timeout)
        return bool(r.body.get("created"))

    async def end_lease(self, name: str, *, join: bool = False) -> int:
        """END_LEASE: free the lease's buffers now; how many there were.  A lease this
        connection neither made nor joined is refused (BadRequest) unless ``join``."""
        r = await self.client._call(Command.END_LEASE, _body(name, join))
        return int(r.body.get("buffers", 0))


def _body(name: str, join: bool, **more: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"lease": name, **more}
    if join:
        body["join"] = True
    return body


def owner_fields(owner: str | None, lease: str | None) -> dict[str, Any]:
    """ALLOC_BUFFER's owner fields: ``owner`` and/or ``lease`` where given."""
    body: dict[str, Any] = {}
    if owner is not None:
        body["owner"] = owner
    if lease is not None:
        body["lease"] = lease
    return body
