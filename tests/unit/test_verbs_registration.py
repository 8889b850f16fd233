"""Memory registration on a verbs rail without a device: the NIC's registration table
(a second registration of one buffer, as tcp allows), the worker call's deadline (a
typed Timeout, and the late registration undone), and the staging pools a NIC registers
for writes from device memory.

The NIC itself (ibv_reg_mr) needs a device: tests/rdma/test_verbs_memory.py runs these
over real verbs (``make rdma-check``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from transferd.domains.verbs.worker_calls import call_on_loop
from transferd.memory.staging import StagingPool
from transferd.protocol.errors import BadRequest, NotFound, Timeout
from transferd.rdma.mrtable import MrTable, Registration, address_of
from transferd.rdma.staged import StagingRegistrations


def test_a_second_registration_of_one_buffer_stands_on_its_own() -> None:
    t = MrTable()
    first = Registration(0x1000, 4096, 1, 11)
    second = Registration(0x1000, 4096, 2, 12)
    t.add(first)
    t.add(second)  # was: ValueError (uncaught, where tcp accepts it)
    assert len(t) == 2
    assert t.find(0x1800, 16).lkey in (1, 2)
    t.remove(first)
    assert t.find(0x1800, 16) is second  # the other one still serves
    with pytest.raises(NotFound):
        t.remove(first)  # once only
    t.remove(second)
    with pytest.raises(NotFound):
        t.find(0x1800, 16)


def test_overlapping_registrations_that_are_not_the_same_are_a_typed_refusal() -> None:
    t = MrTable()
    t.add(Registration(0x1000, 4096, 1, 11))
    for addr, n in ((0x1000, 100), (0x800, 0x900), (0x1fff, 10)):
        with pytest.raises(BadRequest, match="overlaps"):
            t.add(Registration(addr, n, 3, 13))
    t.add(Registration(0x2000, 10, 4, 14))  # adjacent is fine
    assert len(t) == 2


@pytest.fixture
def worker() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_a_registration_past_its_deadline_is_a_timeout_and_undone_when_it_lands(
        worker: asyncio.AbstractEventLoop) -> None:
    undone: list[str] = []
    landed = threading.Event()

    def slow() -> str:
        time.sleep(0.3)  # ibv_reg_mr pinning a large region
        landed.set()
        return "mr"

    with pytest.raises(Timeout, match=r"registering 1 GiB took over 0\.05 s") as info:
        call_on_loop(worker, slow, timeout=0.05, what="registering 1 GiB",
                     undo=undone.append)
    assert info.value.code.name == "TIMEOUT"
    assert landed.wait(2)
    # The worker ran the undo right after the late registration (was: a bare
    # TimeoutError, and the registration stayed pinned with no region).
    deadline = time.monotonic() + 2
    while not undone and time.monotonic() < deadline:
        time.sleep(0.01)
    assert undone == ["mr"]


def test_a_call_whose_caller_left_before_it_started_never_runs(
        worker: asyncio.AbstractEventLoop) -> None:
    ran: list[int] = []
    block = threading.Event()
    worker.call_soon_threadsafe(lambda: block.wait(1))  # the worker is busy
    with pytest.raises(Timeout):
        call_on_loop(worker, lambda: ran.append(1), timeout=0.05, what="registering")
    block.set()
    fut = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), worker)
    fut.result(2)  # the worker went past the abandoned call
    assert ran == []


def test_a_call_in_time_returns_its_result_and_errors_stay_typed(
        worker: asyncio.AbstractEventLoop) -> None:
    assert call_on_loop(worker, lambda: 7, timeout=2, what="x", undo=None) == 7

    def refuse() -> int:
        raise BadRequest("ibv_reg_mr failed")

    with pytest.raises(BadRequest, match="ibv_reg_mr failed"):
        call_on_loop(worker, refuse, timeout=2, what="x")


class Nic:
    """A NIC's registering, recorded (the table is the real one)."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.mrs = MrTable()
        self.fail_after = fail_after
        self.keys = iter(range(100, 10_000))

    def register(self, addr: int, n: int) -> Registration:
        if self.fail_after is not None and len(self.mrs) >= self.fail_after:
            raise BadRequest("ibv_reg_mr failed")
        reg = Registration(addr, n, next(self.keys), 0)
        self.mrs.add(reg)
        return reg

    def deregister(self, reg: Registration) -> None:
        self.mrs.remove(reg)


def test_staging_is_registered_with_each_nic_while_device_memory_uses_it() -> None:
    pool = StagingPool(chunk_size=64 << 10, chunks=3)
    nics = [Nic(), Nic()]
    staged = [StagingRegistrations(n.register, n.deregister) for n in nics]
    chunk = pool.chunks[1]
    for nic in nics:  # before: a staged view had no lkey on a verbs rail
        with pytest.raises(NotFound):
            nic.mrs.find(chunk.ptr + 100, 4096)
    for s in staged:
        s.hold(pool)  # the first device region of the group
        s.hold(pool)  # a second one: registered once
    for nic in nics:
        assert len(nic.mrs) == 3
        for c in pool.chunks:
            assert nic.mrs.find(c.ptr, c.size).addr == c.ptr
    for nic, s in zip(nics, staged, strict=True):
        s.let_go(pool)
        assert len(nic.mrs) == 3  # one region still stages through it
        s.let_go(pool)
        assert len(nic.mrs) == 0 and not s.registered(pool)


def test_staging_says_which_addresses_are_its_chunks() -> None:
    """What the verbs Domain asks before a READ: one into staging is refused (a READ
    cannot be recalled, and the engine reuses a chunk as soon as a read ends)."""
    pool = StagingPool(chunk_size=64 << 10, chunks=2)
    nic = Nic()
    s = StagingRegistrations(nic.register, nic.deregister)
    c = pool.chunks[1]
    assert not s.covers(c.ptr)
    s.hold(pool)
    assert s.covers(c.ptr) and s.covers(c.ptr + c.size - 1)
    host = bytearray(4096)
    assert not s.covers(address_of(memoryview(host)))
    s.let_go(pool)
    assert not s.covers(c.ptr)


def test_staging_that_cannot_be_registered_whole_is_not_registered_at_all() -> None:
    pool = StagingPool(chunk_size=64 << 10, chunks=3)
    nic = Nic(fail_after=2)
    s = StagingRegistrations(nic.register, nic.deregister)
    with pytest.raises(BadRequest):
        s.hold(pool)
    assert len(nic.mrs) == 0 and not s.registered(pool)


def test_letting_go_of_staging_deregisters_every_chunk_even_after_a_failure() -> None:
    pool = StagingPool(chunk_size=64 << 10, chunks=3)
    nic = Nic()
    failing = iter([True, False, False])

    def deregister(reg: Registration) -> None:
        nic.deregister(reg)
        if next(failing):
            raise BadRequest("ibv_dereg_mr failed")

    s = StagingRegistrations(nic.register, deregister)
    s.hold(pool)
    with pytest.raises(BadRequest):
        s.let_go(pool)
    assert len(nic.mrs) == 0 and not s.registered(pool)
