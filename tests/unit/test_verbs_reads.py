"""The device-free half of RDMA READ on verbs (transferd/domains/verbs/reads.py): access
flags from a region's rights, READ work requests cut by max_msg and max_sge over the
reader's views, max_rd_atomic within the device's limits, the per-queue-pair window.
The posting itself needs a device (tests/rdma/, skipped here with its reason)."""

from __future__ import annotations

import pytest

from transferd.domains.verbs.reads import (
    IBV_ACCESS_REMOTE_READ,
    IBV_WR_RDMA_READ,
    ReadWindow,
    mr_access,
    plan_read,
    qp_access,
    rd_atomic,
)
from transferd.parts import ReadPart
from transferd.protocol.errors import BadRequest, OverLimit
from transferd.protocol.values import NetAddr
from transferd.rdma.mrtable import address_of

DST = NetAddr(1, 0, (b"10.0.0.1:1",))


def test_remote_read_only_where_granted() -> None:
    assert not mr_access("w") & IBV_ACCESS_REMOTE_READ
    assert mr_access("r") & IBV_ACCESS_REMOTE_READ and not mr_access("r") & 2
    assert mr_access("rw") & IBV_ACCESS_REMOTE_READ and mr_access("rw") & 2
    assert not qp_access(False) & IBV_ACCESS_REMOTE_READ
    assert qp_access(True) & IBV_ACCESS_REMOTE_READ
    with pytest.raises(BadRequest):
        mr_access("x")


def test_constants_match_pyverbs_where_it_imports() -> None:
    e = pytest.importorskip("pyverbs.enums", reason="pyverbs is not importable here")
    assert IBV_ACCESS_REMOTE_READ == e.IBV_ACCESS_REMOTE_READ
    assert IBV_WR_RDMA_READ == e.IBV_WR_RDMA_READ


def test_rd_atomic_within_the_device() -> None:
    assert rd_atomic(16, 16) == (16, 16)
    assert rd_atomic(4, 255) == (4, 16)
    assert rd_atomic(0, 0) == (1, 1)


def test_read_work_requests_cover_every_byte_in_order() -> None:
    local = bytearray(1 << 20)
    lv = memoryview(local)
    into = [lv[0:5000], lv[8192:8192 + 3000], lv[100_000:100_000 + 10_000]]
    part = ReadPart(0, DST, 0xAB, [0x10000, 0x90000], [6000, 12_000], into)
    wrs = plan_read(part, lambda a, n: 77, max_msg=4096, max_sge=2)
    assert all(w.opcode == IBV_WR_RDMA_READ and w.rkey == 0xAB for w in wrs)
    assert all(w.nbytes <= 4096 and len(w.sges) <= 2 for w in wrs)
    assert sum(w.nbytes for w in wrs) == 18_000
    # Remote ranges walked in order, each request contiguous within its page.
    remote = [(w.remote_addr, w.nbytes) for w in wrs]
    assert remote[0] == (0x10000, 4096)
    pos = {0x10000: 0, 0x90000: 0}
    for addr, n in remote:
        page = 0x10000 if addr < 0x90000 else 0x90000
        assert addr == page + pos[page]
        pos[page] += n
    assert pos == {0x10000: 6000, 0x90000: 12_000}
    # Local pieces: the views, concatenated, exactly once.
    base = address_of(lv)
    flat = [(a - base, n) for w in wrs for a, n, _ in w.sges]
    covered = bytearray(len(local))
    for off, n in flat:
        assert not any(covered[off:off + n])
        covered[off:off + n] = b"\1" * n
    assert covered[0:5000] == b"\1" * 5000 and covered[8192:11192] == b"\1" * 3000
    assert sum(covered) == 18_000
    with pytest.raises(BadRequest):
        plan_read(ReadPart(0, DST, 1, [0], [10], [lv[:9]]), lambda a, n: 1, max_msg=64,
                  max_sge=1)


def test_the_window_posts_at_most_its_depth_in_order() -> None:
    posted: list[int] = []
    w = ReadWindow(2, posted.append, max_waiting=3)
    for i in range(5):
        w.offer(i)
    assert posted == [0, 1] and w.waiting == 3
    with pytest.raises(OverLimit):
        w.offer(5)
    w.done()
    assert posted == [0, 1, 2] and w.in_flight == 2
    assert w.drain() == [3, 4]


def test_posts_that_give_their_slot_back_do_not_recurse() -> None:
    """Every waiting READ dropped at once (its transfer ended, its send queue full): the
    window loops, it does not recurse once per waiting READ."""
    w: ReadWindow
    posted: list[int] = []

    def post(i: int) -> None:
        if i == 0:
            posted.append(i)
        else:
            w.done()  # dropped: its slot straight back

    w = ReadWindow(1, post, max_waiting=50_000)
    for i in range(20_000):
        w.offer(i)
    assert posted == [0] and w.waiting == 19_999
    w.done()
    assert w.waiting == 0 and w.in_flight == 0
