"""The receiver's write-id window (transferd/protocol/peer_writeids.py) and how a split
write's parts from two attempts cover one span (transferd/protocol/peer_coverage.py)."""

from __future__ import annotations

from typing import Any

import pytest

from transferd.protocol.errors import BadRequest, Timeout
from transferd.protocol.peer_coverage import Coverage
from transferd.protocol.peer_wire import WriteHeader
from transferd.protocol.peer_writeids import Seen, WriteIds

PEER = (5, 0)


def hdr(wid: int, part: int = 0, addr: int = 0x1000, n: int = 4096, op: int = 1,
        span: tuple[int, int] | None = None) -> WriteHeader:
    return WriteHeader(op, part, 77, [addr], [n], 9, span, wid=wid)


def test_applied_once_then_acknowledged() -> None:
    ids = WriteIds()
    w = hdr(42)
    assert ids.claim(PEER, w) is Seen.NEW
    # A retry while the first attempt is still landing: outcome unknown, not applied.
    with pytest.raises(Timeout, match="still landing"):
        ids.claim(PEER, hdr(42, op=2))
    ids.applied(PEER, w)
    assert ids.claim(PEER, hdr(42, op=3)) is Seen.APPLIED
    assert ids.duplicates == 1
    # Another initiator's id 42 is another write; so is another part.
    assert ids.claim((6, 0), hdr(42)) is Seen.NEW
    assert ids.claim(PEER, hdr(42, part=1, addr=0x2000)) is Seen.NEW
    with pytest.raises(BadRequest, match="other contents"):
        ids.claim(PEER, hdr(42, addr=0x9000))


def test_a_failed_attempt_leaves_nothing() -> None:
    ids = WriteIds()
    w = hdr(7)
    assert ids.claim(PEER, w) is Seen.NEW
    ids.failed(PEER, w)
    assert ids.claim(PEER, hdr(7, op=2)) is Seen.NEW


def test_the_window_is_bounded_in_count_and_time() -> None:
    now = [0.0]
    ids = WriteIds(window=3, ttl_s=10.0, clock=lambda: now[0])
    for wid in range(5):
        w = hdr(wid)
        ids.claim(PEER, w)
        ids.applied(PEER, w)
    assert len(ids) == 3  # the oldest two forgotten
    assert ids.claim(PEER, hdr(0)) is Seen.NEW
    ids.failed(PEER, hdr(0))
    assert ids.claim(PEER, hdr(4)) is Seen.APPLIED
    now[0] = 11.0
    assert ids.claim(PEER, hdr(4)) is Seen.NEW  # past engine.write_id_ttl_s
    assert len(ids) == 0


def test_a_split_write_covered_by_two_attempts_counts_once() -> None:
    """Part 0 lands from the first attempt, part 1 from the retry: one count, when
    the span is covered; part 1 of the first attempt, arriving last, is applied."""
    ids, cov = WriteIds(), Coverage()
    span = (0x10000, 8192)
    key = (PEER[0], PEER[1], -1 - 99)  # the coverage key of wid 99 (group._cover_key)
    first0 = hdr(99, 0, 0x10000, 4096, op=1, span=span)
    assert ids.claim(PEER, first0) is Seen.NEW
    p = cov.reserve(key, span, 0x10000, 4096, 9)
    assert not cov.landed(key, p, 4096)
    ids.applied(PEER, first0)
    # The retry (op 2): part 0 was applied, part 1 lands and covers the span.
    assert ids.claim(PEER, hdr(99, 0, 0x10000, 4096, op=2, span=span)) is Seen.APPLIED
    retry1 = hdr(99, 1, 0x11000, 4096, op=2, span=span)
    assert ids.claim(PEER, retry1) is Seen.NEW
    p = cov.reserve(key, span, 0x11000, 4096, 9)
    assert cov.landed(key, p, 4096)  # counted now, once
    ids.applied(PEER, retry1)
    assert ids.claim(PEER, hdr(99, 1, 0x11000, 4096, op=1, span=span)) is Seen.APPLIED


