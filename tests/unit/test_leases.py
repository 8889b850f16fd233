"""The lease table's rules on a real event loop (no daemon): deadlines, renewal, limits."""

from __future__ import annotations

import asyncio

import pytest

from transferd.memory import BufferTable
from transferd.memory.leases import Lease, LeaseTable
from transferd.protocol.errors import BadRequest, NotFound, OverLimit


def _table(loop: asyncio.AbstractEventLoop, expired: list[Lease], **kw: float) -> LeaseTable:
    return LeaseTable(loop, expired.append, **kw)  # type: ignore[arg-type]


def test_a_renewed_lease_lives_on_and_an_unrenewed_one_expires_once() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        expired: list[Lease] = []
        t = _table(loop, expired)
        lease, created = t.renew("a", 0.1, "conn")
        assert created
        for _ in range(4):  # four renewals 50 ms apart outlive the 100 ms ttl twice
            await asyncio.sleep(0.05)
            again, created = t.renew("a", 0.1, "conn")
            assert again is lease and not created
        assert expired == []
        await asyncio.sleep(0.25)
        assert expired == [lease] and lease.ended
        with pytest.raises(NotFound):
            t.get("a")
        fresh, created = t.renew("a", 0.1, "conn")  # the name is free: a new owner
        assert created and fresh is not lease
        t.close()
        await asyncio.sleep(0.15)
        assert expired == [lease]  # a closed table expires nothing

    asyncio.run(main())


def test_a_renewal_may_shorten_the_deadline() -> None:
    async def main() -> None:
        expired: list[Lease] = []
        t = _table(asyncio.get_running_loop(), expired)
        lease, _ = t.renew("b", 10.0, "c")
        t.renew("b", 0.05, "c")
        await asyncio.sleep(0.2)
        assert expired == [lease]

    asyncio.run(main())


def test_limits_per_daemon_and_per_connection_by_one() -> None:
    async def main() -> None:
        t = _table(asyncio.get_running_loop(), [], max_leases=3, max_per_connection=2,
                   max_ttl_s=5.0)
        t.renew("x1", 1, "c1")
        t.renew("x2", 1, "c1")
        with pytest.raises(OverLimit, match="max_leases_per_connection"):
            t.renew("x3", 1, "c1")
        t.renew("x3", 1, "c2")
        with pytest.raises(OverLimit, match=r"\(memory\.max_leases\)"):
            t.renew("x4", 1, "c2")
        t.end("x1", "c1")  # frees a place in the daemon and in c1's count
        t.renew("x4", 1, "c1")
        t.connection_closed("c1")  # its leases stay, held by nobody
        assert len(t) == 3
        t.end("x2", "c2", join=True)
        t.renew("y", 1, "c1")  # c1 (a new connection by the same key) starts from 0
        for bad in (0.0, -1.0, 5.001):
            with pytest.raises(BadRequest, match="ttl"):
                t.renew("z", bad, "c3")
        for name in ("", "n" * 129, 7):
            with pytest.raises(BadRequest):
                t.renew(name, 1, "c3")  # type: ignore[arg-type]
        t.close()

    asyncio.run(main())


def test_buffers_are_indexed_by_owner() -> None:
    table = BufferTable(1 << 24)
    lease = Lease("l", 1.0, 0.0)
    mine = [table.alloc("cpu", 4096, owner=lease) for _ in range(3)]
    other = table.alloc("cpu", 4096, owner="conn")
    daemons = table.alloc("cpu", 4096)
    assert set(table.owned_by(lease)) == set(mine)
    table.free_buffer(mine[1].id)
    assert set(table.owned_by(lease)) == {mine[0], mine[2]}
    assert table.owned_by("conn") == [other]
    assert table.owned_by(None) == []  # the daemon's buffers are nobody's to release
    for b in (mine[0], mine[2], other, daemons):
        table.free_buffer(b.id)
    assert table.owned_by(lease) == [] and table.used == 0


def test_waiting_for_admitted_writes_is_bounded_even_when_one_cannot_be_cut_short() -> None:
    """DEREG_MR / FREE_BUFFER / an owner's release wait for admitted writes, abort them
    after ``patience``, and fail with TIMEOUT ``patience`` later if one still holds on
    (a Domain that gave no abort): nothing waits forever, and nothing is admitted meanwhile."""
    from transferd.engine.regions import RegionTable
    from transferd.protocol.errors import Timeout
    from transferd.service.owners import wait_drained

    table = BufferTable(1 << 24)
    regions = RegionTable()
    buf = table.alloc("cpu", 4096)
    aborted: list[int] = []
    stuck = regions.register(buf, 1)
    cut = regions.register(buf, 1)
    held = stuck.admit()  # no abort: it can only end by itself
    cut_ref: list[object] = []

    def abort() -> None:
        aborted.append(1)
        cut_ref[0].release()  # type: ignore[attr-defined]

    cut_ref.append(cut.admit(abort))
    regions.deregister(stuck.id)
    regions.deregister(cut.id)
    with pytest.raises(NotFound):
        stuck.admit()

    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        wait = wait_drained([stuck, cut], patience=0.1)
        assert wait is not None
        with pytest.raises(Timeout, match="cannot be cut short"):
            await wait
        return loop.time() - t0

    took = asyncio.run(main())
    assert 0.18 <= took < 2, took
    assert aborted == [1] and cut.drained().done() and not stuck.drained().done()
    held.release()
    assert stuck.drained().done()
    assert wait_drained([stuck, cut]) is None  # nothing in flight: no wait at all
    table.free_buffer(buf.id)


def test_a_lease_is_held_by_who_made_or_joined_it() -> None:
    async def main() -> None:
        t = _table(asyncio.get_running_loop(), [], max_leases=10, max_per_connection=2)
        lease, _ = t.renew("l", 1, "a")
        for act in (lambda: t.renew("l", 1, "b"), lambda: t.end("l", "b"),
                    lambda: t.held("l", "b")):
            with pytest.raises(BadRequest, match="join"):
                act()
        assert lease.shown_to("a") == "lease:l" and lease.shown_to("b") == "lease"
        assert t.renew("l", 1, "b", join=True) == (lease, False)
        assert t.held("l", "b") is lease and lease.shown_to("b") == "lease:l"
        t.renew("m", 1, "b")
        t.renew("n", 1, "a")
        for act in (lambda: t.renew("l2", 1, "b"),  # b holds two (made or joined): its cap
                    lambda: t.renew("n", 1, "b", join=True)):
            with pytest.raises(OverLimit, match="made or joined"):
                act()
        t.connection_closed("a")
        t.connection_closed("b")
        assert lease.holders == set() and len(t) == 3  # outlives its holders
        with pytest.raises(BadRequest, match="join"):
            t.renew("l", 1, "c")
        t.close()

    asyncio.run(main())


def test_leases_made_from_one_source_are_capped_until_they_end() -> None:
    async def main() -> None:
        t = _table(asyncio.get_running_loop(), [], max_leases=10, max_per_connection=10,
                   max_per_source=3)
        for i in range(3):  # a client that reconnects for each lease
            t.renew(f"h{i}", 1, f"conn{i}", source="10.0.0.1")
            t.connection_closed(f"conn{i}")
        with pytest.raises(OverLimit, match="max_leases_per_source"):
            t.renew("h3", 1, "conn3", source="10.0.0.1")
        t.renew("v", 1, "victim", source="10.0.0.2")  # another source is served
        t.end("h0", "conn3", join=True)
        t.renew("h3", 1, "conn3", source="10.0.0.1")  # one ended: one more
        t.close()

    asyncio.run(main())
