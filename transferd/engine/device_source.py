"""Where each page of a write from device memory goes in pinned staging.

Checked and placed on the daemon's loop before anything is copied: a bad page
fails the submit at once, with nothing staged or sent.
"""

from __future__ import annotations

from typing import Any

from transferd.protocol.errors import BadRequest, OutOfBounds

from .regions import Region


def plan_staging(region: Region, pages: list[tuple[int, int]], what: str = "a write from"
                 ) -> tuple[Any, list[int], list[tuple[int, int]], int]:
    """(the region's device I/O, each page's device address, each page's (chunk,
    offset) in staging, how many chunks) for pages of (absolute address, length);
    ``what``: the transfer as its refusal names it ("a write from", "a read into")."""
    io = region.staging
    assert io is not None
    device_address = region.device_address  # bounds checked
    pool = io.pool
    devs: list[int] = []
    places: list[tuple[int, int]] = []  # (chunk, offset): pages never straddle chunks
    ci, used = 0, 0
    for a, n in pages:
        off = a - region.ptr
        if off < 0 or n < 0 or off + n > region.size:
            raise OutOfBounds(f"[0x{a:x}, +{n}) is outside region {region.id} "
                              f"[0x{region.ptr:x}, +{region.size})")
        if n > pool.chunk_size:
            raise BadRequest(f"{what} {region.buffer.device} memory: a page of {n} bytes is "
                             f"larger than a staging chunk ({pool.chunk_size} bytes)")
        devs.append(device_address(off, n))
        if used + n > pool.chunk_size:
            ci, used = ci + 1, 0
        places.append((ci, used))
        used += n
    need = ci + 1
    if need > pool.capacity:
        raise BadRequest(f"{what} {region.buffer.device} memory needs {need} staging "
                         f"chunks, its pool has {pool.capacity}")
    return io, devs, places, need
