"""What every session of one daemon shares: settings, counters, and the node's Service.

The buffers, the engine, owners, leases, watchers and names are the node's
(:class:`transferd.service.Service`, which the inproc client calls too); this
context adds what only the RPC server has: the protocol's settings and limits,
the pre-auth admission, the open sessions, STATS' counts and the drain."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transferd import __version__
from transferd.memory import BufferTable
from transferd.memory.leases import LeaseTable
from transferd.metrics import Metrics
from transferd.preauth import Admission, Ticket
from transferd.protocol import auth
from transferd.protocol.connection import ServerSettings
from transferd.protocol.constants import DEFAULT_MAX_BODY, DEFAULT_MAX_PAYLOAD, Command
from transferd.service import Service

log = logging.getLogger("transferd.session")

if TYPE_CHECKING:
    from transferd.discovery.service import Discovery
    from transferd.engine import TransferEngine


@dataclass
class ServerStats:
    """What STATS reports: commands received since start, on all connections."""

    commands: dict[Command, int] = field(default_factory=lambda: dict.fromkeys(Command, 0))
    bytes_in: int = 0
    bytes_out: int = 0

    def to_body(self) -> dict[str, Any]:
        return {
            "commands": {c.name: n for c, n in self.commands.items()},
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
        }


@dataclass
class ServerContext:
    service: Service
    minor: int = 2
    token: str = ""
    max_body: int = DEFAULT_MAX_BODY
    max_payload: int = DEFAULT_MAX_PAYLOAD
    # Per-request caps (announced in HELLO): tensors per batch, payload bytes per reply.
    max_tensors: int = 65536
    max_reply: int = DEFAULT_MAX_PAYLOAD
    # Announced in HELLO on a message transport: the continuation message size.
    max_message: int = 256 * 1024
    stats: ServerStats = field(default_factory=ServerStats)
    name: str = f"transferd/{__version__}"
    # The shared secret clients prove (b"": none required), the transports on
    # which the token method is offered, and the handshake's deadline.
    secret: bytes = b""
    # During a rotation, the secret clients proved before (also accepted; b"": none).
    previous_secret: bytes = b""
    token_transports: tuple[str, ...] = ("unix", "seqpacket", "tls")
    handshake_timeout: float = 5.0
    admission: Admission = field(default_factory=Admission)
    # One ServerSettings per listener scheme, shared by its connections (a
    # reload of the secret updates them in place).
    _settings: dict[str, ServerSettings] = field(default_factory=dict)
    _refused_logged: float = 0.0
    _gave_way_logged: float = 0.0
    # The open (admitted) connections, for the drain at SIGTERM (rpc_server/drain.py);
    # bounded by the daemon's descriptors.  While draining, new requests are refused.
    sessions: set[Any] = field(default_factory=set)
    draining: bool = False
    # The commands with a handler (None: every command of the minor is tried).
    served: frozenset[int] | None = None

    def __post_init__(self) -> None:
        if self.token and not self.secret:
            self.secret = auth.secret_from_text(self.token)

    # The node's parts, as the handlers name them (each is the Service's).

    @property
    def buffers(self) -> BufferTable:
        return self.service.buffers

    @property
    def metrics(self) -> Metrics:
        return self.service.metrics

    @property
    def engine(self) -> TransferEngine | None:
        return self.service.engine

    @property
    def leases(self) -> LeaseTable | None:
        return self.service.leases

    @property
    def discovery(self) -> Discovery | None:
        """The daemon's names, if it has them yet (an embedded set is made on first use)."""
        return self.service.discovery if self.service.has_discovery else None

    @property
    def default_owner(self) -> str:
        return self.service.default_owner

    def settings_for(self, scheme: str, message: bool = False) -> ServerSettings:
        st = self._settings.get(scheme)
        if st is None:
            st = self._settings[scheme] = ServerSettings(
                minor=self.minor,
                name=self.name,
                features=self.features(),
                max_body=self.max_body,
                max_payload=self.max_payload,
                secret=self.secret,
                previous_secret=self.previous_secret,
                token_allowed=scheme in self.token_transports,
                max_message=self.max_message if message else None,
                handshake_timeout=self.handshake_timeout,
                limits={"max_tensors": self.max_tensors, "max_reply": self.max_reply},
                served=self.served,
            )
        return st

    def set_secret(self, secret: bytes, previous: bytes = b"") -> None:
        """A new secret (SIGHUP): the next handshakes use it; open connections stay."""
        self.secret, self.previous_secret = secret, previous
        for st in self._settings.values():
            st.secret, st.previous_secret = secret, previous

    def note_refused_connection(self, source: str, why: str) -> None:
        # One line per 5 s at most: a flood must not become a flood of logs.
        now = time.monotonic()
        if now - self._refused_logged >= 5.0:
            self._refused_logged = now
            log.warning("connection from %s refused: %s (%d refused so far)",
                        source, why, self.admission.refused)

    def gave_way(self, tickets: list[Ticket]) -> None:
        """Close the connections the admission handed back (expired, or the oldest that
        gave way to a newer one); one log line per 5 s at most."""
        if not tickets:
            return
        now = time.monotonic()
        if now - self._gave_way_logged >= 5.0:
            self._gave_way_logged = now
            t = tickets[0]
            log.warning("connection from %s closed before it authenticated: %s (%d so far; "
                        "server.max_handshakes_per_source, server.max_handshakes)",
                        t.source, t.why.value if t.why else "?",
                        self.admission.evicted + self.admission.expired)
        self.admission.close(tickets)

    def features(self) -> list[str]:
        if self.minor < 2:
            return []
        feats = ["batched_get", "batched_set", "no_reply_events"]
        if self.engine is not None:
            feats.append("engine")
            if self.engine.capabilities.reads:  # SINGLE_READ ... GATHER (0x36-0x38)
                feats.append("read")
            feats.append("armed_writes")  # ARM_PAGED_WRITES (0x39)
        feats.append("names")  # PUBLISH ... NAMES (0x30-0x35), with or without the engine
        return feats
