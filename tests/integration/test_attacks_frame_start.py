"""The peer plane's receive path with a 16 KiB frame start, attacked on live daemons.

transferd/protocol/peer_inbound.py reads a frame's start with SMALL_PAYLOAD bytes of
room past its header: the payload bytes that came with a header are copied to the
pages once they are checked, the rest received straight into them.  A raw peer holding
the cluster secret sends mixes of refused, valid, paged, checksummed, empty and message
frames, cut at every boundary; the region's bytes are compared end to end with a
model, and the immediates counted with the writes that landed.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from client import NetAddr
from tests.helpers import DaemonProcess, async_test
from tests.integration.engine_cluster import (
    SECRET,
    Cluster,
    Node,
    Region,
    fresh_imm,
    nodes,
    poll,
)
from tests.integration.fake_peer import FakePeer, raw_write
from transferd.protocol.crc import crc_of
from transferd.protocol.peer_ext import encode_ext
from transferd.protocol.peer_inbound import SMALL_PAYLOAD
from transferd.protocol.peer_wire import encode_send

from . import engine_cluster
from . import test_device_engine as dev

tcp_cluster = engine_cluster.tcp_cluster
clusters = engine_cluster.clusters
# The stand-in device's pair of daemons (device memory reached only through staging).
pair, hold_file, fault_file = dev.pair, dev.hold_file, dev.fault_file

REGION = 256 * 1024
GUARD = 4096  # nothing is ever written to a region's first and last GUARD bytes


@dataclass
class Stream:
    """Frames a raw peer sends, with what each must do to the region (a model)."""

    ptr: int
    rkey: int
    imm: int
    rng: random.Random
    model: bytearray = field(default_factory=lambda: bytearray(REGION))
    care: bytearray = field(default_factory=lambda: bytearray(b"\1" * REGION))
    frames: list[bytes] = field(default_factory=list)
    want: dict[int, bool] = field(default_factory=dict)  # op -> acknowledged ok
    messages: list[bytes] = field(default_factory=list)
    counted: int = 0
    op: int = 0
    bad_crcs: int = 0

    def _next(self) -> int:
        self.op += 1
        return self.op

    def _spot(self, n: int) -> int:
        return self.rng.randrange(GUARD, REGION - GUARD - n + 1)

    def _spots(self, lens: list[int]) -> list[int]:
        """Disjoint pages (in a random order) for ``lens``: overlapping pages are
        verified over what was placed, not as sent."""
        gaps = [self.rng.choice([0, 0, 1, 13, 600]) for _ in lens]
        start = self._spot(sum(lens) + sum(gaps))
        slots, pos = [], start
        for n, g in zip(lens, gaps, strict=True):
            slots.append(pos)
            pos += n + g
        if len(set(lens)) == 1:
            self.rng.shuffle(slots)
        return [self.ptr + a for a in slots]

    def write(self, lens: list[int], *, ok: bool = True, rkey: int | None = None,
              addrs: list[int] | None = None, crc: str | None = None, imm: bool = True,
              trace: bool = False) -> None:
        """A WRITE of pages ``lens`` (at random offsets unless ``addrs``); ``crc``:
        None, "good" or "bad"."""
        op = self._next()
        if addrs is None:
            addrs = self._spots(lens)
        pages = [self.rng.randbytes(n) for n in lens]
        payload = b"".join(pages)
        body = {"op": op, "part": 0, "rkey": self.rkey if rkey is None else rkey,
                "addrs": addrs, "lens": lens, "imm": self.imm if imm else None}
        c = None if crc is None else crc_of([payload]) ^ (0 if crc == "good" else 0x5A5A)
        tid = b"\0" + self.rng.randbytes(24) + b"\1" if trace else None
        ext = encode_ext(c, tid) if c is not None or tid is not None else b""
        self.frames.append(raw_write(body, payload, ext=ext))
        landed = ok and crc != "bad"
        self.want[op] = landed
        if crc == "bad":
            self.bad_crcs += 1
            for a, n in zip(addrs, lens, strict=True):
                off = a - self.ptr
                self.care[off:off + n] = bytes(n)  # (placed, then refused: any bytes)
        elif ok:
            for a, page in zip(addrs, pages, strict=True):
                off = a - self.ptr
                self.model[off:off + len(page)] = page
                self.care[off:off + len(page)] = b"\1" * len(page)
            if imm:
                self.counted += len(lens)  # (a page, a count)

    def send(self, n: int) -> None:
        op = self._next()
        msg = self.rng.randbytes(n)
        self.frames.append(encode_send(op, 0, n) + msg)
        self.want[op] = True
        self.messages.append(msg)

    def mixed(self, count: int) -> None:
        """``count`` frames of every kind, in a random order."""
        r = self.rng
        for _ in range(count):
            kind = r.randrange(11)
            if kind == 0:  # refused: an rkey nobody has
                self.write([r.choice([1, 4096, SMALL_PAYLOAD, 40000])], ok=False,
                           rkey=self.rkey ^ 0x7FFF_0000)
            elif kind == 1:  # refused: one byte more than the region holds
                n = r.choice([1, 100, 4096, SMALL_PAYLOAD + 1])
                self.write([n + 1], ok=False, addrs=[self.ptr + REGION - n])
            elif kind == 2:  # refused: starts one byte before the region
                self.write([r.choice([1, 64, 4096])], ok=False, addrs=[self.ptr - 1])
            elif kind == 3:  # empty
                self.write([0], addrs=[self.ptr + GUARD], imm=r.random() < 0.5)
            elif kind == 4 and r.random() < 0.8:  # paged, lengths of their own (a table)
                lens = [r.randrange(1, 3000) for _ in range(r.randrange(2, 9))]
                self.write(lens, crc=r.choice([None, "good"]))
            elif kind == 5:  # paged, one length (many pages)
                n = r.choice([2, 3, 17, 64, 255, 256])  # (256: the longest header guessed)
                self.write([r.choice([64, 512])] * n, crc=r.choice([None, "good"]))
            elif kind == 4 and r.random() < 0.2:  # a page table past the guess's limit
                self.write([r.randrange(1, 300) for _ in range(r.choice([130, 140]))],
                           crc=r.choice([None, "good"]), trace=True)
            elif kind == 6 and self.bad_crcs < 2:  # checksum wrong
                self.write([r.choice([16, 4096, SMALL_PAYLOAD - 70, 50000])], crc="bad")
                self.write([r.choice([8, 4096])], crc="good")  # (resets the run)
            elif kind == 7:
                self.send(r.choice([0, 1, 300, 5000]))
            elif kind == 8:  # larger than the frame-start read: head buffer, then direct
                self.write([r.choice([SMALL_PAYLOAD - 1, SMALL_PAYLOAD, SMALL_PAYLOAD + 1,
                                      70000])], crc=r.choice([None, "good"]))
            else:  # the small write
                self.write([r.choice([1, 7, 4096, 4096, 8000])], imm=r.random() < 0.8)

    def wire(self) -> bytes:
        return b"".join(self.frames)

    def check(self, got: bytes) -> None:
        assert len(got) == REGION
        bad = [i for i in range(REGION)
               if self.care[i] and got[i] != self.model[i]] if got != self.model else []
        assert not bad, (f"{len(bad)} bytes differ, first at offset {bad[0]} "
                         f"(got {got[bad[0]]:#x}, want {self.model[bad[0]]:#x})")


async def _target(b: Node) -> tuple[NetAddr, Region, int, int]:
    """B's address, a fresh region of B's, its first rail's rkey, a fresh immediate."""
    dst = await b.region(REGION)
    return await b.client.main_address(), dst, dst.desc.rkeys[0][1], fresh_imm()


