"""The Domain seam: one NIC (one rail of a domain group) behind one interface.

A Domain moves the parts the engine planned to the peer's matching rail and
lands what peers send it.  It is made by the registry (:mod:`.registry`) from
its name, bound to one local address, and owned by a :class:`DomainGroup`,
which is its :class:`Receiver`: the engine-side rules every Domain shares
(bounds and admission of a write, what counts, who gets a message, who the
peers are).  A Domain decides only how bytes travel.

What a Domain does, and when (every call on its group's worker loop):

- ``__init__(receiver, rail, host, port, options)``: bind; listen for peers.
- ``address``: its own address, opaque bytes that travel in NetAddrs (only
  this Domain's class reads them; :meth:`check_address` validates a client's).
- ``register(region) -> rkey`` / ``deregister(region)``: make a registered
  region writable through this NIC; the rkey goes in the region's MrDesc.  A
  deregistered region's writes are refused (the region stops admitting too).
  These two are called on the daemon's loop, not the worker's: a Domain whose
  NIC must be touched from its worker hops there itself.
- ``post(part, transfer)``: send one WritePart or SendPart to ``part.dst``;
  call ``transfer.part_done()`` once the peer acknowledged it (the bytes are
  in place, or a client has the message) or ``transfer.part_done(error)``.
  With more than one rail ``transfer`` may stand for one part only (a
  :class:`~transferd.domains.failover.Resend`, which re-sends the part on
  another rail on PEER_UNREACHABLE): use only its ``part_done``, ``fail``,
  ``finished`` and ``op``.
- inbound: check a write's rkey against what this Domain registered, then
  ``receiver.check_write(...)`` before any byte lands, land the bytes, then
  ``receiver.landed(...)`` (or ``landed_imm`` where the NIC carries the
  immediate; for a WRITE that may carry a write id, ``claim_write`` first and
  ``landed_once`` / ``write_failed`` after); hand a message to
  ``receiver.deliver(peer, msg, ack, link)`` and call
  ``receiver.sender_gone(link)`` when that inbound link closes (the messages
  from it still waiting for a receive are dropped).  The ``peer`` is
  the (node, group) the link authenticated, never a claim.
- ``connect(dst)``: open the link to a peer's rail ahead of use (optional).
- ``drop_stalled(dst, error)``: a transfer to ``dst`` timed out; close a link
  that still holds unsent bytes (optional).
- ``close()``: fail what is outstanding (PEER_UNREACHABLE), stop listening.

The Domain conformance suite (tests/domains/) runs every registered Domain
through the same cases; a new Domain is a module, a registry entry and a
green run of that suite.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from transferd.protocol.errors import TransferdError
from transferd.protocol.keyring import Keyring
from transferd.protocol.peer import WriteHeader
from transferd.protocol.peer_handshake import PeerIdentity
from transferd.protocol.values import NetAddr

if TYPE_CHECKING:
    from transferd.engine.regions import Region
    from transferd.memory import Ref
    from transferd.parts import SendPart, Transfer, WritePart

Peer = tuple[int, int]
# ack(None) once a client has the message, ack(error) if it cannot; any thread.
Ack = Callable[["TransferdError | None"], None]


@dataclass(frozen=True)
class DomainOptions:
    """Settings a Domain may read (from the engine's configuration).

    ``settings`` holds each Domain's own settings under its registry name (verbs:
    ``{"devices": [...], "port": 1, "gid_index": -1}``): the group and the engine
    pass them through unread, and only that Domain looks at them (:meth:`of`).
    """

    seed: int = 0
    max_delay_s: float = 0.005
    max_parts: int = 8
    # Peer links (descriptors) a group holds, all rails together, and how many
    # descriptors below RLIMIT_NOFILE they leave alone (transferd.fds).
    max_links: int = 4096
    fd_reserve: int = 256
    # An outbound link unused this long is closed (0: never).
    link_idle_s: float = 300.0
    # A link whose bytes go unacknowledged this long is given up (rail failover).
    rail_timeout_s: float = 10.0
    # The transferd.fds.LinkBudget every group of the engine shares (None: a group
    # makes its own from max_links and fd_reserve).
    link_budget: Any = None
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def of(self, name: str) -> Mapping[str, Any]:
        """The settings of the Domain registered as ``name`` (empty if none given)."""
        return self.settings.get(name, {})


class Receiver(Protocol):
    """What a Domain may ask of its group (the receiving side's rules, and who we are)."""

    loop: asyncio.AbstractEventLoop
    secret: Keyring | None
    handshake_timeout_s: float

    @property
    def identity(self) -> PeerIdentity: ...

    def bind_peer(self, peer: PeerIdentity) -> None:
        """A link authenticated ``peer``: BadRequest if it contradicts a binding."""

    def region(self, rkey: int, rail: int) -> Region:
        """The region ``rkey`` opens on ``rail`` (NotFound otherwise)."""
        ...

    def check_write(self, region: Region, peer: Peer, w: WriteHeader, payload_len: int,
                    abort: Callable[[], None] | None = None
                    ) -> tuple[list[memoryview], Ref]:
        """Bounds, payload and span checks, then admission: where the bytes go, and
        the Ref to release once they landed (or the write failed)."""
        ...

    def device_io(self, region: Region) -> Any:
        """The DeviceIO (stream, event waiter, staging) of a device region, else None."""
        ...

    def check_device_write(self, region: Region, peer: Peer, w: WriteHeader,
                           payload_len: int, abort: Callable[[], None] | None = None
                           ) -> tuple[list[tuple[int, int]], Ref]:
        """check_write for device memory: each page's device address and length."""
        ...

    def landed(self, peer: Peer, w: WriteHeader, nbytes: int) -> None:
        """A checked WRITE's bytes are in place: count what landed."""

    def claim_write(self, peer: Peer, w: WriteHeader) -> bool:
        """Before a WRITE is checked: True if its write id was applied here already
        (acknowledge ok, place nothing); else one with an id is claimed until
        :meth:`landed_once` or :meth:`write_failed`."""
        ...

    def landed_once(self, peer: Peer, w: WriteHeader, nbytes: int) -> None:
        """:meth:`landed`, remembering a write id as applied."""

    def write_failed(self, peer: Peer, w: WriteHeader) -> None:
        """A claimed WRITE did not land: a retry of it may."""

    def landed_imm(self, peer: Peer, imm: int, nbytes: int) -> None:
        """One unit with its immediate landed (a NIC-carried immediate): one count."""

    def deliver(self, peer: Peer, msg: bytes, ack: Ack, source: Any) -> None:
        """A two-sided message for a posted receive, from inbound link ``source``."""

    def sender_gone(self, source: Any) -> None:
        """Inbound link ``source`` closed: its messages still waiting are dropped."""

    def refused(self, error: TransferdError) -> None:
        """A write was refused (for the metrics)."""

    def delivered(self) -> None:
        """A message was handed to a client (for the metrics)."""


class Domain(abc.ABC):
    """One NIC of a domain group; see the module docstring for the contract."""

    #: The registry name this class is registered under.
    name: str = ""
    rail: int

    @property
    @abc.abstractmethod
    def address(self) -> bytes:
        """This rail's address, as NetAddrs carry it."""

    @abc.abstractmethod
    def check_address(self, raw: bytes) -> None:
        """BadRequest unless ``raw`` is a well-formed address of this kind of Domain."""

    @abc.abstractmethod
    def register(self, region: Region) -> int:
        """Make ``region`` writable through this NIC; its rkey here."""

    @abc.abstractmethod
    def deregister(self, region: Region) -> None:
        """No more writes into ``region`` through this NIC."""

    @abc.abstractmethod
    def post(self, part: WritePart | SendPart, transfer: Transfer) -> None:
        """Send ``part``; ``transfer.part_done([error])`` when the peer acknowledged it."""

    def connect(self, dst: NetAddr) -> None:  # noqa: B027 - optional, a no-op by default
        """Open the link to ``dst`` (one rail) ahead of its first part."""

    def drop_stalled(self, dst: NetAddr, error: TransferdError) -> None:  # noqa: B027
        """A transfer to ``dst`` timed out: let go of a link whose peer reads nothing
        (so the memory its queued bytes lie in can go back).  Optional."""

    @abc.abstractmethod
    def close(self) -> None:
        """Fail what is outstanding (PEER_UNREACHABLE) and stop listening."""
