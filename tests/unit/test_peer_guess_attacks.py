"""Attacks on the inbound link's frame-start read once it grew to a paged header (wave 5):
after a paged WRITE the link reads each frame's start as up to 2.1 KiB, so a SEND, a
READ and a small WRITE behind it arrive in the buffer with bytes of the frames after
them; every one must still land, be delivered or be answered exactly."""

from __future__ import annotations

import random

import pytest

from tests.peerlink import HostMemory, drain, feed, identity, link_pair
from transferd.protocol.peer_landing import Landing


@pytest.mark.parametrize("chunk", [1, 24, 100, 2168, 2169, 5000, 1 << 30])
def test_sends_reads_and_writes_after_a_paged_write_come_whole(chunk: int) -> None:
    mem = HostMemory(1)
    p = link_pair(Landing(mem, 1), identity(1), identity(1))
    r = mem.region(1 << 21, access="rw")
    rng = random.Random(chunk)
    src = rng.randbytes(1 << 16)
    r.data[1 << 20:(1 << 20) + len(src)] = src
    idx = rng.sample(range(64), 48)
    pages = [rng.randbytes(4096) for _ in idx]
    p.out.write("paged", 1, 0, r.rkeys[0], [r.ptr + i * 4096 for i in idx], [4096] * 48,
                [memoryview(x) for x in pages], 4)
    msgs = [rng.randbytes(n) for n in (0, 1, 23, 500, 2100, 3000)]
    into = [bytearray(n) for n in (1, 700, 3000)]
    small = [rng.randbytes(n) for n in (1, 2000, 2200)]
    for k in range(3):
        p.out.send(f"m{k}", 10 + k, 0, msgs[k])
        p.out.read(f"r{k}", 20 + k, 0, r.rkeys[0], [r.ptr + (1 << 20) + 1000 * k],
                   [len(into[k])], [memoryview(into[k])])
        p.out.send(f"n{k}", 30 + k, 0, msgs[3 + k])
        p.out.write(f"w{k}", 40 + k, 0, r.rkeys[0], [r.ptr + (1 << 19) + 4000 * k],
                    [len(small[k])], [memoryview(small[k])], 6)
    feed(p.inb, drain(p.out), chunk=chunk)
    feed(p.out, drain(p.inb))
    got = [ev.message for ev in p.inb.events if hasattr(ev, "message")]
    assert sorted(map(bytes, got)) == sorted(msgs)
    for k in range(3):
        at = (1 << 20) + 1000 * k
        assert bytes(into[k]) == src[at - (1 << 20):at - (1 << 20) + len(into[k])], k
        at = (1 << 19) + 4000 * k
        assert bytes(r.data[at:at + len(small[k])]) == small[k], k
    for i, page in zip(idx, pages, strict=True):
        assert bytes(r.data[i * 4096:(i + 1) * 4096]) == page
    done = {t for t, e in p.out.completions if e is None}
    assert {"paged", "r0", "r1", "r2", "w0", "w1", "w2"} <= done, p.out.completions
    assert mem.counts[4] == 48 and mem.counts[6] == 3