def _reading(p: FakePeer, n: int) -> tuple[dict[int, Any], threading.Thread]:
    """A thread reading ``n`` ACKs off ``p`` (op -> ACK body) while the caller sends."""
    acks: dict[int, Any] = {}

    def read() -> None:
        for _ in range(n):
            a = p.recv()
            acks[a.body["op"]] = a.body

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return acks, reader


def _joined(acks: dict[int, Any], reader: threading.Thread, n: int) -> dict[int, Any]:
    reader.join(20)
    assert not reader.is_alive(), f"{len(acks)} of {n} ACKs"
    return acks


def _talk(addr: Any, stream: Stream, cuts: list[int], pause: float) -> dict[int, Any]:
    """Handshake, the stream's bytes cut at ``cuts`` (each piece its own send, a pause
    between), every ACK read; op -> ACK body.  No cuts: sent whole while another
    thread reads the ACKs."""
    data = stream.wire()
    with FakePeer(addr, 0, SECRET) as p:
        p.handshake()
        p.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not cuts:
            acks, reader = _reading(p, len(stream.want))
            p.conn.send_raw(data)
            return _joined(acks, reader, len(stream.want))
        last = 0
        for c in [*sorted(set(cuts)), len(data)]:
            if c <= last or c > len(data):
                continue
            p.conn.send_raw(data[last:c])
            last = c
            if pause:
                time.sleep(pause)
        acks = {}
        for _ in range(len(stream.want)):
            a = p.recv()
            acks[a.body["op"]] = a.body
        return acks


