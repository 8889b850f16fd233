"""The transfer engine: regions, one-sided writes, ImmCounter, peer groups, send/recv."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .immcounter import ImmCounter
from .regions import Region, RegionTable

if TYPE_CHECKING:
    from .engine import TransferEngine

__all__ = ["ImmCounter", "Region", "RegionTable", "TransferEngine"]


def __getattr__(name: str) -> Any:
    # Imported on first use: engine.py imports transferd.domains, whose modules
    # import this package's submodules, so an eager import here is a cycle
    # whenever transferd.domains is imported first.
    if name == "TransferEngine":
        from .engine import TransferEngine

        return TransferEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
