"""The READ part of the client: pull a peer region's bytes into a region of your own.

``await c.submit_single_read(length, (mr, dst_off), (desc, src_off))`` and
``await c.submit_paged_reads(page_len, (mr, Pages(...)), (desc, Pages(...)))`` return a
:class:`~client.engine.Completion` at once, as the writes do; it resolves when every
byte is in the local region (``mr``, registered on this client's daemon), or fails
with the typed error: ``NotFound`` for an rkey that is unknown, revoked, or names a
region its owner registered without ``access="r"`` (one answer for all three),
``OutOfBounds``, ``PeerUnreachable``, ``Timeout``, ``Cancelled``.  ``timeout=`` and
``completion.cancel()`` as for a write; a read can simply be repeated (no read id).
``verify=`` and ``traceparent=`` as for a write (docs/integrity.md): the responder's
CRC32C of what it sent checked against the reader daemon's of what landed; the trace
id (by default the current OpenTelemetry span's) on the read in both daemons.
``submit_gather(mr, [(len, dst_off, desc, src_off), ...])`` reads several ranges, of
one peer or several, into one region, with one completion.  The daemon lists ``read``
in HELLO's ``features`` when it serves these (docs/protocol.md, 0x36-0x38).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from transferd.protocol.constants import Command
from transferd.protocol.values import MrDesc, Pages

from .tracing import tag as _tag

if TYPE_CHECKING:
    from .engine import Completion, EngineOps, MrHandle


class ReadOps:
    """One-sided reads, over the engine part's submit (its EVENT routing and CANCEL)."""

    def __init__(self, engine: EngineOps) -> None:
        self._engine = engine

    async def submit_single_read(
        self, length: int, dst: tuple[MrHandle, int], src: tuple[MrDesc, int],
        *, timeout: float | None = None, verify: bool | None = None,
        traceparent: str | None = None,
    ) -> Completion:
        body: dict[str, Any] = {"len": length, "dst": [dst[0].id, dst[1]],
                                "src": [src[0].to_wire(), src[1]]}
        _tag(body, verify, traceparent)
        return await self._engine._submit(Command.SINGLE_READ, body, timeout=timeout)

    async def submit_paged_reads(
        self, page_len: int, dst: tuple[MrHandle, Pages], src: tuple[MrDesc, Pages],
        *, timeout: float | None = None, verify: bool | None = None,
        traceparent: str | None = None,
    ) -> Completion:
        body: dict[str, Any] = {"page_len": page_len,
                                "dst": [dst[0].id, dst[1].to_wire()],
                                "src": [src[0].to_wire(), src[1].to_wire()]}
        _tag(body, verify, traceparent)
        return await self._engine._submit(Command.PAGED_READS, body, timeout=timeout)

    async def submit_gather(
        self, dst: MrHandle, srcs: Sequence[tuple[int, int, MrDesc, int]],
        *, timeout: float | None = None, verify: bool | None = None,
        traceparent: str | None = None,
    ) -> Completion:
        body: dict[str, Any] = {"mr": dst.id, "srcs": [[n, d, desc.to_wire(), s]
                                                       for n, d, desc, s in srcs]}
        _tag(body, verify, traceparent)
        return await self._engine._submit(Command.GATHER, body, timeout=timeout)