async def _run(cl: Cluster, seed: int, count: int, cuts_of: Any, pause: float) -> None:
    await _run_on(cl.b, seed, count, cuts_of, pause)


async def _run_on(d: DaemonProcess, seed: int, count: int, cuts_of: Any, pause: float,
                  device: str | None = None) -> None:
    async with nodes(d) as (b,):
        addr_b = await b.client.main_address()
        if device is None:
            dst = await b.region(REGION)
        else:  # (landed through staging: deferred, the link held until it is home)
            buf = await b.client.alloc_buffer(REGION, device=device)
            b.buffers.append(buf)
            await b.client.set_tensor(buf.tensor(), bytes(REGION))
            mr, desc = await b.client.reg_mr(buf)
            dst = Region(buf, mr, desc, bytearray(REGION))
        neighbour = await b.region(REGION)
        got_msgs: list[bytes] = []
        b.client.submit_recvs(8192, 10_000, got_msgs.append)
        rkey = dst.desc.rkeys[0][1]  # (rail 0's)
        st = Stream(dst.desc.ptr, rkey, fresh_imm(), random.Random(seed))
        st.mixed(count)
        acks = await asyncio.to_thread(_talk, addr_b, st, cuts_of(st), pause)
        assert set(acks) == set(st.want), (sorted(acks), sorted(st.want))
        wrong = {op: acks[op] for op, ok in st.want.items()
                 if bool(acks[op].get("ok")) != ok}
        assert not wrong, wrong
        st.check(await b.read(dst))
        assert await b.read(neighbour) == bytes(REGION)
        assert await poll(lambda: b.client.imm_count(st.imm), st.counted) == st.counted
        for _ in range(500):  # (bounded: 5 s)
            if len(got_msgs) >= len(st.messages):
                break
            await asyncio.sleep(0.01)
        assert got_msgs == st.messages
        await asyncio.sleep(0.05)
        assert await b.client.imm_count(st.imm) == st.counted
        # B serves others: a fresh client.
        async with nodes(d) as (b2,):
            assert await b2.client.main_address() == addr_b


@async_test(timeout=60)
async def test_mixed_frames_in_one_send_land_exactly(tcp_cluster: Cluster) -> None:
    """Refused (unknown rkey, a byte past the region, a byte before it), empty, paged,
    checksummed (good and bad), message and small frames back to back in one send:
    each ACKed as it should be, the region's bytes as the model says, counts exact."""
    for seed in range(3):
        await _run(tcp_cluster, seed, 60, lambda st: [], 0)


@async_test(timeout=60)
async def test_thousands_of_tiny_frames_back_to_back_land_exactly(
        tcp_cluster: Cluster) -> None:
    """Thousands of tiny writes (some refused, some checksummed) and messages in one
    send: many whole frames in each frame-start read, and one cut short at its end."""
    async with nodes(tcp_cluster.b) as (b,):
        await b.client.main_address()
    st_count = 4000

    def tiny(st: Stream) -> None:
        r = st.rng
        for _ in range(st_count):
            k = r.randrange(20)
            if k == 0:
                st.write([r.choice([1, 8])], ok=False, rkey=st.rkey ^ 0x10000)
            elif k == 1:
                st.write([r.choice([1, 8, 64])], crc="good")
            elif k == 2:
                st.send(r.choice([0, 5]))
            else:
                st.write([r.choice([1, 4, 8, 64])], imm=r.random() < 0.5)

    await _run(tcp_cluster, 40, 0, lambda st: tiny(st) or [], 0)


def _unread_then_read(addr: Any, st: Stream) -> tuple[dict[int, Any], bool]:
    """The stream's bytes sent without reading an ACK until B stops taking them (its
    ACK watermark holds its reading, frames left in its buffer), then the ACKs read
    while the rest goes; (op -> ACK body, whether B was seen to stop)."""
    data = memoryview(st.wire())
    with FakePeer(addr, 0, SECRET) as p:
        p.handshake()
        sock = p.conn.sock
        sock.settimeout(0.3)
        pos, stalled = 0, False
        deadline = time.monotonic() + 8
        while pos < len(data) and time.monotonic() < deadline:
            try:
                pos += sock.send(data[pos:pos + (1 << 16)])
            except TimeoutError:
                stalled = True
                break
        sock.settimeout(10)
        acks, reader = _reading(p, len(st.want))
        if pos < len(data):
            sock.sendall(data[pos:])
        return _joined(acks, reader, len(st.want)), stalled


