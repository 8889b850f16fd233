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
from transferd.protocol import crc
from transferd.protocol.errors import BadRequest, IntegrityError, NotFound
from transferd.protocol.peer_ext import encode_ext
from transferd.protocol.peer_landing import Landing
from transferd.protocol.peer_link import RECV_BYTES, Land
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



@pytest.mark.parametrize("chunk", [1 << 20, 1000, 7])
def test_a_verified_part_whose_pages_overlap_is_judged_alike_whatever_the_cut(
        chunk: int) -> None:
    # Two pages at one address: what is placed there is the second page's bytes twice,
    # not the payload sent.  Received in one receive, the running checksum read the
    # pages back after both landed (a mismatch); in two, it took each as it came (the
    # payload's, a match): the verdict must not depend on how the stream was cut.  It
    # is the checksum of what was placed, as for a part verified once it landed.
    mem, _, p = _pair()
    r = mem.region(1 << 16)
    rng = random.Random(3)
    data = rng.randbytes(2000)
    p.out.write(1, 1, 0, r.rkeys[0], [r.ptr, r.ptr], [1000, 1000],
                [memoryview(data)[:1000], memoryview(data)[1000:]], 5,
                ext=encode_ext(crc32c.crc32c(data), None))
    # Pages overlapping by half whose shared bytes agree: placed is what was sent.
    a, b, c = rng.randbytes(500), rng.randbytes(500), rng.randbytes(500)
    p.out.write(2, 2, 0, r.rkeys[0], [r.ptr + 5000, r.ptr + 5500], [1000, 1000],
                [memoryview(a + b), memoryview(b + c)], 6,
                ext=encode_ext(crc32c.crc32c(a + b + b + c), None))
    feed(p.inb, drain(p.out), chunk=chunk)
    feed(p.out, drain(p.inb))
    errs = dict(p.out.completions)
    assert isinstance(errs[1], IntegrityError) and mem.counts[5] == 0
    assert bytes(r.data[:1000]) == data[1000:]
    assert errs[2] is None and mem.counts[6] == 2
    assert bytes(r.data[5000:6500]) == a + b + c


def _feed_cut(p, data: bytes, rng: random.Random, sizes: list[int]) -> None:
    """Deliver ``data`` in receives of sizes drawn from ``sizes``; a deferred landing
    (device memory) is reported done whenever the link holds for one."""
    link, mv = p.inb, memoryview(data)
    while not link.closed:
        if not link.reading:
            lands = [e for e in link.events if isinstance(e, Land)]
            assert lands, "held with no landing in flight"
            for e in lands:
                link.events.remove(e)
                link.landed(e, None)
            continue
        if not len(mv):
            return
        chunk, n = rng.choice(sizes), 0
        for b in link.get_buffers():
            k = min(len(b), len(mv) - n, chunk - n)
            b[:k] = mv[n:n + k]
            n += k
            if n == len(mv) or n == chunk:
                break
        link.received(n, 0.0)
        mv = mv[n:]


