"""CUDA IPC's offset inside an allocation is known or refused, never guessed (issue 24.6).

``ipc_span`` is what both sides apply to the driver's answer
(``cuMemGetAddressRange``): the client before it exports a handle, the daemon
on what it opened.  Without a driver here, the answer is given directly.
"""

from __future__ import annotations

import pytest

from transferd.memory.cuda_extent import address_range, ipc_span
from transferd.protocol.errors import BadRequest, OutOfBounds

BASE = 0x7F00_0000_0000


def test_a_range_inside_a_pool_block_is_exported_at_its_offset() -> None:
    # An array 1 MiB into a 8 MiB block of CuPy's pool: the handle is the block's.
    assert ipc_span(BASE + (1 << 20), 1 << 20, (BASE, 8 << 20)) == (BASE, 1 << 20)
    assert ipc_span(BASE, 8 << 20, (BASE, 8 << 20)) == (BASE, 0)


def test_an_unknown_allocation_is_refused_not_guessed() -> None:
    # The old code took the pointer for the base: the daemon opened the block at its
    # start and served the wrong bytes, silently.
    with pytest.raises(BadRequest, match="not registering it at a guessed offset"):
        ipc_span(BASE + 4096, 4096, None)


def test_a_range_past_its_allocation_is_refused() -> None:
    with pytest.raises(OutOfBounds):
        ipc_span(BASE + (8 << 20) - 8, 16, (BASE, 8 << 20))
    with pytest.raises(OutOfBounds):
        ipc_span(BASE - 8, 16, (BASE, 8 << 20))


def test_without_a_driver_the_extent_is_unknown() -> None:
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert address_range(BASE) is None
    else:  # pragma: no cover - a machine with a driver: an unmapped pointer is unknown
        assert address_range(8) is None
