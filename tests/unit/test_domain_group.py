"""The receiving half of a DomainGroup (checks before landing, counting rules) and
Transfer's completion bookkeeping, without sockets."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from transferd.domains.group import DomainGroup
from transferd.engine.immcounter import ImmCounter
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

SIZE = 16 * 4096
PEER = (0xA, 0)


@pytest.fixture
def setup() -> Iterator[tuple[DomainGroup, Region, ImmCounter]]:
    loop = asyncio.new_event_loop()
    buf = Buffer.host(1, SIZE)
    regions = RegionTable()
    region = regions.register(buf, 2)
    counter = ImmCounter()
    group = DomainGroup(0, 0xB, loop, regions, counter, lambda peer, msg, ack: None)
    yield group, region, counter
    buf.release()
    loop.close()


def body(region: Region, rail: int, addrs: list[int], lens: list[int], **kw: Any) -> dict[str, Any]:
    return {"rkey": region.rkeys[rail], "addrs": addrs, "lens": lens, **kw}


def test_write_views_checks_every_page_first(
    setup: tuple[DomainGroup, Region, ImmCounter],
) -> None:
    g, r, _ = setup
    p = r.ptr
    views = g.write_views(0, body(r, 0, [p, p + SIZE - 8], [8, 8]), 16)
    assert [len(v) for v in views] == [8, 8]
    # The rkey of rail 1 on rail 1 works too, not on rail 0.
    g.write_views(1, body(r, 1, [p], [8]), 8)
    with pytest.raises(NotFound):
        g.write_views(0, body(r, 1, [p], [8]), 8)
    with pytest.raises(NotFound):
        g.write_views(0, {"rkey": r.rkeys[0] ^ 1, "addrs": [p], "lens": [8]}, 8)
    # A good page followed by one a byte over the end: nothing is returned for either.
    with pytest.raises(OutOfBounds):
        g.write_views(0, body(r, 0, [p, p + SIZE - 7], [8, 8]), 16)
    with pytest.raises(OutOfBounds):
        g.write_views(0, body(r, 0, [p - 1], [8]), 8)
    # The payload must be exactly what the pages hold.
    with pytest.raises(BadRequest):
        g.write_views(0, body(r, 0, [p], [8]), 9)
    with pytest.raises(BadRequest):
        g.write_views(0, body(r, 0, [p, p + 8], [8]), 8)
    with pytest.raises(BadRequest):
        g.write_views(0, {"addrs": [p], "lens": [8]}, 8)
    with pytest.raises(BadRequest):
        g.write_views(0, {"rkey": r.rkeys[0], "addrs": p, "lens": 8}, 8)
    # Zero-byte writes (barriers) still need a valid rkey.
    assert g.write_views(0, body(r, 0, [], []), 0) == []
    with pytest.raises(NotFound):
        g.write_views(0, {"rkey": 12345, "addrs": [], "lens": []}, 0)


def test_split_write_counts_once_when_last_part_lands(
    setup: tuple[DomainGroup, Region, ImmCounter],
) -> None:
    g, _, c = setup
    parts = 5
    # Parts of op 1 and op 2 from the same peer, and op 1 from another peer, interleaved.
    order = [(PEER, 1, 3), (PEER, 2, 0), ((0xC, 0), 1, 4), (PEER, 1, 0), (PEER, 1, 4),
             (PEER, 2, 1), (PEER, 1, 1), ((0xC, 0), 1, 0)]
    for peer, op, part in order:
        g.landed(peer, {"op": op, "part": part, "parts": parts, "imm": 9, "count": 1}, 10)
        assert c.value(9) == 0
    g.landed(PEER, {"op": 1, "part": 2, "parts": parts, "imm": 9, "count": 1}, 10)
    assert c.value(9) == 1  # all five parts of op 1 from PEER
    for part in (2, 3, 4):
        g.landed(PEER, {"op": 2, "part": part, "parts": parts, "imm": 9, "count": 1}, 10)
    assert c.value(9) == 2
    for part in (1, 2, 3):
        g.landed((0xC, 0), {"op": 1, "part": part, "parts": parts, "imm": 9, "count": 1}, 10)
    assert c.value(9) == 3
    assert g.bytes_in == 10 * (len(order) + 1 + 3 + 3)


def test_paged_and_barrier_counts(setup: tuple[DomainGroup, Region, ImmCounter]) -> None:
    g, _, c = setup
    g.landed(PEER, {"op": 1, "part": 0, "parts": 1, "imm": 3, "count": 256}, 0)
    g.landed(PEER, {"op": 1, "part": 1, "parts": 1, "imm": 3, "count": 44}, 0)
    assert c.value(3) == 300
    g.landed(PEER, {"op": 2, "part": 0, "parts": 1, "imm": 4, "count": 1}, 0)
    assert c.value(4) == 1
    g.landed(PEER, {"op": 3, "part": 0, "parts": 1, "count": 0}, 100)  # no immediate
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
                                    "transferd.domains.stream", "transferd.engine",
                                    "transferd.engine.plan", "transferd.workers"])
def test_modules_import_on_their_own(module: str) -> None:
    # In a fresh interpreter, whatever was imported first (no import cycle bites).
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                       text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
