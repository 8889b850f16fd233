"""The client's own bounds check raises what the server would: OutOfBounds."""

from __future__ import annotations

import pytest

from client import RemoteBuffer
from transferd.protocol.constants import ErrorCode
from transferd.protocol.errors import OutOfBounds


@pytest.mark.parametrize(("offset", "size"), [(60, 8), (-1, 4), (0, 65), (64, 1), (3, -1)])
def test_a_tensor_outside_its_buffer_is_out_of_bounds(offset: int, size: int) -> None:
    with pytest.raises(OutOfBounds, match=r"is outside buffer 7 of 64 bytes") as info:
        RemoteBuffer(7, 64).tensor(offset, size)
    assert info.value.code is ErrorCode.OUT_OF_BOUNDS


def test_a_tensor_inside_is_fine() -> None:
    t = RemoteBuffer(7, 64).tensor(60, 4)
    assert (t.buffer, t.offset, t.size) == (7, 60, 4)
    assert RemoteBuffer(7, 64).tensor(64).size == 0