@async_test(timeout=60)
async def test_acks_unread_hold_the_link_with_frames_in_its_buffer(
        tcp_cluster: Cluster) -> None:
    """Refused writes (whose ACKs carry their reason: more bytes back than in) and
    small valid ones, their ACKs unread until B stops reading; then read: B released
    its hold and went on with the frames left in its buffer, in order, bytes exact."""
    async with nodes(tcp_cluster.b) as (b,):
        addr_b = await b.client.main_address()
        dst = await b.region(REGION)
        rkey = dst.desc.rkeys[0][1]
        st = Stream(dst.desc.ptr, rkey, fresh_imm(), random.Random(50))
        r = st.rng
        for i in range(60_000):
            if i % 50 == 7:
                st.write([r.choice([1, 8, 300])], imm=r.random() < 0.5)
            elif i % 97 == 3:
                st.write([64], crc="good")
            else:
                st.write([1], ok=False, addrs=[st.ptr - 1], imm=False)
        acks, stalled = await asyncio.to_thread(_unread_then_read, addr_b, st)
        print("B stopped reading:", stalled)
        assert set(acks) == set(st.want)
        wrong = {op: acks[op] for op, ok in st.want.items()
                 if bool(acks[op].get("ok")) != ok}
        assert not wrong, list(wrong.items())[:3]
        st.check(await b.read(dst))
        assert await poll(lambda: b.client.imm_count(st.imm), st.counted) == st.counted


@async_test(timeout=60)
async def test_mixed_frames_cut_at_random_land_exactly(tcp_cluster: Cluster) -> None:
    """The same mixes cut into pieces of random sizes, each sent on its own."""
    def cuts(st: Stream) -> list[int]:
        n = len(st.wire())
        return [st.rng.randrange(n) for _ in range(120)]

    for seed in range(10, 14):
        await _run(tcp_cluster, seed, 40, cuts, 0.001)


