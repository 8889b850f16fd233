"""Stop 35's two changes, attacked on live daemons over loopback sockets.

The peer plane's receive path (transferd/protocol/peer_inbound.py): a frame's start
is read with SMALL_PAYLOAD bytes of room, the payload bytes that came with a header
copied to the pages, the rest received straight into them.  A raw peer sends mixes
of refused, valid, paged, checksummed, empty and message frames, cut at every
boundary; the region's bytes are compared end to end with a model, and the
immediates counted with the writes that landed.

The client library (client/engine.py, client/inproc.py): an awaiter cancelled
(wait_for, a TaskGroup) cancels its operation; ``Completion.wait(timeout)`` does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from client import Client, SyncClient
from tests.helpers import DaemonProcess, async_test
from tests.integration.engine_cluster import (
    SECRET,
    WAIT,
    Cluster,
    Region,
    fresh_imm,
    inproc_settings,
    nodes,
    poll,
)
from tests.integration.fake_peer import FakePeer, raw_write
from transferd.protocol.crc import crc_of
from transferd.protocol.errors import BadRequest, TransferdError
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


def _talk(addr: Any, stream: Stream, cuts: list[int], pause: float) -> dict[int, Any]:
    """Handshake, the stream's bytes cut at ``cuts`` (each piece its own send, a pause
    between), every ACK read; op -> ACK body.  No cuts: sent whole while another
    thread reads the ACKs."""
    data = stream.wire()
    with FakePeer(addr, 0, SECRET) as p:
        p.handshake()
        p.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not cuts:
            acks: dict[int, Any] = {}

            def read() -> None:
                for _ in range(len(stream.want)):
                    a = p.recv()
                    acks[a.body["op"]] = a.body

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            p.conn.send_raw(data)
            reader.join(20)
            assert not reader.is_alive(), f"{len(acks)} of {len(stream.want)} ACKs"
            return acks
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
        acks: dict[int, Any] = {}
        sock.settimeout(10)

        def read() -> None:
            for _ in range(len(st.want)):
                a = p.recv()
                acks[a.body["op"]] = a.body

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        if pos < len(data):
            sock.sendall(data[pos:])
        reader.join(20)
        assert not reader.is_alive(), f"{len(acks)} of {len(st.want)} ACKs"
        return acks, stalled


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
        addr_b = await b.client.main_address()
        dst = await b.region(REGION)
        (_, rkey), _ = dst.desc.rkeys
        imm = fresh_imm()
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
        addr_b = await b.client.main_address()
        dst = await b.region(REGION)
        (_, rkey), _ = dst.desc.rkeys
        imm = fresh_imm()
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


# -- change 2: a cancelled awaiter cancels its operation ---------------------------------


def _no_leaks(caught: list[warnings.WarningMessage], loop_errors: list[dict[str, Any]]) -> None:
    gc.collect()
    bad = [str(w.message) for w in caught
           if "never retrieved" in str(w.message) or "was never awaited" in str(w.message)]
    assert not bad, bad
    assert not loop_errors, loop_errors


@contextlib.contextmanager
def _watched() -> Any:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _l, ctx: errors.append(ctx))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield caught, errors
            gc.collect()
        finally:
            loop.set_exception_handler(old)
    _no_leaks(caught, errors)


@async_test(timeout=60)
async def test_cancelled_expectations_take_no_count(tcp_cluster: Cluster) -> None:
    """Expectations whose awaiters time out (wait_for) take nothing: the count goes to
    the next one; ``wait(timeout)`` leaves it armed; two awaiters of one Completion,
    one cancelled, cancel it for both (the other sees CancelledError or a result)."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        with _watched():
            imm = fresh_imm()
            # A burst of abandoned awaits: each cancels its expectation.
            for i in range(1000):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(b.client.expect_imm_count(imm, 1),
                                           0.0002 * (i % 8))
            # Each one's CANCEL ended it: nothing of them is kept (bounded memory).
            waiting = b.client._events.waiting
            for _ in range(500):  # (bounded: 5 s)
                if not waiting:
                    break
                await asyncio.sleep(0.01)
            assert not waiting, len(waiting)
            # wait(timeout) does not cancel.
            c = await b.client.expect_imm_count(imm, 1, wait=False)
            try:
                await c.wait(0.05)
                raise AssertionError("no count yet, but it ended")
            except TimeoutError:
                pass  # (the wait's, not the expectation's)
            assert not c.done()
            src = await a.region(4096, seed=3)
            dst = await b.region(4096)
            await (await a.client.submit_single_write(4096, imm, (src.mr, 0),
                                                      (dst.desc, 0))).wait(WAIT)
            await c.wait(WAIT)  # the one left armed took it
            assert await b.client.imm_count(imm) == 0
            assert await b.read(dst) == bytes(src.data)

            # Two awaiters of one Completion, one cancelled.
            c2 = await b.client.expect_imm_count(imm, 1, wait=False)
            t1 = asyncio.ensure_future(_await(c2))
            t2 = asyncio.ensure_future(_await(c2))
            await asyncio.sleep(0.01)
            t1.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t1
            await asyncio.wait_for(asyncio.gather(t2, return_exceptions=True), 5)
            await (await a.client.submit_single_write(4096, imm, (src.mr, 0),
                                                      (dst.desc, 0))).wait(WAIT)
            # Cancelled: the count was not taken by it.
            assert await poll(lambda: b.client.imm_count(imm), 1) == 1
            assert await b.client.main_address() == await b.client.main_address()


