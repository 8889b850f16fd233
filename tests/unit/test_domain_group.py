"""The receiving rules every Domain's inbound links share (transferd/protocol/peer_landing.py
over the engine's port: checks before landing, counting rules, re-sent parts), Transfer's
completion bookkeeping, and the import seam between domains and engine; without sockets."""

from __future__ import annotations

import ast
import asyncio
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from transferd.engine.immcounter import ImmCounter
from transferd.engine.port import EnginePort
from transferd.engine.regions import Region, RegionTable
from transferd.engine.transfer import Transfer
from transferd.memory import Buffer
from transferd.protocol.errors import (
    BadRequest,
    NotFound,
    OutOfBounds,
    PeerUnreachable,
    TransferdError,
)
from transferd.protocol.peer_coverage import MAX_PARTIAL, MAX_RANGES, Coverage
from transferd.protocol.peer_landing import Landing
from transferd.protocol.peer_wire import WriteHeader

SIZE = 16 * 4096
PEER = (0xA, 0)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def setup() -> Iterator[tuple[Landing, Region, ImmCounter]]:
    buf = Buffer.host(1, SIZE)
    regions = RegionTable()
    region = regions.register(buf, 2)
    counter = ImmCounter()
    landing = Landing(EnginePort(regions, counter, lambda *a: None, lambda s: None), 2)
    yield landing, region, counter
    buf.release()


def w(region: Region | None, rail: int, addrs: list[int], lens: list[int],
      **kw: Any) -> WriteHeader:
    """A WRITE header, as the inbound link parsed it."""
    rkey = region.rkeys[rail] if region is not None else 12345
    span = kw.pop("span", None)
    return WriteHeader(kw.pop("op", 1), kw.pop("part", 0), kw.pop("rkey", rkey), addrs, lens,
                       kw.pop("imm", None), tuple(span) if span else None, **kw)


def _check(lg: Landing, rail: int, peer: tuple[int, int], header: WriteHeader,
           payload: int) -> list[int]:
    """Open a write and let it go unlanded: the lengths of its views."""
    adm = lg.open(peer, rail, header, payload)
    lens = [len(v) for v in adm.views]
    adm.fail(None)
    return lens


def test_a_write_is_checked_page_by_page_before_it_lands(
    setup: tuple[Landing, Region, ImmCounter],
) -> None:
    lg, r, _ = setup
    p = r.ptr
    assert _check(lg, 0, PEER, w(r, 0, [p, p + SIZE - 8], [8, 8]), 16) == [8, 8]
    # The rkey of rail 1 on rail 1 works too, not on rail 0.
    _check(lg, 1, PEER, w(r, 1, [p], [8]), 8)
    with pytest.raises(NotFound):
        _check(lg, 0, PEER, w(r, 1, [p], [8]), 8)
    with pytest.raises(NotFound):
        _check(lg, 0, PEER, w(r, 0, [p], [8], rkey=r.rkeys[0] ^ 1), 8)
    # A good page followed by one a byte over the end: nothing is returned for either.
    with pytest.raises(OutOfBounds):
        _check(lg, 0, PEER, w(r, 0, [p, p + SIZE - 7], [8, 8]), 16)
    with pytest.raises(OutOfBounds):
        _check(lg, 0, PEER, w(r, 0, [p - 1], [8]), 8)
    # The payload must be exactly what the pages hold.
    with pytest.raises(BadRequest):
        _check(lg, 0, PEER, w(r, 0, [p], [8]), 9)
    # Zero-byte writes (barriers) still need a valid rkey.
    assert _check(lg, 0, PEER, w(r, 0, [p], [0]), 0) == [0]
    with pytest.raises(NotFound):
        _check(lg, 0, PEER, w(None, 0, [p], [0]), 0)
    assert r.admitted == 0
    assert lg.refused_by == {"NOT_FOUND": 3, "OUT_OF_BOUNDS": 2, "BAD_REQUEST": 1}


def _land(lg: Landing, r: Region, peer: tuple[int, int], header: WriteHeader,
          rail: int = 0) -> bool:
    """Open, land (zeros) and commit; False if it was a duplicate (nothing placed)."""
    adm = lg.open(peer, rail, header, header.nbytes)
    for v in adm.views:
        v[:] = bytes(len(v))
    adm.commit(header.nbytes)
    return not adm.duplicate


