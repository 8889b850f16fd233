"""The peer link's limits, at exactly the limit and one past it, from a hand-made peer.

At the limit (4096 pages in a WRITE, either page-table form, or in a READ; a 4096-byte
extension block; a message of MAX_MESSAGE bytes; engine.max_counters immediates) the
frame works, byte-exact.  One past it is refused: a message or an immediate with a
typed ACK, the link going on; a page table or an extension block past its cap with the
link cut (a receiver never buffers a table it cannot take, so the framing is gone).
That cut was silent: the peer saw its connection reset, and the daemon logged nothing
at any level, so an operator had no word of a peer whose frames it refuses.  Now each
cut of a proved link for what its peer sent is a WARNING naming the peer and the limit
(``peer link cut: node N rail 0 (host:port): BAD_FRAME: peer WRITE of 4097 pages: at
most 4096 go in a frame``).  Every other link is served throughout.
"""

from __future__ import annotations

import hashlib
import socket
import struct
from collections.abc import Iterator

import pytest

from client import SyncClient
from tests.helpers import DaemonProcess, pattern, wait_until
from tests.integration.engine_cluster import SECRET, engine_env, secret_file
from tests.integration.fake_peer import FakePeer, raw_write
from tests.integration.test_attacks_read_checksum import exact
from transferd.parts import MAX_MESSAGE
from transferd.protocol.peer_wire import (
    MAX_EXT,
    MAX_PAGES,
    READ_DATA,
    READ_DATA_HEAD,
    encode_read,
    encode_send,
    encode_write,
)
from transferd.protocol.values import MrDesc

PAGE, STRIDE = 16, 32
COUNTERS = 4