async def _await(c: Any) -> Any:
    return await c


@async_test(timeout=60)
async def test_cancel_while_the_connection_closes(tcp_cluster: Cluster) -> None:
    """Awaiters cancelled while their client closes, or after it closed: no traceback,
    no hang, no exception never retrieved."""
    cl = tcp_cluster
    with _watched():
        for round_ in range(20):
            c = await Client.connect(cl.b.url, timeout=WAIT)
            imm = fresh_imm()
            comps = [await c.expect_imm_count(imm, 1, wait=False) for _ in range(5)]
            tasks = [asyncio.ensure_future(_await(x)) for x in comps]
            tasks.append(asyncio.ensure_future(c.expect_imm_count(imm, 1)))
            await asyncio.sleep(0)
            closing = asyncio.ensure_future(c.close())
            if round_ % 2:
                await asyncio.sleep(0)
            for t in tasks:
                t.cancel()
            await asyncio.wait_for(closing, 5)
            got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
            # Each saw its cancel (or the close's ConnectionLost), never a RuntimeError
            # of a CANCEL written after the close's write_eof.
            odd = [g for g in got
                   if not isinstance(g, asyncio.CancelledError | TransferdError)]
            assert not odd, (round_, odd)
            # After the close: awaiting and cancelling again.
            late = asyncio.ensure_future(_await(comps[0]))
            await asyncio.sleep(0)
            late.cancel()
            (g,) = await asyncio.wait_for(asyncio.gather(late, return_exceptions=True), 5)
            assert isinstance(g, asyncio.CancelledError | TransferdError), g
    async with nodes(cl.b) as (b,):
        assert await b.client.imm_count(fresh_imm()) == 0


