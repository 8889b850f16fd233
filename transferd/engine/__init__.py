"""The transfer engine: regions, one-sided writes, ImmCounter, peer groups, send/recv."""

from __future__ import annotations

from .engine import TransferEngine
from .immcounter import ImmCounter
from .regions import Region, RegionTable

__all__ = ["ImmCounter", "Region", "RegionTable", "TransferEngine"]