def sha(b: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(b).hexdigest()


def skippable(n: int) -> bytes:
    """An extension block of ``n`` bytes of entries a receiver may skip (kind 0x80+)."""
    out = b""
    while n:
        size = min(n, 257) if n != 258 else 200  # (an entry is 2 bytes and up to 255)
        out += bytes((0x80, size - 2)) + bytes(size - 2)
        n -= size
    return out


class Target:
    def __init__(self, d: DaemonProcess, c: SyncClient) -> None:
        self.d, self.c = d, c
        self.buf = c.alloc_buffer(1 << 20)
        _, desc = c.reg_mr(self.buf, "rw")
        self.desc: MrDesc = desc
        (self.addr, self.rkey), = desc.rkeys
        self.ptr = desc.ptr

    def peer(self) -> FakePeer:
        p = FakePeer(self.addr, 0, SECRET)
        p.handshake()
        return p

    def image(self, off: int, n: int) -> bytes:
        return bytes(self.c.get_tensor(self.buf.tensor(off, n)))

    def served(self) -> None:
        """Another link's write lands, byte-exact: the daemon serves on."""
        data = pattern(4096, seed=3)
        with self.peer() as p:
            ack = p.write(self.rkey, [self.ptr + 900_000], [len(data)], data)
        assert not ack.is_error, ack.body
        assert self.image(900_000, len(data)) == data

    def cut(self, frame: bytes, why: str) -> None:
        """``frame`` ends its link, the daemon says why, nothing of it lands."""
        before = sha(self.image(0, 1 << 20))
        with self.peer() as p:
            p.conn.send_raw(frame)
            with pytest.raises((ConnectionError, socket.timeout)):
                p.recv()
        assert wait_until(lambda: why in self.d.stderr, 5), self.d.stderr
        assert sha(self.image(0, 1 << 20)) == before
        self.served()


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    env = engine_env(["127.0.0.1"], "tcp", secret_file=secret_file(),
                     max_counters=COUNTERS)
    with DaemonProcess(env=env) as d, SyncClient(d.url, timeout=10) as c:
        yield Target(d, c)
        assert "Traceback" not in d.stderr, d.output()


def _pages(t: Target, n: int, base: int = 0) -> list[int]:
    return [t.ptr + base + STRIDE * i for i in range(n)]


def test_page_tables_at_the_cap_work_and_past_it_are_cut_and_said(target: Target) -> None:
    t = target
    data = pattern(PAGE * MAX_PAGES, seed=1)
    want = bytearray(STRIDE * MAX_PAGES)
    for i in range(MAX_PAGES):
        want[STRIDE * i:STRIDE * i + PAGE] = data[PAGE * i:PAGE * (i + 1)]
    with t.peer() as p:  # one length given once (UNIFORM)
        p.conn.send_raw(encode_write(1, 0, t.rkey, _pages(t, MAX_PAGES), [PAGE] * MAX_PAGES,
                                     None) + data)
        ack = p.recv()
        assert not ack.is_error, ack.body
    assert sha(t.image(0, len(want))) == sha(want)
    # Each page's length given (a table of 16-byte entries): the first page 2 bytes
    # longer, so that the uniform form cannot be taken.
    lens = [PAGE + 2] + [PAGE] * (MAX_PAGES - 1)
    odd = pattern(sum(lens), seed=2)
    with t.peer() as p:
        p.conn.send_raw(raw_write({"op": 2, "part": 0, "rkey": t.rkey, "lens": lens,
                                   "addrs": _pages(t, MAX_PAGES, 1 << 19)}, odd))
        ack = p.recv()
        assert not ack.is_error, ack.body
    got = t.image(1 << 19, STRIDE * MAX_PAGES)
    assert got[:PAGE + 2] == odd[:PAGE + 2]
    assert got[STRIDE * 7:STRIDE * 7 + PAGE] == odd[PAGE + 2 + PAGE * 6:PAGE + 2 + PAGE * 7]
    # A READ of 4096 pages: the pages' bytes, in order.
    with t.peer() as p:
        p.conn.send_raw(encode_read(3, 0, t.rkey, _pages(t, MAX_PAGES), [PAGE] * MAX_PAGES))
        cmd, status, _, _, op, n = READ_DATA_HEAD.unpack(exact(p.conn.sock,
                                                               READ_DATA_HEAD.size))
        assert (cmd, status, op, n) == (READ_DATA, 0, 3, len(data))
        assert sha(exact(p.conn.sock, n)) == sha(data)
    over = MAX_PAGES + 1
    t.cut(encode_write(4, 0, t.rkey, _pages(t, over), [PAGE] * over, None)
          + bytes(PAGE * over), f"BAD_FRAME: peer WRITE of {over} pages: at most {MAX_PAGES}")
    t.cut(raw_write({"op": 5, "part": 0, "rkey": t.rkey, "addrs": _pages(t, over),
                     "lens": [PAGE + 1] + [PAGE] * MAX_PAGES}, bytes(PAGE * over + 1)),
          f"peer WRITE of {over} pages")
    t.cut(encode_read(6, 0, t.rkey, _pages(t, over), [PAGE] * over),
          f"BAD_FRAME: peer READ of {over} pages: at most {MAX_PAGES}")
    assert "peer link cut: node " in t.d.stderr


def test_an_extension_block_at_the_cap_is_read_and_past_it_is_cut(target: Target) -> None:
    t = target
    assert len(skippable(MAX_EXT)) == MAX_EXT and len(skippable(MAX_EXT + 1)) == MAX_EXT + 1
    data = pattern(64, seed=4)
    with t.peer() as p:
        p.conn.send_raw(encode_write(1, 0, t.rkey, [t.ptr + 4096], [64], None,
                                     ext=skippable(MAX_EXT)) + data)
        ack = p.recv()
        assert not ack.is_error, ack.body
    assert t.image(4096, 64) == data
    t.cut(encode_write(2, 0, t.rkey, [t.ptr + 8192], [64], None, ext=skippable(MAX_EXT + 1))
          + data, f"a {MAX_EXT + 1}-byte extension block (at most {MAX_EXT})")


def test_a_message_at_the_cap_arrives_and_one_byte_more_is_refused_typed(
        target: Target) -> None:
    t = target
    got: list[bytes] = []
    t.c.submit_recvs(MAX_MESSAGE, 2, got.append)
    msg = pattern(MAX_MESSAGE, seed=5)
    with t.peer() as p:
        p.conn.send_raw(encode_send(1, 0, MAX_MESSAGE) + msg)
        ack = p.recv()
        assert not ack.is_error, ack.body
        p.conn.send_raw(encode_send(2, 0, MAX_MESSAGE + 1) + bytes(MAX_MESSAGE + 1))
        ack = p.recv()
        assert ack.is_error and ack.body["code"] == "BAD_REQUEST", ack.body
        assert f"message of {MAX_MESSAGE + 1} bytes is over the limit of {MAX_MESSAGE}" \
            in ack.body["message"]
        # The link goes on: its framing held.
        p.conn.send_raw(encode_send(3, 0, 5) + b"after")
        assert not p.recv().is_error
    assert wait_until(lambda: len(got) == 2, 5), [len(m) for m in got]
    assert sha(got[0]) == sha(msg) and got[1] == b"after"
    t.served()


def test_immediates_up_to_max_counters_count_and_one_more_is_refused(target: Target
                                                                     ) -> None:
    t = target
    with t.peer() as p:
        for k in range(COUNTERS + 1):
            ack = p.write(t.rkey, [t.ptr + 12288], [4], struct.pack("<I", k), op=k + 1,
                          imm=7000 + k)
            if k < COUNTERS:
                assert not ack.is_error, ack.body
            else:
                assert ack.is_error and ack.body["code"] == "OUT_OF_MEMORY", ack.body
                assert f"engine.max_counters = {COUNTERS}" in ack.body["message"]
    assert [t.c.imm_count(7000 + k) for k in range(COUNTERS + 1)] == [1] * COUNTERS + [0]
    # (the refused write placed nothing: the last word is the last counted one's)
    assert t.image(12288, 4) == struct.pack("<I", COUNTERS - 1)
    t.served()
