"""The Memory seam: kinds by registry, charges by pages held, Refs, admits and drains."""

from __future__ import annotations

import os
import threading

import pytest

from transferd.engine.regions import RegionTable
from transferd.memory import (
    BOOKKEEPING,
    KINDS,
    PAGE,
    Buffer,
    BufferTable,
    DeviceSpec,
    Memory,
    Ref,
    charge_of,
    memory_class,
    register_kind,
)
from transferd.memory.host import HostMemory
from transferd.memory.registry import unregister_kind
from transferd.memory.shared import SharedMemory
from transferd.protocol.errors import NotFound, OutOfBounds, OutOfMemory

MiB = 1 << 20


def table(cpu: int = 4 * MiB, shm: int = 4 * MiB) -> BufferTable:
    return BufferTable([DeviceSpec("cpu", cpu), DeviceSpec("shm", shm)])


def free_of(t: BufferTable, device: str = "cpu") -> int:
    return next(d["free"] for d in t.device_info() if d["name"] == device)


def test_charges_are_whole_pages_plus_bookkeeping() -> None:
    assert BOOKKEEPING == PAGE == 4096
    assert charge_of(0) == charge_of(1) == charge_of(PAGE) == 2 * PAGE
    assert charge_of(PAGE + 1) == 3 * PAGE
    t = table()
    bufs = [t.alloc("cpu", 1) for _ in range(10)]
    assert t.used_on("cpu") == 10 * 2 * PAGE
    for b in bufs:
        t.free_buffer(b.id)
    assert t.used_on("cpu") == 0


def test_limit_and_limit_plus_one() -> None:
    t = table(cpu=1 * MiB)
    (cpu, _) = t.device_info()
    assert cpu["max_size"] == 1 * MiB - BOOKKEEPING
    b = t.alloc("cpu", cpu["max_size"])
    assert free_of(t) == 0
    with pytest.raises(OutOfMemory):
        t.alloc("cpu", 0)
    t.free_buffer(b.id)
    with pytest.raises(OutOfMemory):
        t.alloc("cpu", cpu["max_size"] + 1)
    assert free_of(t) == 1 * MiB and len(t) == 0


def test_tiny_buffers_are_bounded_by_their_charge() -> None:
    t = table(cpu=1 * MiB)
    got = []
    with pytest.raises(OutOfMemory):
        for _ in range(1000):  # bounded: 128 fit
            got.append(t.alloc("cpu", 1))
    assert len(got) == 1 * MiB // (2 * PAGE)


def test_devices_have_their_own_limits() -> None:
    t = table(cpu=1 * MiB, shm=2 * MiB)
    s = t.alloc("shm", 1 * MiB)
    assert free_of(t, "cpu") == 1 * MiB and free_of(t, "shm") == 1 * MiB - BOOKKEEPING
    assert isinstance(s.memory, SharedMemory)
    with pytest.raises(NotFound):
        t.alloc("cuda:0", 16)


def test_a_ref_keeps_memory_and_charge_after_free() -> None:
    t = table()
    b = t.alloc("cpu", 3 * PAGE)
    b.view(0, 4)[:] = b"abcd"
    ref = b.ref()
    view = b.view(0, 4)
    t.free_buffer(b.id)
    with pytest.raises(NotFound):
        t.get(b.id)
    with pytest.raises(NotFound):
        b.view(0, 1)  # no new access...
    with pytest.raises(NotFound):
        b.ref()
    assert bytes(view) == b"abcd"  # ...but the holder's view still reads its memory
    assert t.used_on("cpu") == charge_of(3 * PAGE) and t.lingering_on("cpu") == charge_of(3 * PAGE)
    del view
    ref.release()
    ref.release()  # idempotent
    assert t.used_on("cpu") == 0 and t.lingering_on("cpu") == 0


def test_an_untracked_view_keeps_the_charge_until_it_goes() -> None:
    t = table()
    b = t.alloc("cpu", PAGE)
    stray = b.view(0, PAGE)  # taken without a Ref (a bug elsewhere): still counted
    t.free_buffer(b.id)
    assert t.used_on("cpu") == charge_of(PAGE)
    del stray
    assert t.used_on("cpu") == 0


