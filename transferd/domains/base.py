"""The Domain seam: one NIC (one rail of a domain group) behind one interface.

A Domain moves the parts the engine planned to the peer's matching rail and lands
what peers send it.  It is made by the registry (:mod:`.registry`) from its name,
bound to one local address, and owned by a :class:`~.group.DomainGroup`, which
gives it a :class:`Port`: who we are and how links are made (:class:`~.links.
LinkContext`), the landing rules every Domain shares (:class:`~transferd.protocol.
peer_landing.Landing`: open a write, then commit or fail it), and where messages go.
What is specific to a NIC stays in the Domain; the link protocol itself (handshake,
frames, ACKs, duplicates, write ids, watermarks) is the sans-IO core of
:mod:`transferd.protocol.peer_link`, which a Domain's I/O feeds.

What a Domain does, and when (every call on its group's worker loop):

- ``__init__(port, rail, host, port_number, options)``: bind; listen for peers.
- ``address``: its own address, opaque bytes that travel in NetAddrs (only this
  Domain's class reads them; :meth:`check_address` validates a client's).
- ``register(region) -> rkey`` / ``deregister(region)``: make a registered region
  writable through this NIC; the rkey goes in the region's MrDesc.  Called on the
  daemon's loop: a Domain whose NIC must be touched from its worker hops there.
- ``post(part, transfer)``: send one WritePart, SendPart or ReadPart to
  ``part.dst``; call ``transfer.part_done()`` once the peer acknowledged it (the
  bytes are in place, or a client has the message; a read's bytes are in its
  ``into`` views) or ``transfer.part_done(error)``.  A ReadPart's views may be
  written only while ``transfer.finished`` is False (after that the memory may be
  its owner's again): what arrives later is dropped.  With more than
  one rail ``transfer`` may stand for one part only (a :class:`~.failover.Resend`):
  use only its ``part_done``, ``fail``, ``finished`` and ``op``.
- inbound READs: ``port.landing.read(rail, rkey, addrs, lens, abort)`` checks the
  rights ("r"), the bounds and admits; send its ``views``, then ``release()``.
- inbound: ``port.landing.open(peer, rail, header, payload_len, abort)`` before
  any byte lands, land the bytes in its views, then ``commit(nbytes)`` or
  ``fail(error)`` (a NIC that places and counts itself: ``port.landing.
  landed_imm``); a message goes to ``port.deliver(peer, msg, ack, link)``, and
  ``port.sender_gone(link)`` when that link closes.  ``peer`` is the (node,
  group) the link authenticated, never a claim.
- ``connect(dst)``, ``drop_stalled(dst, error)`` (optional), ``close()``.
- ``capabilities`` and ``link_stats()``: what it can do, how its links are.

The Domain conformance suite (tests/domains/) runs every registered Domain
through the same cases; a new Domain is a module, a registry entry and a green run
of that suite.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from transferd.parts import RegionInfo
from transferd.protocol.errors import TransferdError
from transferd.protocol.values import NetAddr

if TYPE_CHECKING:
    from transferd.parts import ReadPart, SendPart, Transfer, WritePart
    from transferd.protocol.peer_landing import Landing

    from .links import LinkContext

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
    # Peers a group's peer book remembers (engine.max_peers): least recently bound
    # forgotten first.
    max_peers: int = 16384
    # engine.verify: every write received must carry a checksum (peer_landing).
    verify: bool = False
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def of(self, name: str) -> Mapping[str, Any]:
        """The settings of the Domain registered as ``name`` (empty if none given)."""
        return self.settings.get(name, {})


@dataclass(frozen=True)
class Capabilities:
    """What a kind of Domain can do; the engine asks these, never the Domain's name."""

    #: Receiver code sees every write (it can drop a retry's frame by its write id).
    #: False where the NIC places writes itself (verbs).
    sees_writes: bool = True
    #: The NIC counts immediates (WRITE_WITH_IMM completions), not receiver code.
    counts_immediates: bool = False
    #: Writes into memory reached only through staging (device memory) land here.
    device_memory: bool = True
    #: It serves one-sided READs (ReadPart posted, answered from registered regions).
    reads: bool = True
    #: Its rails are RDMA ports: it needs one ACTIVE and registered memory pinned
    #: (RLIMIT_MEMLOCK), which `transferd doctor` checks for it.
    rdma: bool = False