def test_split_write_counts_once_when_its_parts_covered_it(
    setup: tuple[Landing, Region, ImmCounter],
) -> None:
    lg, r, c = setup
    p = r.ptr
    span = [p, 50]
    # Parts of op 1 and op 2 from the same peer, and op 1 from another peer, interleaved.
    order = [(PEER, 1, 3), (PEER, 2, 0), ((0xC, 0), 1, 4), (PEER, 1, 0), (PEER, 1, 4),
             (PEER, 2, 1), (PEER, 1, 1), ((0xC, 0), 1, 0)]
    for peer, op, part in order:
        _land(lg, r, peer, w(r, 0, [p + 10 * part], [10], op=op, part=part, imm=9, span=span))
        assert c.value(9) == 0
    _land(lg, r, PEER, w(r, 0, [p + 20], [10], op=1, part=2, imm=9, span=span))
    assert c.value(9) == 1  # all five parts of op 1 from PEER
    for part in (2, 3, 4):
        _land(lg, r, PEER, w(r, 0, [p + 10 * part], [10], op=2, part=part, imm=9, span=span))
    assert c.value(9) == 2
    for part in (1, 2, 3):
        _land(lg, r, (0xC, 0), w(r, 0, [p + 10 * part], [10], op=1, part=part, imm=9,
                                 span=span))
    assert c.value(9) == 3
    assert lg.bytes_in == 10 * (len(order) + 1 + 3 + 3)
    assert len(lg.coverage) == 0


def test_split_write_parts_that_lie_are_refused_before_landing(
    setup: tuple[Landing, Region, ImmCounter],
) -> None:
    lg, r, c = setup
    p = r.ptr
    span = [p, 100]
    _land(lg, r, PEER, w(r, 0, [p], [50], imm=9, span=span))
    for bad, words in [(w(r, 0, [p + 49], [10], part=1, imm=9, span=span), "overlaps"),
                       (w(r, 0, [p + 10], [40], part=1, imm=9, span=span), "overlaps"),
                       (w(r, 0, [p + 50], [50], part=1, imm=8, span=span), "immediate"),
                       (w(r, 0, [p + 50], [50], part=1, imm=9, span=[p, 101]), "span")]:
        with pytest.raises(BadRequest, match=words):
            _check(lg, 0, PEER, bad, bad.nbytes)
    # A replay of a part that landed (a re-send after a rail failed): taken, its payload
    # discarded, nothing counted.
    replay = w(r, 0, [p], [50], imm=9, span=span, again=True)
    assert not _land(lg, r, PEER, replay)
    assert c.value(9) == 0
    _land(lg, r, PEER, w(r, 0, [p + 50], [50], part=1, imm=9, span=span))
    assert c.value(9) == 1 and c.value(8) == 0
    assert r.admitted == 0


def test_coverage_table_is_bounded() -> None:
    cov = Coverage(max_partial=4, max_pieces=3, max_peers=2)
    for op in range(10):
        cov.reserve((1, 0, op), (0, 100), 0, 10, None)
    assert len(cov) == 4
    for i in range(1, 3):
        cov.reserve((1, 0, 9), (0, 100), 10 * i, 10, None)
    with pytest.raises(BadRequest, match="more than 3 parts"):
        cov.reserve((1, 0, 9), (0, 100), 50, 10, None)
    # One peer flooding split writes pushes out only its own: another's stays.
    other = cov.reserve((2, 0, 1), (0, 100), 0, 50, None)
    for op in range(100, 120):
        cov.reserve((1, 0, op), (0, 100), 0, 10, None)
    cov.reserve((2, 0, 1), (0, 100), 50, 50, None)
    with pytest.raises(BadRequest, match="2 peers"):
        cov.reserve((3, 0, 1), (0, 100), 0, 10, None)
    assert cov.landed((2, 0, 1), other, 100)
    cov.reserve((3, 0, 1), (0, 100), 0, 10, None)  # peer 2 is done: room again


def test_split_writes_of_every_peer_together_are_bounded() -> None:
    """Each peer's table was bounded (MAX_PARTIAL of MAX_PIECES ranges) but not all of
    them together: without a secret peers are minted at will, and 1024 of them could
    hold 35 GiB of ranges.  Now MAX_RANGES in all, the busiest peer's oldest split
    write forgotten past it; a quiet peer's write is kept and counts."""
    cov = Coverage()
    quiet = cov.reserve((9999, 0, 1), (0, 100), 0, 50, None)
    for peer in range(1, 10):  # 9 peers, each filling its own table: 294,912 ranges
        for op in range(MAX_PARTIAL):
            for k in range(8):
                cov.reserve((peer, 0, op), (0, 1 << 20), k * 10, 10, None)
    held = sum(len(p.ranges) for t in cov._by_peer.values() for p in t.values())
    assert held <= MAX_RANGES == 1 << 18
    assert held == cov.ranges  # (the count it keeps is what the table holds)
    cov.reserve((9999, 0, 1), (0, 100), 50, 50, None)
    assert cov.landed((9999, 0, 1), quiet, 100)