def test_release_from_many_threads_runs_once() -> None:
    t = table()
    b = t.alloc("cpu", PAGE)
    refs = [b.ref() for _ in range(50)]
    t.free_buffer(b.id)
    threads = [threading.Thread(target=lambda: [r.release() for r in refs]) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert b.refs() == 0 and t.used_on("cpu") == 0


def test_admit_then_deregister_drains_when_released() -> None:
    t = table()
    b = t.alloc("cpu", PAGE)
    regions = RegionTable()
    r = regions.register(b, 1)
    a1, a2 = r.admit(), r.admit()
    regions.deregister(r.id)
    with pytest.raises(NotFound):
        r.admit()  # stops admitting at once
    drained = r.drained()
    assert not drained.done() and r.admitted == 2
    a1.release()
    a1.release()
    assert not drained.done()
    t.free_buffer(b.id)
    assert t.used_on("cpu") == charge_of(PAGE)  # the admitted write still holds it
    a2.release()
    assert drained.result(timeout=1) is None
    assert t.used_on("cpu") == 0


def test_drained_at_once_without_writes() -> None:
    b = Buffer.host(1, PAGE)
    regions = RegionTable()
    r = regions.register(b, 2)
    regions.deregister(r.id)
    assert r.drained().done()
    b.release()


def test_admit_after_free_is_refused() -> None:
    t = table()
    b = t.alloc("cpu", PAGE)
    r = RegionTable().register(b, 1)
    t.free_buffer(b.id)
    with pytest.raises(NotFound):
        r.admit()
    assert r.admitted == 0


def test_shared_memory_is_one_set_of_pages_and_sealed() -> None:
    import fcntl
    import mmap

    t = table()
    b = t.alloc("shm", 5000)
    assert b.memory is not None
    fd = b.memory.fd()
    assert fd is not None
    assert b.memory.describe() == {"shared": True, "map_size": 2 * PAGE}
    kept = os.dup(fd)  # what a client keeps
    other = mmap.mmap(kept, 2 * PAGE, flags=mmap.MAP_SHARED)
    b.view(4000, 5)[:] = b"hello"
    assert other[4000:4005] == b"hello"  # the client's mapping sees the daemon's bytes
    other[0:3] = b"abc"
    assert bytes(b.view(0, 3)) == b"abc"
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    with pytest.raises(OSError):
        os.ftruncate(fd, 0)  # a client cannot pull the pages from under the daemon
    t.free_buffer(b.id)
    assert t.used_on("shm") == 0
    # Freed: its pages are punched out, also from under a mapping a client kept (issue
    # 16.10), which reads zeros and costs the daemon nothing.
    assert os.fstat(kept).st_blocks == 0
    assert other[:] == bytes(2 * PAGE)  # (reading faults zero pages in, the reader's own)
    other.close()
    os.close(kept)


def test_zero_size_buffers_are_empty_and_bounded() -> None:
    t = table()
    for kind in ("cpu", "shm"):
        b = t.alloc(kind, 0)
        assert b.view(0, 0).nbytes == 0
        with pytest.raises(OutOfBounds):
            b.view(0, 1)
        t.free_buffer(b.id)
    assert t.used == 0


def test_registry_serves_kinds_and_takes_new_ones() -> None:
    assert memory_class("cpu") is HostMemory and memory_class("shm") is SharedMemory
    with pytest.raises(NotFound):
        memory_class("nope:0")

    class Fake(HostMemory):
        kind = "fake"

    register_kind("fake", Fake)
    try:
        t = BufferTable([DeviceSpec("fake:3", 1 * MiB)])
        b = t.alloc("fake:3", 10)
        assert isinstance(b.memory, Fake) and isinstance(b.memory, Memory)
        t.free_buffer(b.id)
    finally:
        unregister_kind("fake")
    assert "fake" not in KINDS


def test_buffers_held_at_once_are_capped() -> None:
    t = BufferTable([DeviceSpec("cpu", 64 * MiB), DeviceSpec("shm", 64 * MiB)], max_buffers=3)
    a, b, c = t.alloc("cpu", 1), t.alloc("shm", 1), t.alloc("cpu", 1)
    with pytest.raises(OutOfMemory, match=r"memory\.max_buffers"):
        t.alloc("cpu", 1)
    held = a.ref()
    t.free_buffer(a.id)
    with pytest.raises(OutOfMemory):
        t.alloc("cpu", 1)  # freed but still held: still counts
    held.release()
    d = t.alloc("cpu", 1)
    for x in (b, c, d):
        t.free_buffer(x.id)
    assert t.held == 0 and t.used == 0


def test_shared_memory_drops_its_descriptor_once_handed_over() -> None:
    t = table()
    b = t.alloc("shm", 100)
    assert b.memory is not None
    fd = b.memory.fd()
    assert fd is not None
    b.memory.handed_over()
    assert b.memory.fd() is None
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    b.view(0, 3)[:] = b"abc"  # the daemon's mapping still has the pages
    assert bytes(b.view(0, 3)) == b"abc"
    t.free_buffer(b.id)
    assert t.used == 0


def test_abort_admitted_cuts_short_only_writes_that_said_how() -> None:
    b = Buffer.host(1, PAGE)
    regions = RegionTable()
    r = regions.register(b, 1)
    cut: list[int] = []
    refs: list[Ref] = []

    def abort(i: int) -> None:
        cut.append(i)
        refs[i].release()  # what closing its link does

    refs.append(r.admit(lambda: abort(0)))
    refs.append(r.admit())  # no way to cut it short
    regions.deregister(r.id)
    assert r.abort_admitted() == 1 and cut == [0]
    assert not r.drained().done()
    refs[1].release()
    assert r.drained().done() and r.abort_admitted() == 0
    b.release()


def test_every_memory_says_how_its_bytes_are_reached() -> None:
    # Exactly one of a host view and a staging path, asked, never found by an error.
    from tests.standin_daemon import StandinGroup, StandinMemory
    from transferd.protocol.errors import BadRequest

    group = StandinGroup()
    t = BufferTable([DeviceSpec("cpu", 4 * MiB), DeviceSpec("shm", 4 * MiB),
                     DeviceSpec("standin:0", 4 * MiB, None, 256, group)])
    host, shm, dev = (t.alloc(d, 8192) for d in ("cpu", "shm", "standin:0"))
    for buf in (host, shm):
        assert buf.memory is not None and buf.memory.host_view is not None
        assert buf.staging is None and buf.memory.staging is None
        with pytest.raises(BadRequest, match="host view"):
            buf.device_address(0, 8)
    assert dev.memory is not None and dev.memory.host_view is None
    assert dev.staging is group.io and dev.memory.staging is group.io
    assert dev.device_address(100, 8) == dev.memory.address + 100
    with pytest.raises(OutOfBounds):
        dev.device_address(8190, 8)
    t.free_buffer(dev.id)
    with pytest.raises(NotFound):
        dev.device_address(0, 8)
    # The device's memory came from the group the table was given, not the kind alone.
    register_kind("standin", StandinMemory)
    try:
        with pytest.raises(NotFound, match="made by its group"):
            memory_class("standin:0").create("standin:0", 8)
    finally:
        unregister_kind("standin")
    group.stream.close()
