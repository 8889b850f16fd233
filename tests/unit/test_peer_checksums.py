"""A checksummed WRITE's CRC32C taken as its bytes arrive, in memory (no sockets).

The receiving end takes the checksum over each receive's bytes as they land (straight
into the pages, or copied from the link's buffer after a header), not over the part
once it is whole: whatever the cut of the stream, a part whose bytes arrive intact is
counted, and one with a single byte changed in flight is refused and counts nothing.
"""

from __future__ import annotations

import random

import crc32c
import pytest

from tests.peerlink import HostMemory, drain, feed, identity, link_pair
from transferd.protocol.errors import IntegrityError
from transferd.protocol.peer_ext import encode_ext
from transferd.protocol.peer_landing import Landing
from transferd.protocol.peer_link import RECV_BYTES
from transferd.protocol.trace import WIRE_LEN as TRACE_LEN

PAGE = 3000  # pages that never line up with a receive's size
PAGES = 11


def _pair():
    mem = HostMemory(1)
    landing = Landing(mem, 1)
    return mem, landing, link_pair(landing, identity(1), identity(1))


def _send(p, r, data: bytes, crc: int, op: int = 1) -> bytes:
    lens = [PAGE] * (len(data) // PAGE)
    addrs = [r.ptr + 2 * PAGE * k for k in range(len(lens))]  # gaps: pages apart
    src = [memoryview(data)[PAGE * k:PAGE * (k + 1)] for k in range(len(lens))]
    p.out.write(op, op, 0, r.rkeys[0], addrs, lens, src, 5, ext=encode_ext(crc, None))
    return drain(p.out)


def _placed(r, n: int) -> bytes:
    return b"".join(bytes(r.data[2 * PAGE * k:2 * PAGE * k + PAGE]) for k in range(n))


@pytest.mark.parametrize("chunk", [1, 13, 64, 65, 70, 2999, 3000, 4097, 1 << 20])
def test_a_verified_paged_write_lands_whatever_the_cut(chunk: int) -> None:
    mem, _, p = _pair()
    r = mem.region(2 * PAGE * PAGES)
    data = random.Random(chunk).randbytes(PAGE * PAGES)
    feed(p.inb, _send(p, r, data, crc32c.crc32c(data)), chunk=chunk)
    feed(p.out, drain(p.inb))
    assert p.out.completions == [(1, None)]
    assert _placed(r, PAGES) == data and mem.counts[5] == PAGES


@pytest.mark.parametrize("chunk", [1, 64, 4097, 1 << 20])
@pytest.mark.parametrize("where", [0, PAGE - 1, PAGE, PAGE * PAGES - 1])
def test_one_byte_changed_in_flight_is_refused(chunk: int, where: int) -> None:
    mem, landing, p = _pair()
    r = mem.region(2 * PAGE * PAGES)
    data = random.Random(where).randbytes(PAGE * PAGES)
    wire = bytearray(_send(p, r, data, crc32c.crc32c(data)))
    wire[len(wire) - len(data) + where] ^= 0x40  # the payload's byte, not the source's
    feed(p.inb, bytes(wire), chunk=chunk)
    feed(p.out, drain(p.inb))
    ((_, err),) = p.out.completions
    assert isinstance(err, IntegrityError) and "checksum mismatch" in str(err)
    assert mem.counts[5] == 0 and landing.integrity_failures == {(p.inb.peer.key[0], 0): 1}


def test_a_large_verified_part_is_checked_as_it_comes_in_socket_sized_receives() -> None:
    # Received straight into its one page a socket's worth at a time: the checksum
    # of every receive's bytes chains to the part's; the last byte changed is caught.
    mem, _, p = _pair()
    size = 3 * RECV_BYTES + 12345
    r = mem.region(size)
    data = random.Random(9).randbytes(size)
    for bad in (False, True):
        p.out.write(bad, 7 + bad, 0, r.rkeys[0], [r.ptr], [size], [memoryview(data)], 5,
                    ext=encode_ext(crc32c.crc32c(data), None))
        wire = bytearray(drain(p.out))
        if bad:
            wire[-1] ^= 1
        feed(p.inb, bytes(wire), chunk=RECV_BYTES + 77)
        feed(p.out, drain(p.inb))
    assert p.out.completions[0] == (False, None)
    assert isinstance(p.out.completions[1][1], IntegrityError)
    assert mem.counts[5] == 1


@pytest.mark.parametrize("chunk", [1, 100, 1 << 20])
def test_payload_bytes_that_came_with_a_header_are_checked_too(chunk: int) -> None:
    # A traced write grows the frame-start read to its longer header; the next
    # frame's shorter header then brings the start of its payload into the link's
    # buffer, whence it is copied to the page: those bytes are in the checksum too.
    mem, _, p = _pair()
    r = mem.region(1 << 16)
    rng = random.Random(chunk)
    trace = bytes(range(TRACE_LEN))
    datas = [rng.randbytes(500) for _ in range(6)]
    wire = bytearray()
    for k, d in enumerate(datas):
        ext = encode_ext(crc32c.crc32c(d), trace if k % 3 == 0 else None)
        p.out.write(k, 20 + k, 0, r.rkeys[0], [r.ptr + 1000 * k], [len(d)], [memoryview(d)],
                    5, ext=ext)
        wire += drain(p.out)
        if k == 4:
            wire[-1] ^= 2  # write 4's last byte, changed in flight
    feed(p.inb, bytes(wire), chunk=chunk)
    feed(p.out, drain(p.inb))
    errs = dict(p.out.completions)
    assert [k for k in range(6) if errs[k] is None] == [0, 1, 2, 3, 5]
    assert isinstance(errs[4], IntegrityError) and mem.counts[5] == 5
    for k in (0, 1, 2, 3, 5):
        assert bytes(r.data[1000 * k:1000 * k + 500]) == datas[k]