@dataclass(frozen=True)
class LinkStats:
    """A Domain's links now: ours to peers by state, parts waiting for one, peers'."""

    #: Outbound links by state: ``connecting`` (dial, handshake, set-up),
    #: ``ready``, ``paused`` (over the send watermark), ``closed``.
    states: Mapping[str, int] = field(default_factory=dict)
    waiting: int = 0
    inbound: int = 0


LINK_STATES = ("connecting", "ready", "paused", "closed")

#: An outbound link's key in a Domain's table: one link per peer node, group and rail.
LinkKey = tuple[int, int, bytes]


def link_key(dst: NetAddr) -> LinkKey:
    """The key of the link to ``dst`` (its node, group and first rail's address)."""
    return (dst.node, dst.group, dst.rails[0])


def count_links(links: Iterable[tuple[str, int]], inbound: int) -> LinkStats:
    """LinkStats of ``(state, parts waiting)`` per outbound link; a state that is
    none of LINK_STATES (a Domain's own set-up steps) counts as ``connecting``."""
    states = dict.fromkeys(LINK_STATES, 0)
    waiting = 0
    for state, n in links:
        states[state if state in states else "connecting"] += 1
        waiting += n
    return LinkStats(states, waiting, inbound)


class Port(Protocol):
    """What a Domain may ask of its group (and, behind it, of the engine)."""

    loop: asyncio.AbstractEventLoop

    @property
    def links(self) -> LinkContext:
        """Who we are and how links are made: identity, secret, handshake timeout,
        peer binding, the descriptor budget, the probe table."""
        ...

    @property
    def landing(self) -> Landing:
        """Open a write (then commit or fail it), or count a NIC-counted immediate."""
        ...

    def deliver(self, peer: Peer, msg: bytes, ack: Ack, source: Hashable, *,
                trace: bytes | None = None, op: int = 0) -> None:
        """A two-sided message for a posted receive, from inbound link ``source``;
        ``trace`` the sender's trace id if its SEND carried one, ``op`` its transfer."""

    def sender_gone(self, source: Hashable) -> None:
        """Inbound link ``source`` closed: its messages still waiting are dropped."""


class Domain(abc.ABC):
    """One NIC of a domain group; see the module docstring for the contract."""

    #: The registry name this class is registered under.
    name: ClassVar[str] = ""
    capabilities: Capabilities = Capabilities()
    rail: int

    @property
    @abc.abstractmethod
    def address(self) -> bytes:
        """This rail's address, as NetAddrs carry it."""

    @abc.abstractmethod
    def check_address(self, raw: bytes) -> None:
        """BadRequest unless ``raw`` is a well-formed address of this kind of Domain.

        A function of ``raw`` alone: the group remembers the addresses that passed."""

    @abc.abstractmethod
    def register(self, region: RegionInfo) -> int:
        """Make ``region`` writable through this NIC; its rkey here."""

    @abc.abstractmethod
    def deregister(self, region: RegionInfo) -> None:
        """No more writes into ``region`` through this NIC."""

    @abc.abstractmethod
    def post(self, part: WritePart | SendPart | ReadPart, transfer: Transfer) -> None:
        """Send ``part``; ``transfer.part_done([error])`` when the peer acknowledged it
        (a ReadPart: when every byte it asked is in its ``into`` views)."""

    def connect(self, dst: NetAddr) -> None:  # noqa: B027 - optional, a no-op by default
        """Open the link to ``dst`` (one rail) ahead of its first part."""

    def drop_stalled(self, dst: NetAddr, error: TransferdError) -> None:  # noqa: B027
        """A transfer with parts to ``dst`` failed (timed out, cancelled, refused): let
        go of what the link holds for parts whose transfer ended, views of its source
        and bytes not yet sent (so that memory can go back, and none of it is sent
        later).  Optional."""

    def link_stats(self) -> LinkStats:
        """Its links now (for the metrics); a Domain without links of its own: none."""
        return LinkStats()

    def incoming(self) -> list[Any]:
        """The peer writes being received now (:class:`~transferd.protocol.peer_link.
        Incoming`, for what is in flight); a Domain whose receiver does not see them: none."""
        return []

    @abc.abstractmethod
    def close(self) -> None:
        """Fail what is outstanding (PEER_UNREACHABLE) and stop listening."""