def test_paged_and_barrier_counts(setup: tuple[Landing, Region, ImmCounter]) -> None:
    """Nothing a frame says about counts is read: the pages it placed are counted."""
    lg, r, c = setup
    p = r.ptr
    pages = [p + 16 * i for i in range(256)]
    _land(lg, r, PEER, w(r, 0, pages, [16] * 256, imm=3))
    _land(lg, r, PEER, w(r, 0, pages[:44], [16] * 44, part=1, imm=3))
    assert c.value(3) == 300
    _land(lg, r, PEER, w(r, 0, [p], [0], op=2, imm=4))  # a barrier: one
    assert c.value(4) == 1
    _land(lg, r, PEER, w(r, 0, [p], [100], op=3))  # no immediate
    assert (c.value(0), c.value(3), c.value(4)) == (0, 300, 1)


def _transfer(parts: int) -> tuple[Transfer, list[TransferdError | None]]:
    done: list[TransferdError | None] = []
    return Transfer(1, parts, 100, done.append), done


def test_transfer_completes_after_every_part() -> None:
    t, done = _transfer(3)
    t.part_done()
    t.part_done()
    assert done == [] and not t.finished
    t.part_done()
    assert done == [None] and t.finished
    t.part_done()
    t.fail(PeerUnreachable("late"))
    assert done == [None]  # exactly once


def test_transfer_first_failure_wins() -> None:
    t, done = _transfer(3)
    t.part_done()
    err = NotFound("bad rkey")
    t.part_done(err)
    assert done == [err] and t.error is err
    t.part_done()
    t.part_done()
    t.fail(PeerUnreachable("gone"))
    assert done == [err]


def test_transfer_cancels_its_timer() -> None:
    loop = asyncio.new_event_loop()
    try:
        t, done = _transfer(1)
        t.timer = loop.call_later(3600, t.fail, PeerUnreachable("timeout"))
        t.part_done()
        assert t.timer.cancelled()
        assert done == [None]
    finally:
        loop.close()


@pytest.mark.parametrize("module", ["transferd.domains", "transferd.domains.tcp",
                                    "transferd.domains.link_io", "transferd.domains.group",
                                    "transferd.domains.chaos", "transferd.domains.registry",
                                    "transferd.domains.verbs.links", "transferd.parts",
                                    "transferd.protocol.peer_link", "transferd.engine",
                                    "transferd.engine.plan", "transferd.workers"])
def test_modules_import_on_their_own(module: str) -> None:
    # In a fresh interpreter, whatever was imported first (no import cycle bites).
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr


def test_domains_never_import_the_engine() -> None:
    """The seam: domains share value types with the engine through transferd.parts only,
    at run time (what a daemon's domains load) and in the source (type checking too)."""
    code = ("import sys, transferd.domains.group, transferd.domains.tcp, "
            "transferd.domains.chaos, transferd.domains.base, transferd.domains.registry, "
            "transferd.domains.verbs.links, transferd.domains.verbs.bind; "
            "bad = sorted(m for m in sys.modules if m.startswith('transferd.engine')); "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    found = []
    for path in sorted((REPO / "transferd" / "domains").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(REPO)}: {n}" for n in names
                      if n.startswith("transferd.engine")]
    assert not found, found


