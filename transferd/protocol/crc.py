"""CRC32C (Castagnoli) over views, from the C-accelerated ``crc32c`` package.

The package (a dependency in pyproject.toml) uses the CPU's CRC32 instruction
(SSE 4.2, ARMv8) where there is one, its own table code where not, and takes
any buffer (a memoryview of a region, never a copy).  Imported on first use, so
that a daemon that never verifies never needs it; without it :func:`crc_of`
raises BadRequest saying what to install (a verify asked for is refused, never
skipped).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .errors import BadRequest

_crc: Callable[..., int] | None = None


def require() -> Callable[..., int]:
    """The checksum function; BadRequest saying what to install where there is none."""
    global _crc
    if _crc is None:
        try:
            import crc32c as mod
        except ImportError as exc:
            raise BadRequest(
                "checksums (verify) need the crc32c package, which is not installed "
                "here: pip install crc32c (a dependency of transferd)") from exc
        _crc = mod.crc32c
    return _crc


def crc_of(views: Iterable[Any], value: int = 0) -> int:
    """CRC32C of ``views`` concatenated (continuing ``value``)."""
    fn = require()
    for v in views:
        value = fn(v, value)
    return value


__all__ = ["crc_of", "require"]
