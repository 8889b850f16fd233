"""A peer's huge verified READ does not hold another peer's behind it.

A verified READ (RX_CRC) past CRC_INLINE_MAX of host memory has its checksum taken on
the engine port's one thread.  That thread was first come first served: a peer holding
the secret asks one READ of 4096 overlapping pages of a 64 MiB region (256 GiB of
CRC32C, tens of seconds of a core) and keeps its link open; every other peer's verified
READ then waited for all of it (an honest daemon's paged READ failed with TIMEOUT at
engine.peer_timeout_s).  Now the thread takes pieces round-robin across peers: the
honest READ's pieces come between the huge one's, and it finishes in about twice its
own checksum time (docs/security.md, stop 39).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from client import Client, Pages
from client.shared import SharedBuffer
from tests.helpers import DaemonProcess, RawConn, async_test, pattern
from tests.integration.engine_cluster import (
    RAILS,
    SECRET,
    MiB,
    Node,
    Region,
    engine_env,
    secret_file,
    start_many,
)
from tests.integration.fake_peer import FakePeer
from tests.integration.test_attacks_read_checksum import exact
from transferd.engine.port import CRC_INLINE_MAX
from transferd.protocol.constants import Command
from transferd.protocol.crc import crc_of
from transferd.protocol.peer_wire import MAX_PAGES, READ_DATA_HEAD, encode_read

BIG = 64 * MiB  # the huge READ's region: each of its 4096 pages is all of it
PAGE = 2 * MiB  # the honest READ: 510 pages of this (1020 MiB: shm buffers are under 1 GiB),
# in two frames (of at most 256 pages)
HONEST_PAGES = 510


@pytest.fixture
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    # (unix:// for the client: its gigabyte buffers mapped here, not copied over a socket)
    where = tempfile.mkdtemp(prefix="td-fair-", dir="/tmp")  # (AF_UNIX paths are short)
    env = {"TRANSFERD_MEMORY_SHM_LIMIT_MIB": "1200"}
    ds = start_many([{"env": {**engine_env(RAILS[n][:1], secret_file=secret_file()), **env},
                      "args": ["--listen", f"unix://{where}/{n}.sock"]} for n in "ab"])
    yield ds
    for d in ds:
        d.stop()
    shutil.rmtree(where, True)
    for d in ds:
        assert "Traceback" not in d.stderr, d.output()


async def region(n: Node, size: int, seed: int | None = None) -> Region:
    """A shared buffer registered for peers, filled here with a pattern: a 16 MiB one
    over and over, each PAGE stamped with its index (a page misplaced is seen; the
    pattern of a gigabyte takes seconds to make)."""
    buf = await n.client.alloc_buffer(size, "shm")
    n.buffers.append(buf)
    assert isinstance(buf, SharedBuffer)
    data = buf.view
    if seed is not None:
        block = pattern(16 * MiB, seed)
        for off in range(0, size, len(block)):
            data[off:off + len(block)] = block[:size - off]
        for off in range(0, size, PAGE):
            data[off:off + 8] = (off // PAGE).to_bytes(8, "little")
    mr, desc = await n.client.reg_mr(buf, access="r" if seed is not None else "w")
    return Region(buf, mr, desc, bytearray())


@async_test(timeout=120)
async def test_a_huge_verified_read_does_not_hold_another_peers(
        daemons: list[DaemonProcess]) -> None:
    a_d, b_d = daemons
    a = Node(a_d, await Client.connect(a_d.url_for("unix"), timeout=30))
    b = Node(b_d, await Client.connect(b_d.url_for("unix"), timeout=30))
    try:
        n = PAGE * HONEST_PAGES
        src = await region(b, n, seed=41)
        dst = await region(a, n)
        big = await region(b, BIG, seed=42)
        (addr, rkey), = big.desc.rkeys
        assert 256 * PAGE > CRC_INLINE_MAX  # (each frame's checksum is the thread's)
        assert isinstance(src.buf, SharedBuffer) and isinstance(dst.buf, SharedBuffer)
        data, got = src.buf.view, dst.buf.view

        async def honest(pages: int = HONEST_PAGES) -> float:
            """A verified paged READ of B's pages, last first, into A's: its time."""
            idx = list(range(pages))
            t0 = time.monotonic()
            r = await a.client.submit_paged_reads(PAGE, (dst.mr, Pages(idx, PAGE)),
                                                  (src.desc, Pages(idx[::-1], PAGE)),
                                                  verify=True)
            await r.wait(60)
            took = time.monotonic() - t0
            want = crc_of(data[k * PAGE:(k + 1) * PAGE] for k in idx[::-1])
            assert crc_of([got[:pages * PAGE]]) == want
            return took

        # (The first dials the link and touches A's pages; the box is shared: the best.)
        alone = min([await honest() for _ in range(2)])
        # What the huge READ's checksum costs here, from 16 of its pages' (1 GiB): the
        # answer's header comes once the checksum was taken.
        with FakePeer(addr, 0, SECRET) as p:
            p.handshake()
            t0 = time.monotonic()
            p.conn.sock.sendall(encode_read(1, 0, rkey, [big.desc.ptr] * 16, [BIG] * 16,
                                            crc=True))
            assert READ_DATA_HEAD.unpack(exact(p.conn.sock, READ_DATA_HEAD.size))[1] == 0
            huge = (time.monotonic() - t0) * MAX_PAGES / 16
        with FakePeer(addr, 0, SECRET) as p:
            p.handshake()
            p.conn.sock.sendall(encode_read(2, 0, rkey, [big.desc.ptr] * MAX_PAGES,
                                            [BIG] * MAX_PAGES, crc=True))
            c = RawConn.to(b_d, timeout=30)
            c.hello()
            # (B's loop answered after taking the READ in: its checksum has begun.)
            assert not c.request(Command.GET_DEVICES, {}).is_error
            beside = await honest()
            print(f"honest 1020 MiB verified paged READ: alone {alone:.2f} s, beside a "
                  f"4096-page READ of {BIG >> 20} MiB {beside:.2f} s (that one's checksum "
                  f"about {huge:.1f} s)")
            # Before: it waited for the whole of the huge one's checksum (tens of
            # seconds, or TIMEOUT); now about twice its own (plus a core the huge one
            # keeps busy on a small box).
            assert beside < 3 * alone + 1.0, (beside, alone)
            assert beside < huge / 4, (beside, huge)
            c.close()
        # The huge one's link went: its checksum stops within a piece, B serves on.
        assert await honest(1) < 1.0
    finally:
        for n in (a, b):
            await n.close()