def test_no_code_outside_a_domains_folder_asks_for_a_domain_by_name() -> None:
    """Capabilities, not names: ``config.domain == "verbs"``, ``"verbs" in domain`` and
    the like live only in transferd/domains/<name>/ (and the registry, which maps the
    names)."""
    from transferd.domains import registry

    names = "|".join(sorted({n for spec in registry.choices() for n in spec.split(":")}))
    pat = re.compile(
        rf"""["']({names})["']\s*(==|!=|in\b|not in\b)\s*[\w.]*domain"""
        rf"""|domain[\w.]*\s*(==|!=)\s*["']({names})["']"""
        rf"""|domain[\w.]*\.(startswith|endswith)\(\s*["']({names})""")
    found = []
    for top in ("transferd", "rpc_server", "client"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith("transferd/domains/"):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pat.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, found
    # (The pattern itself: the forms it must catch.)
    for line in ('if "verbs" in config.engine.domain:', "cfg.domain == 'tcp'",
                 'self.config.domain != "chaos"', 'domain.startswith("verbs")'):
        assert pat.search(line), line


def test_a_part_re_sent_on_another_rail_counts_once(
    setup: tuple[Landing, Region, ImmCounter],
) -> None:
    """Rail failover re-sends a part: whichever copy lands first is applied and counted,
    the other is discarded (a split write's part, a frame of pages, a barrier)."""
    lg, r, c = setup
    p = r.ptr
    span = [p, 100]
    # Part 1's first copy was taken (its frame began) on rail 0 and never finished.
    stalled = lg.open(PEER, 0, w(r, 0, [p + 50], [50], op=7, part=1, imm=11, span=span), 50)
    _land(lg, r, PEER, w(r, 0, [p], [50], op=7, part=0, imm=11, span=span))
    # Its copy on rail 1 takes the same range again, lands, and the write counts once.
    again = w(r, 1, [p + 50], [50], op=7, part=1, imm=11, span=span, again=True)
    assert _land(lg, r, PEER, again, rail=1)
    assert c.value(11) == 1
    stalled.fail(None)  # (its link went away)
    # A re-sent copy of a part that landed after all is discarded and adds nothing.
    late = w(r, 0, [p + 50], [50], op=7, part=1, imm=11, span=span, again=True)
    assert not _land(lg, r, PEER, late)
    # Pages: the frame landed, its ACK was lost with the rail, the frame comes again.
    pages = w(r, 0, [p, p + 16], [8, 8], op=8, part=3, imm=12)
    _land(lg, r, PEER, pages)
    assert c.value(12) == 2
    copy = w(r, 1, [p, p + 16], [8, 8], op=8, part=3, imm=12, again=True)
    assert not _land(lg, r, PEER, copy, rail=1)
    assert c.value(12) == 2 and c.value(11) == 1
    # A re-send of other pages under the same number is no copy: checked and applied.
    other = w(r, 0, [p + 32], [8], op=8, part=3, imm=12, again=True)
    assert _land(lg, r, PEER, other)
    assert c.value(12) == 3
    # A frame not marked as re-sent is never taken for a copy (a peer may repeat one).
    _land(lg, r, PEER, w(r, 0, [p + 32], [8], op=8, part=3, imm=12))
    assert c.value(12) == 4
    # The same op and part from another peer is another write.
    assert _land(lg, r, (0xC, 0), w(r, 0, [p, p + 16], [8, 8], op=8, part=3, imm=12,
                                    again=True))
    assert c.value(12) == 6
    assert lg.duplicates == 2 and r.admitted == 0


def test_a_rail_that_fails_thousands_of_times_in_a_row_stays_down_at_the_cap() -> None:
    """Parts failing as fast as they are submitted (an inproc engine, a stopped peer) fail
    one rail thousands of times in a row: its back-off stays at DOWN_MAX_S (2 ** 1100 s
    overflowed a float, an OverflowError in the link's timer, the rail never marked)."""
    from transferd.domains.failover import DOWN_MAX_S, RailHealth

    h = RailHealth(2)
    peer = (7, 0)
    for _ in range(1100):
        h.failed(peer, 1, 100.0)
    assert h.is_down(peer, 1, 100.0 + DOWN_MAX_S - 0.01)
    assert not h.is_down(peer, 1, 100.0 + DOWN_MAX_S + 0.01)
    assert h.pick(peer, 1, 100.0) == 0


def test_the_peer_book_is_bounded_and_forgets_what_is_not_renewed() -> None:
    """Least recently bound forgotten first; a binding not renewed for ttl_s goes; this
    daemon's own binding never does, and a forgotten peer binds again."""
    from transferd.domains.peers import PeerBook
    from transferd.protocol.peer_handshake import PeerIdentity

    now = [0.0]
    me = PeerIdentity(1, 0, (b"127.0.0.1:1",))
    book = PeerBook(me, limit=3, ttl_s=10.0, clock=lambda: now[0])
    peers = [PeerIdentity(10 + i, 0, (f"127.0.0.2:{i + 1}".encode(),)) for i in range(5)]
    for p in peers[:3]:
        book.bind(p)
    book.bind(peers[0])  # renewed: now the newest
    book.bind(peers[3])  # past the bound: the least recently bound (peers[1]) goes
    assert book.get(peers[1].key) is None and book.get(peers[0].key) == peers[0].addrs
    with pytest.raises(BadRequest, match="bound to"):
        book.bind(PeerIdentity(peers[0].node, 0, (b"127.0.0.9:9",)))
    now[0] = 5.0
    book.bind(peers[2])
    now[0] = 12.0
    book.bind(peers[4])  # peers[0] and [3] were last bound at 0: gone; [2] at 5 stays
    assert book.get(peers[0].key) is None and book.get(peers[3].key) is None
    assert book.get(peers[2].key) == peers[2].addrs and len(book) == 3
    book.bind(PeerIdentity(peers[0].node, 0, (b"127.0.0.9:9",)))  # forgotten: binds anew
    assert book.get(me.key) == me.addrs and book.forgotten == 3
    with pytest.raises(BadRequest, match="this daemon"):
        book.bind(PeerIdentity(1, 0, (b"127.0.0.9:9",)))