CUTS = [1, 2, 3, 13, 47, 48, 63, 64, 65, 97, 98, 99, 2000, 2100, 2200, 4096, 9000,
        RECV_BYTES, RECV_BYTES + 1, 1 << 24]


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_verified_writes_of_every_shape_mixed_whatever_the_cuts(seed: int,
                                                                 deferred: bool) -> None:
    # One stream of writes of every shape (one page, pages of one length, thousands of
    # tiny ones some empty, none, socket-sized), most checksummed, some changed in
    # flight, some traced (the frame-start read grows), some refused (a bad rkey) or
    # duplicates (a write id applied: dropped unread), cut at receives of odd sizes:
    # each checksummed part lands exactly when its bytes came intact (no byte of a
    # receive skipped or taken twice, nothing of one frame's checksum left to the next).
    rng = random.Random(seed)
    mem = HostMemory(1, deferred=deferred)
    p = link_pair(Landing(mem, 1), identity(1), identity(1))
    r = mem.region(1 << 22)
    wire, expect, placed, applied = bytearray(), {}, {}, []
    cursor = bad_run = 0
    for op in range(1, 41):
        shape = rng.choice(["one", "paged", "tiny", "none", "big"])
        if shape == "one":
            lens = [rng.randint(1, 9000)]
        elif shape == "paged":
            lens = [rng.choice([1, 7, 64, 100, 3000])] * rng.randint(2, 300)
        elif shape == "tiny":
            lens = [rng.randint(0, 5) for _ in range(rng.randint(2, 2000))]
            lens[0] += 1
        elif shape == "none":
            lens = []
        else:
            lens = [rng.randint(RECV_BYTES, 2 * RECV_BYTES + 77)]
        if cursor + 4 * sum(lens) + 100 > len(r.data):
            break
        addrs = []
        for n in lens:
            addrs.append(r.ptr + cursor)
            cursor += n + rng.randint(0, 3)
        wid = rng.getrandbits(32) | 1 if rng.random() < 0.2 else None
        dup = bool(applied) and rng.random() < 0.15
        if dup:
            wid, addrs, lens = rng.choice(applied)
        data = rng.randbytes(sum(lens))
        checked = rng.random() < 0.8
        value = crc32c.crc32c(data) if checked else None
        corrupt = checked and bool(data) and bad_run < 2 and rng.random() < 0.2
        if checked and not data and rng.random() < 0.3:
            value, corrupt = value ^ 1, True  # (no payload: a wrong checksum of none)
        badkey = rng.random() < 0.1
        trace = bytes(range(TRACE_LEN)) if rng.random() < 0.3 else None
        src, pos = [], 0
        for n in lens:
            src.append(memoryview(data)[pos:pos + n])
            pos += n
        ext = encode_ext(value, trace) if checked or trace else b""
        p.out.write(op, op, 0, r.rkeys[0] ^ (2 if badkey else 0), addrs, lens, src, 5,
                    None, wid, False, ext)
        frame = bytearray(drain(p.out))
        if corrupt and data:
            frame[len(frame) - len(data) + rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        wire += frame
        if dup:
            expect[op] = None  # acknowledged ok, neither placed nor counted again
        elif badkey:
            expect[op] = NotFound
        elif corrupt:
            expect[op] = IntegrityError
            bad_run += 1
        else:
            expect[op] = None
            bad_run = 0 if checked else bad_run
            placed[op] = (addrs, lens, data)
            if wid is not None and lens:
                applied.append((wid, addrs, lens))
    _feed_cut(p, bytes(wire), rng, CUTS)
    assert not p.inb.closed, p.inb.error
    feed(p.out, drain(p.inb))
    got = dict(p.out.completions)
    assert got.keys() == expect.keys()
    for op, want in expect.items():
        assert (got[op] is None) if want is None else isinstance(got[op], want), (op, got[op])
    for addrs, lens, data in placed.values():
        pos = 0
        for a, n in zip(addrs, lens, strict=True):
            assert bytes(r.data[a - r.ptr:a - r.ptr + n]) == data[pos:pos + n]
            pos += n


def test_with_no_crc_package_a_verified_write_is_refused_never_skipped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Neither awscrt nor crc32c installed: a checksummed write is refused (saying what
    # to install) and counts nothing; its payload is read through, and a write after
    # it, unchecked, lands.  Once a package is there, checksummed writes land again.
    def missing() -> None:
        raise BadRequest("checksums (verify) need the awscrt or the crc32c package")

    mem, _, p = _pair()
    r = mem.region(1 << 16)
    data = random.Random(5).randbytes(7000)
    monkeypatch.setattr(crc, "require", missing)
    for op, ext in ((1, encode_ext(crc32c.crc32c(data), None)), (2, b"")):
        p.out.write(op, op, 0, r.rkeys[0], [r.ptr + 8000 * op], [len(data)],
                    [memoryview(data)], op, ext=ext)
    feed(p.inb, drain(p.out), chunk=999)
    feed(p.out, drain(p.inb))
    errs = dict(p.out.completions)
    assert type(errs[1]) is BadRequest and "crc32c" in str(errs[1])
    assert errs[2] is None and mem.counts[1] == 0 and mem.counts[2] == 1
    monkeypatch.undo()
    p.out.write(3, 3, 0, r.rkeys[0], [r.ptr], [len(data)], [memoryview(data)], 3,
                ext=encode_ext(crc32c.crc32c(data), None))
    feed(p.inb, drain(p.out), chunk=999)
    feed(p.out, drain(p.inb))
    assert dict(p.out.completions)[3] is None and mem.counts[3] == 1
