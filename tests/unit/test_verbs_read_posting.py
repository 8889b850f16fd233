"""RDMA READ through the verbs Sender, without a device: a ReadPart planned into READ
work requests, posted through the queue pair's read window onto its send queue, and
completed, failed or flushed by recorded completions.

The "NIC" here copies each READ's remote range into its local SGEs when its completion
is delivered (ctypes.memmove into the reader's own buffer), so the bytes are compared
end to end.  The reader's memory is a bytearray: while any view of it is alive it cannot
be resized (BufferError), which is how these tests see that the Sender still holds it.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
from dataclasses import dataclass, field

import numpy as np
import pytest

from transferd.domains.verbs.reads import READ_MAX, ReadWindow
from transferd.domains.verbs.sender import Posted, Sender
from transferd.domains.verbs.sendq import SendQueue
from transferd.parts import ReadPart, Transfer
from transferd.protocol.errors import OverLimit, PeerUnreachable, TransferdError
from transferd.protocol.values import NetAddr
from transferd.rdma.constants import WrOpcode
from transferd.rdma.mrtable import MrTable, Registration, address_of

DST = NetAddr(9, 0, (b"198.18.0.2:7000",))
RKEY = 0x4321
LKEY = 0x55


@dataclass(eq=False)
class ReadLink:
    """One write queue pair's send side: a send queue recording what it posts, and the
    read window in front of it."""

    sender: Sender
    depth: int = 64
    rd_atomic: int = 2
    max_msg: int = 4096
    max_sge: int = 2
    posted: list[Posted] = field(default_factory=list)
    queue: SendQueue[Posted] = field(init=False)
    reads: ReadWindow = field(init=False)

    def __post_init__(self) -> None:
        self.queue = SendQueue(self.depth, self.posted.extend)
        self.reads = ReadWindow(self.rd_atomic, self.sender.post_read)


class Fabric:
    """The reader's registered memory, the peer's region, and a Sender between them."""

    def __init__(self, local_size: int = 1 << 16) -> None:
        self.remote = (np.arange(1 << 16, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8)
        self.remote_base = address_of(memoryview(self.remote))
        self.local = bytearray(local_size)
        self.mrs = MrTable()
        # The table names the buffer by address only (no view kept): it cannot hold it.
        self.mrs.add(Registration(address_of(memoryview(self.local)), local_size, LKEY, 0))
        self.sender = Sender(lambda link: lambda a, n: self.mrs.find(a, n).lkey,
                             lambda link: (0, 0, 0))
        self.results: list[TransferdError | None] = []

    def part(self, pieces: list[tuple[int, int]], remote: list[tuple[int, int]]) -> ReadPart:
        lv = memoryview(self.local)
        return ReadPart(0, DST, RKEY, [self.remote_base + off for off, _ in remote],
                        [n for _, n in remote], [lv[o:o + n] for o, n in pieces])

    def complete(self, link: ReadLink, p: Posted, error: TransferdError | None = None
                 ) -> None:
        """The NIC finished ``p``: its bytes land (unless it failed), then its CQE."""
        assert p.spec.opcode == WrOpcode.RDMA_READ and p.spec.rkey == RKEY
        if error is None:
            src = p.spec.remote_addr
            for addr, n, lkey in p.spec.sges:
                assert lkey == LKEY
                ctypes.memmove(addr, src, n)
                src += n
        link.posted.remove(p)
        self.sender.completed(p, error)

    def held(self) -> bool:
        """Whether some view of the reader's buffer is still alive."""
        gc.collect()
        try:
            self.local.extend(b"")  # a resize: refused while the buffer is exported
            self.local.append(0)
            self.local.pop()
        except BufferError:
            return True
        return False


def start(f: Fabric, rd_atomic: int, pages: int) -> tuple[ReadLink, Transfer]:
    """A read of ``pages`` 4 KiB pages into the start of the reader's buffer, begun; the
    test keeps no view of it (only the Sender may hold one)."""
    link = ReadLink(f.sender, rd_atomic=rd_atomic)
    t = Transfer(1, 1, 0, f.results.append)
    f.sender.read(link, f.part([(0, 4096 * pages)], [(0, 4096 * pages)]), t)
    return link, t