@async_test(timeout=60)
async def test_mixed_frames_into_device_memory_land_exactly(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """The same mixes into a region of (stand-in) device memory: each write lands
    through staging while the link holds, the frames after it in the buffer wait."""
    def cuts(st: Stream) -> list[int]:
        n = len(st.wire())
        return [st.rng.randrange(n) for _ in range(60)]

    await _run_on(pair[1], 30, 50, lambda st: [], 0, device="standin:0")
    await _run_on(pair[1], 31, 40, cuts, 0.001, device="standin:0")


@async_test(timeout=60)
async def test_cuts_at_every_frame_edge_land_exactly(tcp_cluster: Cluster) -> None:
    """Every frame's bytes cut around its header's end and its start: a byte either
    side of each edge."""
    def cuts(st: Stream) -> list[int]:
        out, pos = [], 0
        for f in st.frames:
            hl = min(len(f), 64 + 16 * 8)
            for e in (pos, pos + 48, pos + 64, pos + hl):
                out += [e - 1, e, e + 1]
            pos += len(f)
        return out

    for seed in range(20, 22):
        await _run(tcp_cluster, seed, 30, cuts, 0.0005)


@async_test(timeout=60)
async def test_a_small_write_cut_at_every_byte(tcp_cluster: Cluster) -> None:
    """A refused write, then a checksummed small write and a plain one: the bytes cut
    in two at every offset across the first two frames' headers and payloads."""
    cl = tcp_cluster
    async with nodes(cl.b) as (b,):
        addr_b, dst, rkey, imm = await _target(b)
        rng = random.Random(99)
        rounds = 0

        def go() -> list[bytes]:
            nonlocal rounds
            bodies = []
            with FakePeer(addr_b, 0, SECRET) as p:
                p.handshake()
                p.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                frames_len = 0
                k = 0
                while k <= frames_len and k < 400:
                    base = 4 * GUARD + (k % 8) * 512
                    a, c = rng.randbytes(96), rng.randbytes(40)
                    data = (raw_write({"op": 3 * k + 1, "part": 0, "rkey": rkey ^ 0x40000,
                                       "addrs": [dst.desc.ptr], "lens": [80]}, bytes(80))
                            + raw_write({"op": 3 * k + 2, "part": 0, "rkey": rkey,
                                         "addrs": [dst.desc.ptr + base], "lens": [96],
                                         "imm": imm}, a, ext=encode_ext(crc_of([a]), None))
                            + raw_write({"op": 3 * k + 3, "part": 0, "rkey": rkey,
                                         "addrs": [dst.desc.ptr + base + 96], "lens": [40],
                                         "imm": imm}, c))
                    frames_len = len(data) - 40
                    p.conn.send_raw(data[:k])
                    time.sleep(0.0005)
                    p.conn.send_raw(data[k:])
                    acks = [p.recv().body for _ in range(3)]
                    assert [x.get("ok", False) for x in acks] == [False, True, True], (k, acks)
                    bodies.append(a + c)
                    rounds += 1
                    k += 1
            return bodies

        bodies = await asyncio.to_thread(go)
        assert rounds > 200
        got = await b.read(dst)
        for k in range(max(0, len(bodies) - 8), len(bodies)):
            base = 4 * GUARD + (k % 8) * 512
            assert got[base:base + 136] == bodies[k], k
        assert got[:4 * GUARD] == bytes(4 * GUARD)
        assert await poll(lambda: b.client.imm_count(imm), 2 * rounds) == 2 * rounds
        await asyncio.sleep(0.05)
        assert await b.client.imm_count(imm) == 2 * rounds


@async_test(timeout=60)
async def test_a_peer_gone_mid_payload_counts_nothing(tcp_cluster: Cluster) -> None:
    """A header and part of its payload (some in the frame-start read, the rest never),
    then the peer vanishes: nothing counts; B serves the next peer's write there."""
    cl = tcp_cluster
    async with nodes(cl.b) as (b,):
        addr_b, dst, rkey, imm = await _target(b)
        for n, sent in ((4096, 100), (SMALL_PAYLOAD + 4096, SMALL_PAYLOAD + 10),
                        (100_000, 50_000)):
            data = raw_write({"op": 1, "part": 0, "rkey": rkey, "addrs": [dst.desc.ptr + GUARD],
                              "lens": [n], "imm": imm}, b"\xee" * n)

            def vanish(data: bytes = data, sent: int = sent, n: int = n) -> None:
                with FakePeer(addr_b, 0, SECRET) as p:
                    p.handshake()
                    p.conn.send_raw(data[:len(data) - n + sent])
                    time.sleep(0.05)

            await asyncio.to_thread(vanish)
            await asyncio.sleep(0.1)
            assert await b.client.imm_count(imm) == 0, n
        good = random.Random(5).randbytes(5000)

        def again() -> Any:
            with FakePeer(addr_b, 0, SECRET) as p:
                p.handshake()
                return p.write(rkey, [dst.desc.ptr + GUARD], [5000], good, imm=imm).body

        assert (await asyncio.to_thread(again)).get("ok") is True
        got = await b.read(dst)
        assert got[GUARD:GUARD + 5000] == good
        assert got[:GUARD] == bytes(GUARD)
        assert got[GUARD + 100_000:] == bytes(REGION - GUARD - 100_000)
        assert await poll(lambda: b.client.imm_count(imm), 1) == 1


@async_test(timeout=60)
async def test_a_duplicate_write_id_in_the_same_receive_is_dropped(
        tcp_cluster: Cluster) -> None:
    """A write with a write id, then the same write id again with other bytes, then a
    plain write, in one send: the second is acknowledged and dropped (its payload, in
    the frame-start read, is not copied to the pages), the count taken once."""
    cl = tcp_cluster
    async with nodes(cl.b) as (b,):
        addr_b, dst, rkey, imm = await _target(b)
        ptr = dst.desc.ptr
        rng = random.Random(77)
        first, second, third = rng.randbytes(3000), rng.randbytes(3000), rng.randbytes(500)
        wid = rng.getrandbits(63) + 1

        def go() -> list[Any]:
            w = {"part": 0, "rkey": rkey, "addrs": [ptr + GUARD], "lens": [3000],
                 "imm": imm, "wid": wid}
            data = (raw_write({**w, "op": 1}, first) + raw_write({**w, "op": 2}, second)
                    + raw_write({"op": 3, "part": 0, "rkey": rkey, "addrs": [ptr + 2 * GUARD],
                                 "lens": [500], "imm": imm}, third))
            with FakePeer(addr_b, 0, SECRET) as p:
                p.handshake()
                p.conn.send_raw(data)
                return [p.recv().body for _ in range(3)]

        acks = await asyncio.to_thread(go)
        assert [a.get("ok") for a in acks] == [True, True, True], acks
        got = await b.read(dst)
        assert got[GUARD:GUARD + 3000] == first
        assert got[2 * GUARD:2 * GUARD + 500] == third
        assert got[:GUARD] == bytes(GUARD)
        assert await poll(lambda: b.client.imm_count(imm), 2) == 2
        await asyncio.sleep(0.05)
        assert await b.client.imm_count(imm) == 2
