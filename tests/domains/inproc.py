"""A Domain defined entirely here, to show what adding one takes: this module and a
:func:`register_domain` call; nothing else in the project changes.

Two groups in one process; a write is handed over through the loop (``call_soon``)
and copied into the receiver's region by the receiver's own rules (its port's
``landing``: open, land in the views, commit), a message goes to its ``deliver``.
The peer is the sending group's identity (in one process there is nobody to doubt).
"""

from __future__ import annotations

import itertools

from transferd.domains.base import Domain, DomainOptions, Port
from transferd.domains.registry import register_domain
from transferd.parts import ReadPart, RegionInfo, SendPart, Transfer, WritePart
from transferd.protocol.errors import BadRequest, PeerUnreachable, TransferdError
from transferd.protocol.peer_wire import WriteHeader
from transferd.protocol.values import NetAddr

PREFIX = b"inproc:"
_SWITCHBOARD: dict[bytes, InProcDomain] = {}
_ids = itertools.count(1)


class InProcDomain(Domain):
    name = "inproc"

    def __init__(self, port: Port, rail: int, host: str, port_number: int,
                 options: DomainOptions) -> None:
        self.port = port
        self.rail = rail
        self._address = PREFIX + str(next(_ids)).encode()
        self.closed = False
        _SWITCHBOARD[self._address] = self

    @property
    def address(self) -> bytes:
        return self._address

    def check_address(self, raw: bytes) -> None:
        if not raw.startswith(PREFIX) or not raw[len(PREFIX):].isdigit():
            raise BadRequest(f"not an in-process address: {raw!r}")

    def register(self, region: RegionInfo) -> int:
        # The region table's own secret for this rail: the landing rules find the
        # region by it, as for tcp.
        return region.rkeys[self.rail]

    def deregister(self, region: RegionInfo) -> None:
        pass  # the region table forgets the rkeys and the region stops admitting

    def post(self, part: WritePart | SendPart | ReadPart, transfer: Transfer) -> None:
        peer = _SWITCHBOARD.get(part.dst.rails[0])
        if self.closed or peer is None or peer.closed:
            transfer.part_done(PeerUnreachable(f"no in-process Domain at {part.dst}"))
            return
        me = self.port.links.identity
        self.port.loop.call_soon(peer._arrive, me.key, part, transfer)

    def _arrive(self, sender: tuple[int, int], part: WritePart | SendPart | ReadPart,
                transfer: Transfer) -> None:
        if self.closed:
            transfer.part_done(PeerUnreachable("the peer closed"))
            return
        p = self.port
        if isinstance(part, ReadPart):
            try:
                src = p.landing.read(self.rail, part.rkey, list(part.addrs), list(part.lens))
            except TransferdError as exc:
                transfer.part_done(exc)
                return
            data = b"".join(bytes(v) for v in src.views)  # a copy: it is a test Domain
            src.release()
            if not transfer.finished:  # (an ended transfer's memory is not ours to write)
                pos = 0
                for v in part.into:
                    v[:] = data[pos:pos + len(v)]
                    pos += len(v)
            transfer.part_done(None)
            return
        if isinstance(part, SendPart):
            def ack(err: TransferdError | None) -> None:
                p.loop.call_soon_threadsafe(transfer.part_done, err)

            p.deliver(sender, bytes(part.msg), ack, self, trace=part.trace, op=part.op)
            return
        w = WriteHeader(part.op, part.index, part.rkey, list(part.addrs), list(part.lens),
                        part.imm, (part.span[0], part.span[1]) if part.span else None,
                        part.wid, part.again)
        try:
            adm = p.landing.open(sender, self.rail, w, part.nbytes)
        except TransferdError as exc:
            transfer.part_done(exc)
            return
        if not adm.duplicate:
            src = b"".join(bytes(v) for v in part.src)  # a copy: it is a test Domain
            pos = 0
            for v in adm.views:
                v[:] = src[pos:pos + len(v)]
                pos += len(v)
        adm.commit(part.nbytes)
        transfer.part_done(None)

    def connect(self, dst: NetAddr) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        _SWITCHBOARD.pop(self._address, None)


def register() -> None:
    register_domain("inproc", InProcDomain)