def test_a_read_lands_every_byte_with_at_most_max_rd_atomic_in_flight() -> None:
    f = Fabric()
    link = ReadLink(f.sender, rd_atomic=2)
    # Two remote pages into three local pieces: cut by max_msg 4096 and max_sge 2.
    part = f.part([(0, 5000), (8192, 3000), (20_000, 10_000)], [(100, 6000), (30_000, 12_000)])
    t = Transfer(1, 1, 0, f.results.append)
    f.sender.read(link, part, t)
    del part
    total = 0
    while link.posted:
        assert len(link.posted) <= 2 and link.reads.in_flight <= 2
        assert not f.results  # not done before the last READ completed
        total += link.posted[0].spec.nbytes
        f.complete(link, link.posted[0])
    assert total == 18_000 and f.results == [None]
    want = bytes(f.remote[100:6100]) + bytes(f.remote[30_000:42_000])
    got = bytes(f.local[0:5000]) + bytes(f.local[8192:11192]) + bytes(f.local[20_000:30_000])
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(want).hexdigest()
    assert link.reads.in_flight == 0 and link.queue.in_flight == 0
    assert not f.held()


def test_memory_is_held_until_the_last_read_completed_not_until_the_transfer_ended() -> None:
    f = Fabric()
    link, t = start(f, 3, 6)
    assert len(link.posted) == 3 and link.reads.waiting == 3
    # The transfer ends (its timer, another part's failure) with READs on the NIC.
    t.fail(PeerUnreachable("timed out"))
    assert f.results and f.results[0] is not None
    assert f.held()  # the NIC may still write into it
    f.complete(link, link.posted[0])
    f.complete(link, link.posted[0])
    assert f.held()
    # The last posted READ flushed: from here the NIC writes nothing into the buffer,
    # and the READs that still waited for the window were never posted.
    f.complete(link, link.posted[0], PeerUnreachable("work request failed: WR_FLUSH_ERR"))
    assert not link.posted and link.reads.waiting == 0 and link.reads.in_flight == 0
    assert not f.held()


def test_a_failed_read_fails_its_part_as_unreachable_and_the_flushed_rest_let_go() -> None:
    f = Fabric()
    link, _ = start(f, 4, 6)
    f.complete(link, link.posted[0], PeerUnreachable("work request failed: RETRY_EXC_ERR"))
    # Failover re-reads the part on another rail when the error is PEER_UNREACHABLE.
    assert len(f.results) == 1 and isinstance(f.results[0], PeerUnreachable)
    # The failed READ's slot does not go to one of the failed part's waiting READs.
    assert len(link.posted) == 3 and link.reads.in_flight == 3 and link.reads.waiting == 0
    assert f.held()
    for _ in range(3):
        f.complete(link, link.posted[0], PeerUnreachable("work request failed: WR_FLUSH_ERR"))
    assert f.results == [f.results[0]] and not f.held()


def test_a_full_window_fails_the_part_and_what_it_posted_still_holds() -> None:
    f = Fabric()
    link = ReadLink(f.sender, rd_atomic=1)
    link.reads.max_waiting = 1
    part = f.part([(0, 4096 * 3)], [(0, 4096 * 3)])
    t = Transfer(1, 1, 0, f.results.append)
    f.sender.read(link, part, t)
    del part
    assert len(f.results) == 1 and isinstance(f.results[0], OverLimit)
    assert len(link.posted) == 1 and link.reads.waiting == 1
    assert f.held()
    f.complete(link, link.posted[0])  # the waiting one is dropped, never posted
    assert not link.posted and link.reads.in_flight == 0 and not f.held()


def test_a_closed_queue_pair_fails_the_waiting_reads_and_lets_go() -> None:
    f = Fabric()
    link, _ = start(f, 1, 2)
    # What QpEnd.close does once the queue pair is destroyed (domain.py): the window's
    # waiting READs fail unposted, the posted one as a flushed work request.
    err = PeerUnreachable("queue pair closed")
    for r in link.reads.drain():
        f.sender.not_posted(r, err)
    assert f.results == [err] and f.held()
    f.complete(link, link.posted[0], err)
    assert not f.held()


def test_a_read_into_unregistered_memory_is_refused_before_anything_is_posted() -> None:
    f = Fabric()
    link = ReadLink(f.sender)
    other = bytearray(4096)
    part = ReadPart(0, DST, RKEY, [f.remote_base], [4096], [memoryview(other)])
    with pytest.raises(TransferdError):
        f.sender.read(link, part, Transfer(1, 1, 0, f.results.append))
    assert not link.posted and link.reads.in_flight == 0


def test_reads_are_cut_at_read_max_whatever_the_port_allows() -> None:
    f = Fabric(local_size=3 * READ_MAX)
    f.remote = np.zeros(3 * READ_MAX, np.uint8)
    f.remote_base = address_of(memoryview(f.remote))
    link = ReadLink(f.sender, rd_atomic=16, max_msg=1 << 31, max_sge=1)
    f.sender.read(link, f.part([(0, 3 * READ_MAX)], [(0, 3 * READ_MAX)]),
                  Transfer(1, 1, 0, f.results.append))
    assert [p.spec.nbytes for p in link.posted] == [READ_MAX] * 3
