"""The client's A/B switches (PROTOCOL.md), read once at connect time."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Switches:
    """The A/B switches of PROTOCOL.md, read once at connect time."""

    batched_get: bool = True
    batched_set: bool = True
    async_copy: bool = True
    stats_ms: int = 0

    @classmethod
    def from_env(cls) -> Switches:
        stats_ms = 0
        if _env_flag("TRANSFERD_STATS"):
            stats_ms = int(os.environ.get("TRANSFERD_STATS_MS", "5000") or 5000)
        return cls(
            batched_get=not _env_flag("TRANSFERD_NO_BATCHED_GET"),
            batched_set=not _env_flag("TRANSFERD_NO_BATCHED_SET"),
            async_copy=not _env_flag("TRANSFERD_NO_ASYNC_COPY"),
            stats_ms=stats_ms,
        )