def test_a_part_that_failed_mid_payload_frees_its_range() -> None:
    cov = Coverage()
    span = (0, 8192)
    key = (1, 0, -1)
    p = cov.reserve(key, span, 0, 4096, None)
    with pytest.raises(BadRequest, match="overlaps"):
        cov.reserve(key, span, 0, 4096, None)
    cov.unreserve(key, p, 0, 4096)
    cov.reserve(key, span, 0, 4096, None)


def test_one_peer_cannot_push_another_peers_ids_out() -> None:
    ids = WriteIds(window=100)
    honest, flood = (1, 0), (2, 0)
    for wid in range(50):
        w = hdr(wid)
        ids.claim(honest, w)
        ids.applied(honest, w)
    for peer in range(3, 8):  # five more peers, each filling its window
        for wid in range(150):
            w = hdr(wid)
            ids.claim((peer, 0), w)
            ids.applied((peer, 0), w)
    for wid in range(10_000):
        w = hdr(wid)
        ids.claim(flood, w)
        ids.applied(flood, w)
    assert len(ids) <= 4 * 100
    # The largest windows gave way, never the small honest one.
    assert all(ids.claim(honest, hdr(wid)) is Seen.APPLIED for wid in range(50))


def test_peers_by_the_thousand_leave_no_empty_windows_behind() -> None:
    # Peers minted by the thousand (no cluster secret), one write id each: the windows
    # the cap in all emptied were kept, one per peer ever seen, never expired (a peer
    # that never comes back is never looked at again) and each one more for the scan
    # that finds the largest: the table grew without bound with the peers.
    ids = WriteIds(window=2)
    for n in range(5000):
        w = hdr(7)
        assert ids.claim((n + 1, 0), w) is Seen.NEW
        ids.applied((n + 1, 0), w)
    assert len(ids) == 4 * 2
    assert len(ids._applied) <= len(ids)
    # The latest are remembered still; the rest land as new.
    assert ids.claim((5000, 0), hdr(7)) is Seen.APPLIED
    assert ids.claim((1, 0), hdr(7)) is Seen.NEW


def test_a_full_table_of_minted_peers_costs_a_write_no_scan_of_them_all() -> None:
    # The table full of one-entry windows (4 x 16384 minted peers): each write id
    # applied after it looked for the largest window over all of them (8 ms a write
    # here, ~125 writes a second for every peer).  Counted in steps, not timed: the
    # largest window is found without visiting the others.
    ids = WriteIds(window=64)
    for n in range(4 * 64):
        ids.applied((n + 1, 0), hdr(7))
    visits = [0]

    class Counting(dict[Any, Any]):
        def items(self) -> Any:
            for kv in super().items():
                visits[0] += 1
                yield kv

        def values(self) -> Any:
            for v in super().values():
                visits[0] += 1
                yield v

    ids._applied = Counting(ids._applied)
    for n in range(100):
        ids.applied((10_000 + n, 0), hdr(8))
    assert len(ids) == 4 * 64 and visits[0] < 100 * 4, visits[0]


def test_write_ids_are_refused_where_the_nic_places_writes() -> None:
    """On the verbs Domain no receiver code sees a retry, so a wid is BAD_REQUEST at
    submit (before any region lookup); a wid that is not a u64 likewise."""
    from transferd.config import EngineConfig
    from transferd.engine import TransferEngine
    from transferd.memory import BufferTable

    verbs = TransferEngine(EngineConfig(domain="verbs"), BufferTable(1 << 20), None)
    with pytest.raises(BadRequest, match="not verbs"):
        verbs._check_wid(1)
    verbs._check_wid(None)
    tcp = TransferEngine(EngineConfig(), BufferTable(1 << 20), None)
    tcp._check_wid((1 << 64) - 1)
    with pytest.raises(BadRequest, match="64-bit"):
        tcp._check_wid(1 << 64)
