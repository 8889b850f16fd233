"""What every session of one daemon shares: settings, buffers, counters, engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transferd import __version__
from transferd.memory import BufferTable
from transferd.metrics import Metrics
from transferd.protocol.constants import DEFAULT_MAX_BODY, DEFAULT_MAX_PAYLOAD, Command

if TYPE_CHECKING:
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
    buffers: BufferTable
    metrics: Metrics
    minor: int = 2
    token: str = ""
    max_body: int = DEFAULT_MAX_BODY
    max_payload: int = DEFAULT_MAX_PAYLOAD
    # Announced in HELLO on a message transport: the continuation message size.
    max_message: int = 256 * 1024
    engine: TransferEngine | None = None
    stats: ServerStats = field(default_factory=ServerStats)
    name: str = f"transferd/{__version__}"

    def features(self) -> list[str]:
        if self.minor < 2:
            return []
        feats = ["batched_get", "batched_set", "no_reply_events"]
        if self.engine is not None:
            feats.append("engine")
        return feats
