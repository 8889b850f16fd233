"""How a domain group's links are made: one :class:`LinkContext` its Domains share.

Who we are (the group's identity: node, group, every rail's address), the cluster
secret and the handshake's timeout, the peer book every authenticated link is bound
in, the descriptor budget of every peer link (:class:`~transferd.fds.LinkBudget`)
and the PROBE table (:class:`~.probes.Probes`).  A Domain makes the sans-IO ends of
:mod:`transferd.protocol.peer_link` with :meth:`outbound` and :meth:`inbound`, so
every Domain's links run the same handshake with the same rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transferd.fds import LinkBudget
from transferd.logs import peer_warning
from transferd.protocol.errors import PeerUnreachable
from transferd.protocol.keyring import Keyring
from transferd.protocol.peer_handshake import PeerIdentity
from transferd.protocol.peer_inbound import InboundLink
from transferd.protocol.peer_link import LinkEnd
from transferd.protocol.peer_outbound import OutboundLink
from transferd.protocol.values import NetAddr

from .inbound_room import InboundRoom
from .peers import PeerBook
from .probes import Probes

if TYPE_CHECKING:
    from transferd.protocol.peer_landing import Landing


class LinkContext:
    def __init__(self, identity: Callable[[], PeerIdentity], secret: Keyring | None,
                 handshake_timeout_s: float, budget: LinkBudget, book: Callable[[], PeerBook],
                 probes: Probes, max_message: int, room: InboundRoom | None = None) -> None:
        self._identity = identity
        # Every group's addresses of this daemon (the engine sets them once all are
        # bound): without a secret an initiator lists them, its node id is theirs.
        self.everyone: tuple[tuple[bytes, ...], ...] | None = None
        self.secret = secret
        self.handshake_timeout_s = handshake_timeout_s
        self.budget = budget
        # The proved inbound links of every rail: at the budget's cap a newcomer takes
        # the place of the busiest source's oldest (inbound_room.py).
        self.room = room if room is not None else InboundRoom(budget)
        self._book = book
        self.probes = probes
        self.max_message = max_message

    @property
    def identity(self) -> PeerIdentity:
        return self._identity()

    def bind_peer(self, peer: PeerIdentity) -> None:
        """A link authenticated ``peer``: BadRequest if it contradicts a binding."""
        self._book().bind(peer)

    def outbound(self, rail: int, dst: NetAddr, now: float) -> OutboundLink:
        """Our end of a link to ``dst`` (one rail's address), in CONNECTING."""
        return OutboundLink(self.identity, rail, self.secret, now,
                            expect=(dst.node, dst.group, dst.rails[0]),
                            timeout=self.handshake_timeout_s, admit=self.bind_peer,
                            everyone=self.everyone)

    def inbound(self, rail: int, landing: Landing, now: float,
                abort: Callable[[], None] | None = None,
                stream_frames: bool = True) -> InboundLink:
        """The end of a link a peer dialled to our ``rail``, in HANDSHAKE."""
        return InboundLink(self.identity, rail, self.secret, now, landing=landing,
                           timeout=self.handshake_timeout_s, max_message=self.max_message,
                           admit=self.bind_peer, abort=abort, stream_frames=stream_frames)

    @staticmethod
    def inbound_ended(core: LinkEnd, rail: int, addr: Any) -> None:
        """A proved link this daemon cut for what its peer sent (a frame past a limit,
        framing it cannot trust, checksums that kept failing) is logged, with why: the
        data phase has no frame to tell the peer, which sees its connection reset, and
        nothing else would name it.  (PeerUnreachable: the socket ended, or this daemon
        closed the link for its own reasons: said where they are.)"""
        err, peer = core.error, core.peer
        if peer is not None and err is not None and not isinstance(err, PeerUnreachable):
            peer_warning("peer link cut", peer.node, rail, addr, err)
