"""client.shared.map_shared: what an ALLOC_BUFFER reply must carry before anything is mapped."""

from __future__ import annotations

import os

import pytest

from client.shared import SharedBuffer, map_shared
from transferd.memory import BufferTable, DeviceSpec
from transferd.protocol.errors import BadFrame, BadRequest, OutOfBounds

MiB = 1 << 20


def _memfd(size: int) -> int:
    fd = os.memfd_create("t")
    os.ftruncate(fd, size)
    return fd


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_maps_the_daemons_pages_and_closes_the_descriptor() -> None:
    t = BufferTable([DeviceSpec("shm", 4 * MiB)])
    b = t.alloc("shm", 5000)
    assert b.memory is not None
    fd = os.dup(b.memory.fd() or -1)
    buf = map_shared(b.id, 5000, "shm", b.memory.describe(), [fd])
    assert isinstance(buf, SharedBuffer) and _closed(fd)
    b.view(10, 4)[:] = b"wxyz"
    assert bytes(buf.view[10:14]) == b"wxyz" and buf.array[10] == ord("w")
    buf.local(4996, 4)[:] = b"tail"
    assert bytes(b.view(4996, 4)) == b"tail"
    with pytest.raises(OutOfBounds):
        buf.local(4997, 4)  # outside the 5000 bytes (the mapping's page is not the buffer)
    buf.unmap()
    with pytest.raises(BadRequest):
        _ = buf.view
    t.free_buffer(b.id)


def test_a_descriptor_announced_but_not_sent_maps_nothing() -> None:
    with pytest.raises(BadFrame, match="one descriptor"):
        map_shared(1, 10, "shm", {"map_size": 4096}, [])


@pytest.mark.parametrize("body", [{}, {"map_size": 0}, {"map_size": "4096"}, {"map_size": 100}])
def test_a_bad_map_size_maps_nothing_and_closes_the_descriptor(body: dict[str, object]) -> None:
    fd = _memfd(8192)
    with pytest.raises(BadFrame):
        map_shared(1, 4096, "shm", body, [fd])
    assert _closed(fd)


def test_a_descriptor_smaller_than_announced_is_refused() -> None:
    fd = _memfd(4096)  # mapping 8192 of it would SIGBUS on the second page
    with pytest.raises(BadFrame, match="holds 4096 bytes"):
        map_shared(1, 5000, "shm", {"map_size": 8192}, [fd])
    assert _closed(fd)


def test_extra_descriptors_are_refused_and_all_closed() -> None:
    fds = [_memfd(4096), _memfd(4096)]
    with pytest.raises(BadFrame):
        map_shared(1, 10, "shm", {"map_size": 4096}, fds)
    assert all(_closed(fd) for fd in fds)