@async_test(timeout=60)
async def test_an_expectation_met_as_its_awaiter_is_cancelled(tcp_cluster: Cluster) -> None:
    """The write meets an expectation at about the moment its awaiter gives up: its
    count is either given to it or left for the next expectation, never lost or
    counted twice."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        src = await a.region(64, seed=8)
        dst = await b.region(64)
        with _watched(), _client_warnings() as said:
            for i in range(40):
                imm = fresh_imm()
                w = asyncio.ensure_future(a.client.submit_single_write(
                    64, imm, (src.mr, 0), (dst.desc, 0)))
                got = False
                try:
                    await asyncio.wait_for(b.client.expect_imm_count(imm, 1),
                                           0.0005 * (i % 10))
                    got = True
                except TimeoutError:
                    pass
                await (await w).wait(WAIT)
                await asyncio.sleep(0.02)
                left = await b.client.imm_count(imm)
                if got:
                    assert left == 0, i
                elif left == 0:  # taken as it was cancelled: a warning says so
                    assert any("cancelled" in m for m in said), (i, said)
                else:
                    # Not taken: left to be counted, and a next expectation takes it.
                    assert left == 1, (i, left)
                    await asyncio.wait_for(b.client.expect_imm_count(imm, 1), 5)
                    assert await b.client.imm_count(imm) == 0


@async_test(timeout=60)
async def test_inproc_cancelled_expectations_take_no_count(tcp_cluster: Cluster) -> None:
    """The inproc client: a cancelled awaiter cancels its expectation in the engine."""
    cl = tcp_cluster
    c = await Client.connect("inproc://", overrides=inproc_settings(cl.b), timeout=WAIT)
    try:
        with _watched():
            imm = fresh_imm()
            for _ in range(300):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(c.expect_imm_count(imm, 1), 0.0005)
            comp = await c.expect_imm_count(imm, 1, wait=False)
            with contextlib.suppress(Exception):
                await comp.wait(0.02)
            assert not comp.done()
            t = asyncio.ensure_future(_await(comp))
            await asyncio.sleep(0)
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
            assert await c.imm_count(imm) == 0
    finally:
        await asyncio.wait_for(c.close(), 10)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _client_warnings() -> Any:
    h = _Records()
    lg = logging.getLogger("transferd.client")
    lg.addHandler(h)
    try:
        yield h.messages
    finally:
        lg.removeHandler(h)


async def _count_one(a: Any, b: Any, imm: int) -> None:
    """One write of ``imm`` from A to B, landed (B's count is 1 more)."""
    src = await a.region(64, seed=4)
    dst = await b.region(64)
    await (await a.client.submit_single_write(64, imm, (src.mr, 0), (dst.desc, 0))).wait(WAIT)


@async_test(timeout=60)
async def test_met_as_its_awaiter_is_cancelled_is_never_lost_silently(
        tcp_cluster: Cluster) -> None:
    """The expectation's EVENT resolves it, and in the same loop turn (before the
    awaiting task ran) that task is cancelled: its count was consumed and the task saw
    only CancelledError.  It was lost without a word; now a warning says so."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        imm = fresh_imm()
        c = await b.client.expect_imm_count(imm, 1, wait=False)
        holder: list[asyncio.Task[Any]] = []
        # (Called before the task's own wake-up: the cancel lands on a done future.)
        c.add_done_callback(lambda _: holder[0].cancel())
        holder.append(asyncio.ensure_future(_await(c)))
        await asyncio.sleep(0)
        with _client_warnings() as said:
            await _count_one(a, b, imm)
            res = await asyncio.gather(holder[0], return_exceptions=True)
            assert isinstance(res[0], asyncio.CancelledError), res
            await asyncio.sleep(0.05)
            left = await b.client.imm_count(imm)
        assert left == 1 or any("cancelled" in m for m in said), (left, said)


@async_test(timeout=60)
async def test_a_registration_cancelled_before_its_reply_loses_no_count_silently(
        tcp_cluster: Cluster) -> None:
    """The count is there when the expectation registers: it fires at once on the
    daemon, and the task registering it is cancelled before the reply came.  The
    count was consumed and nothing said so (its EVENT found no Completion); now it is
    left, or a warning says it was taken."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        for _ in range(5):
            imm = fresh_imm()
            await _count_one(a, b, imm)
            assert await poll(lambda i=imm: b.client.imm_count(i), 1) == 1
            with _client_warnings() as said:
                t = asyncio.ensure_future(b.client.expect_imm_count(imm, 1))
                await asyncio.sleep(0)  # (its request is sent)
                t.cancel()
                (res,) = await asyncio.gather(t, return_exceptions=True)
                await asyncio.sleep(0.1)
                left = await b.client.imm_count(imm)
                await b.client.main_address()  # (the connection is sound)
            if not isinstance(res, BaseException):
                assert left == 0  # (it was not cancelled in time: it has the count)
                continue
            assert left == 1 or any("cancelled" in m for m in said), (left, said, res)


@async_test(timeout=60)
async def test_a_refused_registration_cancelled_before_its_reply_is_forgotten(
        tcp_cluster: Cluster) -> None:
    """Refused (a deadline over engine.max_expect_timeout_s) and given up before the
    refusal came: no EVENT will ever come for it, so its CANCEL's NOT_FOUND lets it go
    (it stayed in the client's table until the connection closed, one per such call)."""
    async with nodes(tcp_cluster.b) as (b,):
        for _ in range(50):
            t = asyncio.ensure_future(b.client.expect_imm_count(fresh_imm(), 1, timeout=1e9))
            await asyncio.sleep(0)  # (its request is sent)
            t.cancel()
            (res,) = await asyncio.gather(t, return_exceptions=True)
            assert isinstance(res, asyncio.CancelledError | BadRequest), res
        await b.client.main_address()  # (after the CANCELs' replies: the same connection)
        waiting = b.client._events.waiting
        for _ in range(500):  # (bounded: 5 s)
            if not waiting:
                break
            await asyncio.sleep(0.01)
        assert not waiting, len(waiting)


@async_test(timeout=60)
async def test_an_expectation_with_a_callback_whose_awaiter_times_out(
        tcp_cluster: Cluster) -> None:
    """expect_imm_count with a callback, then wait_for on its Completion: the cancel
    of its future ran the done callback, whose ``done.exception()`` raised
    CancelledError in the loop ("Exception in callback"); now the callback is not run
    and nothing is reported, and the count is left for the next expectation."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        fired: list[int] = []
        imm = fresh_imm()
        with _watched():
            for i in range(3):
                c = await b.client.expect_imm_count(imm, 1, lambda i=i: fired.append(i))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(c, 0.01)
            await asyncio.sleep(0.05)
        await _count_one(a, b, imm)
        assert await poll(lambda: b.client.imm_count(imm), 1) == 1
        assert fired == []


@async_test(timeout=60)
async def test_sync_client_timeouts_leave_the_expectation_armed(tcp_cluster: Cluster) -> None:
    """SyncClient.wait(c, timeout) times out and leaves ``c`` armed (it takes the next
    count); a thread blocked in an expectation while another closes the client gets
    an error, not a hang, and the daemon serves on."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        imm, imm2 = fresh_imm(), fresh_imm()

        s, c = await asyncio.to_thread(lambda: _armed_open(cl.b.url, imm))
        try:
            await _count_one(a, b, imm)
            await asyncio.to_thread(s.wait, c, WAIT)
            assert await b.client.imm_count(imm) == 0
            blocked: list[Any] = []

            def block() -> None:
                try:
                    s.expect_imm_count(imm2, 1)
                    blocked.append("fired")
                except BaseException as exc:  # (what it ended with)
                    blocked.append(exc)

            th = threading.Thread(target=block, daemon=True)
            th.start()
            await asyncio.sleep(0.2)
            await asyncio.to_thread(s.close)
            await asyncio.to_thread(th.join, 10)
            assert not th.is_alive()
            assert len(blocked) == 1 and isinstance(blocked[0], TransferdError), blocked
        finally:
            await asyncio.to_thread(s.close)
        await _count_one(a, b, imm2)
        assert await poll(lambda: b.client.imm_count(imm2), 1) == 1


def _armed_open(url: str, imm: int) -> tuple[Any, Any]:
    s = SyncClient.connect(url)
    c = s.expect_imm_count(imm, 1, wait=False)
    try:
        s.wait(c, 0.05)
        raise AssertionError("no count yet, but it ended")
    except TimeoutError:
        pass
    assert not c.done()
    return s, c


@async_test(timeout=60)
async def test_inproc_expectation_with_a_callback_whose_awaiter_times_out(
        tcp_cluster: Cluster) -> None:
    """The inproc client's expect_imm_count with a callback, its Completion awaited in
    wait_for: the cancelled future's done callback must not raise in the loop."""
    cl = tcp_cluster
    c = await Client.connect("inproc://", overrides=inproc_settings(cl.b), timeout=WAIT)
    try:
        fired: list[int] = []
        imm = fresh_imm()
        with _watched():
            for i in range(3):
                comp = await c.expect_imm_count(imm, 1, lambda i=i: fired.append(i))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(comp, 0.01)
            await asyncio.sleep(0.05)
        assert fired == []
    finally:
        await asyncio.wait_for(c.close(), 10)


@async_test(timeout=60)
async def test_inproc_met_as_its_awaiter_is_cancelled_is_never_lost_silently(
        tcp_cluster: Cluster) -> None:
    """The inproc client: the engine ends an expectation done, and its awaiter is
    cancelled in that same loop turn: a warning says the count was taken."""
    cl = tcp_cluster
    c = await Client.connect("inproc://", overrides=inproc_settings(cl.b), timeout=WAIT)
    try:
        async with nodes(cl.a) as (a,):
            buf = await c.alloc_buffer(64)
            _, desc = await c.reg_mr(buf)
            src = await a.region(64, seed=9)
            imm = fresh_imm()
            comp = await c.expect_imm_count(imm, 1, wait=False)
            holder: list[asyncio.Task[Any]] = []
            comp.add_done_callback(lambda _: holder[0].cancel())
            holder.append(asyncio.ensure_future(_await(comp)))
            await asyncio.sleep(0)
            with _client_warnings() as said:
                await (await a.client.submit_single_write(64, imm, (src.mr, 0),
                                                          (desc, 0))).wait(WAIT)
                (res,) = await asyncio.gather(holder[0], return_exceptions=True)
                assert isinstance(res, asyncio.CancelledError), res
                await asyncio.sleep(0.05)
                left = await c.imm_count(imm)
            assert bytes(await c.get_tensor(buf.tensor())) == bytes(src.data)
            assert left == 1 or any("cancelled" in m for m in said), (left, said)
    finally:
        await asyncio.wait_for(c.close(), 10)


@async_test(timeout=60)
async def test_a_duplicate_write_id_in_the_same_receive_is_dropped(
        tcp_cluster: Cluster) -> None:
    """A write with a write id, then the same write id again with other bytes, then a
    plain write, in one send: the second is acknowledged and dropped (its payload, in
    the frame-start read, is not copied to the pages), the count taken once."""
    cl = tcp_cluster
    async with nodes(cl.b) as (b,):
        addr_b = await b.client.main_address()
        dst = await b.region(REGION)
        rkey, ptr = dst.desc.rkeys[0][1], dst.desc.ptr
        imm = fresh_imm()
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
