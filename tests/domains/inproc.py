"""A Domain defined entirely here, to show what adding one takes: this module and a
:func:`register_domain` call; nothing else in the project changes.

Two groups in one process; a write is handed over through the loop (``call_soon``)
and copied into the receiver's region by the receiver's own rules (its ``region``,
``check_write``, ``landed``), a message goes to its ``deliver``.  The peer is the
sending group's identity (in one process there is nobody to doubt).
"""

from __future__ import annotations

import itertools
import secrets
from typing import TYPE_CHECKING

from transferd.domains.base import Domain, DomainOptions, Receiver
from transferd.domains.registry import register_domain
from transferd.parts import SendPart, Transfer, WritePart
from transferd.protocol.errors import BadRequest, NotFound, PeerUnreachable, TransferdError
from transferd.protocol.peer import WriteHeader
from transferd.protocol.values import NetAddr

if TYPE_CHECKING:
    from transferd.engine.regions import Region

PREFIX = b"inproc:"
_SWITCHBOARD: dict[bytes, InProcDomain] = {}
_ids = itertools.count(1)


class InProcDomain(Domain):
    name = "inproc"

    def __init__(self, receiver: Receiver, rail: int, host: str, port: int,
                 options: DomainOptions) -> None:
        self.receiver = receiver
        self.rail = rail
        self._address = PREFIX + str(next(_ids)).encode()
        self._mrs: dict[int, Region] = {}
        self.closed = False
        _SWITCHBOARD[self._address] = self

    @property
    def address(self) -> bytes:
        return self._address

    def check_address(self, raw: bytes) -> None:
        if not raw.startswith(PREFIX) or not raw[len(PREFIX):].isdigit():
            raise BadRequest(f"not an in-process address: {raw!r}")

    def register(self, region: Region) -> int:
        rkey = secrets.randbits(64) or 1
        self._mrs[rkey] = region
        return rkey

    def deregister(self, region: Region) -> None:
        for k in [k for k, r in self._mrs.items() if r is region]:
            del self._mrs[k]

    def post(self, part: WritePart | SendPart, transfer: Transfer) -> None:
        peer = _SWITCHBOARD.get(part.dst.rails[0])
        if self.closed or peer is None or peer.closed:
            transfer.part_done(PeerUnreachable(f"no in-process Domain at {part.dst}"))
            return
        me = self.receiver.identity
        self.receiver.loop.call_soon(peer._arrive, me.key, part, transfer)

    def _arrive(self, sender: tuple[int, int], part: WritePart | SendPart,
                transfer: Transfer) -> None:
        if self.closed:
            transfer.part_done(PeerUnreachable("the peer closed"))
            return
        r = self.receiver
        if isinstance(part, SendPart):
            def ack(err: TransferdError | None) -> None:
                r.loop.call_soon_threadsafe(transfer.part_done, err)

            r.deliver(sender, bytes(part.msg), ack, self)
            return
        w = WriteHeader(part.op, part.index, part.rkey, list(part.addrs), list(part.lens),
                        part.imm, tuple(part.span) if part.span else None)
        try:
            region = self._mrs.get(part.rkey)
            if region is None:
                raise NotFound("rkey does not name a region registered here")
            views, ref = r.check_write(region, sender, w, part.nbytes)
        except TransferdError as exc:
            r.refused(exc)
            transfer.part_done(exc)
            return
        try:
            src = b"".join(bytes(v) for v in part.src)  # a copy: it is a test Domain
            pos = 0
            for v in views:
                v[:] = src[pos:pos + len(v)]
                pos += len(v)
            r.landed(sender, w, part.nbytes)
        finally:
            ref.release()
        transfer.part_done(None)

    def connect(self, dst: NetAddr) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        _SWITCHBOARD.pop(self._address, None)


def register() -> None:
    register_domain("inproc", InProcDomain)
