"""Fuzz target: the peer plane's data phase (transferd/protocol/peer_link.py, peer_wire.py).

The first byte picks the end: 0 feeds the rest to an inbound link (a peer's WRITEs,
SENDs and READs, landing in or read from a region of 64 KiB), 1 to an outbound one (the
peer's ACKs and READ_DATA, for a SEND, a READ and a verified traced READ it made), each
through an authenticated handshake done in memory.  Whatever the bytes, the link ends
in ACKs or closed with BAD_FRAME (inbound) or PEER_UNREACHABLE (outbound), no exception
escapes, nothing is left admitted, and no count moves but by pages that landed."""

from __future__ import annotations

from fuzzing.driver import Data, instrumented, run

with instrumented():
    from transferd.protocol.errors import BadFrame, BadRequest, NotFound, OutOfBounds
    from transferd.protocol.peer_handshake import PeerIdentity
    from transferd.protocol.peer_landing import Landing
    from transferd.protocol.peer_link import LinkState
from transferd.protocol.peer_inbound import InboundLink
from transferd.protocol.peer_outbound import OutboundLink

SECRET = b"fuzzing secret"
ME = PeerIdentity(0xA, 0, (b"127.0.0.1:1",))
THEM = PeerIdentity(0xB, 0, (b"127.0.0.2:2",))
BASE, SIZE, RKEY = 0x100000, 1 << 16, 0x5EC12E7
TRACE = bytes(range(26))


class _Placement:
    deferred = False
    crc = None  # (the link takes a READ's checksum)

    def __init__(self, mem: _Memory, views: list[memoryview]) -> None:
        self.mem, self.views = mem, views
        mem.admitted += 1

    def land(self, done: object) -> None:
        raise AssertionError("host memory")

    def release(self) -> None:
        self.mem.admitted -= 1

    def abandon(self) -> None:
        self.release()


class _Memory:
    def __init__(self) -> None:
        self.data = bytearray(SIZE)
        self.admitted = 0
        self.counted = 0

    def place(self, rkey: int, rail: int, addrs: list[int], lens: list[int], n: int,
              abort: object) -> _Placement:
        if rkey != RKEY:
            raise NotFound("no such rkey")
        view = memoryview(self.data)
        views = []
        for a, ln in zip(addrs, lens, strict=True):
            if a < BASE or a - BASE + ln > SIZE:
                raise OutOfBounds("outside")
            views.append(view[a - BASE:a - BASE + ln])
        if sum(lens) != n:
            raise BadRequest("payload")
        return _Placement(self, views)

    def source(self, rkey: int, rail: int, addrs: list[int], lens: list[int],
               abort: object, checksum: bool = False, peer: object = None) -> _Placement:
        return self.place(rkey, rail, addrs, lens, sum(lens), abort)

    def count(self, imm: int, n: int) -> None:
        self.counted += n

    def room(self, imm: int) -> None:
        pass


def _pump(a: InboundLink | OutboundLink, b: InboundLink | OutboundLink) -> None:
    for _ in range(8):
        for src, dst in ((a, b), (b, a)):
            data = b"".join(bytes(v) for v in src.out.take())
            if data:
                _feed(dst, data)


def _feed(link: InboundLink | OutboundLink, data: bytes) -> None:
    mv = memoryview(data)
    while len(mv) and not link.closed:
        if isinstance(link, InboundLink) and not link.reading:
            return  # the link reads nothing more (ACKs unread): a socket holds the rest
        room = link.get_buffers()
        n = 0
        for b in room:
            k = min(len(b), len(mv) - n)
            b[:k] = mv[n:n + k]
            n += k
        link.received(n, 0.0)
        mv = mv[n:]


def _pair(mem: _Memory) -> tuple[OutboundLink, InboundLink]:
    out = OutboundLink(ME, 0, SECRET, 0.0, timeout=5.0, expect=(THEM.node, 0, THEM.addrs[0]))
    inb = InboundLink(THEM, 0, SECRET, 0.0, landing=Landing(mem), timeout=5.0,
                      max_message=4096)
    out.connected(0.0)
    _pump(out, inb)
    out.carrier_ready()
    inb.carrier_ready()
    assert out.state is LinkState.READY and inb.state is LinkState.READY
    out.events.clear()
    inb.events.clear()
    return out, inb


def test_one_input(raw: bytes) -> None:
    data = Data(raw)
    end = data.number() % 2
    mem = _Memory()
    out, inb = _pair(mem)
    rest = data.rest()
    if end == 0:
        _feed(inb, rest)
        if inb.closed:
            assert isinstance(inb.error, BadFrame), inb.error
        inb.close()
        assert mem.admitted == 0
        # Counts come from pages that landed: a frame of n pages adds at most n.
        assert mem.counted <= len(rest)
    else:
        into = bytearray(100)
        checked = bytearray(100)
        out.send("token", 1, 0, b"x")
        out.read("read", 2, 0, RKEY, [BASE], [100], [memoryview(into)])
        # A verified, traced read (issue 20): its answer's extension block, its checksum.
        out.read("vread", 3, 0, RKEY, [BASE], [100], [memoryview(checked)], True, TRACE)
        _feed(out, rest)
        if out.closed:
            assert out.error is not None and out.error.code.value == "PEER_UNREACHABLE"
        assert all(t in ("token", "read", "vread") for t, _ in out.completions)
        # Bytes land in the read's memory only as its answer, never past it.
        assert len(into) == 100 and len(checked) == 100


def main() -> None:
    run(test_one_input)


if __name__ == "__main__":
    main()
