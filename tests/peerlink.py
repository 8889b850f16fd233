"""In-memory pieces for tests of the sans-IO peer link: memory, wires, a shuffler.

No sockets and no event loop: an :class:`OutboundLink` and an :class:`InboundLink`
are wired by copying what one's ``out`` holds into the other's ``get_buffers``.
:class:`HostMemory` is the engine's side of landing (regions by rkey, bounds,
admission, the immediate counter) over bytearrays.  :class:`Shuffler` carries the
frames of several links (rails) between two daemons' worth of cores and loses,
repeats, delays and reorders them the way a network of failing rails does.
"""

from __future__ import annotations

import random
import secrets
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transferd.protocol.errors import (
    BadRequest,
    NotFound,
    OutOfBounds,
    PeerUnreachable,
    TransferdError,
)
from transferd.protocol.peer_handshake import PeerIdentity, Ready, node_of
from transferd.protocol.peer_inbound import InboundLink
from transferd.protocol.peer_landing import Landing
from transferd.protocol.peer_link import (
    Deliver,
    Land,
    LinkState,
    ProbeArrived,
)
from transferd.protocol.peer_outbound import OutboundLink
from transferd.protocol.peer_wire import frame_size

SECRET = b"in-memory peer link secret"
MAX_MESSAGE = 1 << 20


@dataclass
class HostRegion:
    ptr: int
    data: bytearray
    rkeys: tuple[int, ...]
    admitted: int = 0
    closed: bool = False
    access: str = "w"


class _Placement:
    crc = None  # (the link takes a READ's checksum)

    def __init__(self, region: HostRegion, views: list[memoryview],
                 deferred: bool = False) -> None:
        self.region = region
        self.views = views
        self.deferred = deferred
        self.released = False
        region.admitted += 1

    def land(self, done: Callable[[TransferdError | None], None]) -> None:
        done(None)  # a staging path whose copy completes at once

    def release(self) -> None:
        assert not self.released, "a placement released twice"
        self.released = True
        self.region.admitted -= 1

    def abandon(self) -> None:
        self.release()


class HostMemory:
    """Regions in bytearrays, checked the way the engine's are."""

    def __init__(self, rails: int = 2, deferred: bool = False) -> None:
        self.rails = rails
        self.deferred = deferred
        self.regions: dict[int, HostRegion] = {}
        self.counts: defaultdict[int, int] = defaultdict(int)
        self._next = 0x10000

    def region(self, size: int, access: str = "w") -> HostRegion:
        r = HostRegion(self._next, bytearray(size),
                       tuple(secrets.randbits(64) | 1 for _ in range(self.rails)),
                       access=access)
        self._next += size + 0x10000
        for k in r.rkeys:
            self.regions[k] = r
        return r

    def revoke(self, r: HostRegion) -> None:
        r.closed = True
        for k in r.rkeys:
            self.regions.pop(k, None)

    def place(self, rkey: int, rail: int, addrs: list[int], lens: list[int],
              payload_len: int, abort: Any) -> _Placement:
        r = self._open(rkey, rail, "w")
        views = self._views(r, addrs, lens)
        if sum(lens) != payload_len:
            raise BadRequest(f"pages hold {sum(lens)} bytes but the payload has {payload_len}")
        return _Placement(r, views, self.deferred)

    def source(self, rkey: int, rail: int, addrs: list[int], lens: list[int],
               abort: Any, checksum: bool = False, peer: Any = None) -> _Placement:
        r = self._open(rkey, rail, "r")
        return _Placement(r, self._views(r, addrs, lens))

    def _open(self, rkey: int, rail: int, right: str) -> HostRegion:
        r = self.regions.get(rkey)
        if r is None or r.rkeys[rail] != rkey or right not in r.access:
            raise NotFound("rkey does not name a registered region on this rail")
        return r

    def _views(self, r: HostRegion, addrs: list[int], lens: list[int]) -> list[memoryview]:
        view = memoryview(r.data)
        views = []
        for a, n in zip(addrs, lens, strict=True):
            off = a - r.ptr
            if off < 0 or off + n > len(r.data):
                raise OutOfBounds(f"[0x{a:x}, +{n}) is outside the region")
            views.append(view[off:off + n])
        return views

    def count(self, imm: int, n: int) -> None:
        self.counts[imm] += n

    def room(self, imm: int) -> None:
        pass


def identity(rails: int = 2, node: int | None = None) -> PeerIdentity:
    """A daemon's identity; its node id its addresses' (as without a secret) unless given."""
    n = secrets.randbits(16)
    addrs = tuple(f"10.{n >> 8}.{n & 0xFF}.{r}:1".encode() for r in range(rails))
    return PeerIdentity(node or node_of((addrs,)), 0, addrs)


def feed(link: InboundLink | OutboundLink, data: bytes | memoryview, now: float = 0.0,
         chunk: int = 1 << 30) -> int:
    """Deliver ``data`` to ``link`` as a socket would (at most ``chunk`` per receive);
    how many receives that took."""
    mv = memoryview(data)
    receives = 0
    while len(mv) and not link.closed:
        if isinstance(link, InboundLink) and not link.reading:
            raise AssertionError("fed while the link reads nothing")
        bufs = link.get_buffers()
        n = 0
        for b in bufs:
            k = min(len(b), len(mv) - n, chunk - n)
            b[:k] = mv[n:n + k]
            n += k
            if n == len(mv) or n == chunk:
                break
        assert n, "a link with no room to receive"
        link.received(n, now)
        mv = mv[n:]
        receives += 1
    return receives


def drain(link: InboundLink | OutboundLink, limit: int | None = None) -> bytes:
    """Take what ``link`` has to send (at most ``limit`` bytes), as its socket would."""
    out = bytearray()
    while link.out.queued and (limit is None or len(out) < limit):
        views = link.out.views()
        data = b"".join(bytes(v) for v in views)
        if limit is not None:
            data = data[:limit - len(out)]
        out += data
        link.sent(len(data))
    return bytes(out)


def frames(data: bytes) -> list[bytes]:
    """Data-phase bytes cut at frame boundaries."""
    out, pos = [], 0
    while pos < len(data):
        n = frame_size(memoryview(data)[pos:])
        assert n is not None and pos + n <= len(data), "a cut frame"
        out.append(data[pos:pos + n])
        pos += n
    return out


@dataclass
class Pair:
    """One link: our outbound end and the peer's inbound end, through the handshake."""

    out: OutboundLink
    inb: InboundLink
    delivered: list[Deliver] = field(default_factory=list)
    lands: list[Land] = field(default_factory=list)

    def pump(self, now: float = 0.0) -> None:
        """Move bytes both ways until neither end has more to say."""
        for _ in range(10_000):
            a = drain(self.out)
            if a:
                feed(self.inb, a, now)
            self._events()
            b = drain(self.inb)
            if b:
                feed(self.out, b, now)
            if not a and not b and not self.out.out.queued and not self.inb.out.queued:
                return
        raise AssertionError("the link never went quiet")

    def _events(self) -> None:
        for ev in self.inb.events:
            if isinstance(ev, Deliver):
                self.delivered.append(ev)
            elif isinstance(ev, Land):
                self.lands.append(ev)
        self.inb.events.clear()


def link_pair(landing: Landing, me: PeerIdentity, them: PeerIdentity, rail: int = 0,
              secret: bytes | None = SECRET, now: float = 0.0) -> Pair:
    """Our link to ``them`` on ``rail``, handshake done, both ends READY."""
    out = OutboundLink(me, rail, secret, now, timeout=5.0,
                       expect=(them.node, them.group, them.addrs[rail]))
    inb = InboundLink(them, rail, secret, now, landing=landing, timeout=5.0,
                      max_message=MAX_MESSAGE)
    out.connected(now)
    for _ in range(10):
        feed(inb, drain(out), now)
        for ev in inb.events:
            if isinstance(ev, ProbeArrived):
                raise AssertionError("a probe on a link with a secret")
        feed(out, drain(inb), now)
        if out.authenticated and inb.authenticated:
            break
    assert any(isinstance(e, Ready) for e in out.events), out.error
    assert any(isinstance(e, Ready) for e in inb.events), inb.error
    out.events.clear()
    inb.events.clear()
    out.carrier_ready()
    inb.carrier_ready()
    assert out.state is LinkState.READY and inb.state is LinkState.READY
    return Pair(out, inb)


@dataclass
class Write:
    """One part in the shuffler's care: sent on a rail, re-sent on another if lost."""

    op: int
    part: int
    addrs: list[int]
    lens: list[int]
    src: list[bytes]
    imm: int | None
    span: tuple[int, int] | None = None
    wid: int | None = None
    rkeys: Sequence[int] = ()
    rail: int = 0
    again: bool = False
    result: list[TransferdError | None] = field(default_factory=list)


class Shuffler:
    """Two daemons' cores, ``rails`` links between them, a network that misbehaves.

    Frames wait in a queue per link.  Each :meth:`step` delivers the head of a link
    picked at random (reordering across links), or leaves it (delay), or, with
    ``cut`` probability, cuts a link: what waits on it is lost and both ends close,
    so its parts fail PEER_UNREACHABLE and are re-sent on another rail, marked
    again, and the ACKs of frames that did land on it are lost with it (a repeat
    of a part that landed).  With ``repeat`` probability a frame already delivered
    is delivered again on its link as a fresh part (a peer's honest repeat of an
    unmarked frame).  Every write ends exactly once, with its first error or ok.
    """

    def __init__(self, rails: int = 2, seed: int = 0, *, cut: float = 0.02,
                 delay: float = 0.3, repeat: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.rails = rails
        self.cut, self.delay, self.repeat = cut, delay, repeat
        self.me, self.them = identity(rails), identity(rails)
        self.memory = HostMemory(rails)
        self.landing = Landing(self.memory, rails)
        self.links: list[Pair | None] = [None] * rails
        self.wire: list[deque[bytes]] = [deque() for _ in range(rails)]
        self.acks: list[deque[bytes]] = [deque() for _ in range(rails)]
        self.cuts = 0

    def link(self, rail: int) -> Pair:
        p = self.links[rail]
        if p is None or p.out.closed or p.inb.closed:
            p = self.links[rail] = link_pair(self.landing, self.me, self.them, rail)
            self.wire[rail].clear()
            self.acks[rail].clear()
        return p

    def post(self, w: Write) -> None:
        p = self.link(w.rail)
        p.out.write(w, w.op, w.part, w.rkeys[w.rail], w.addrs, w.lens,
                    [memoryview(s) for s in w.src], w.imm, w.span, w.wid, w.again)
        self.wire[w.rail].extend(frames(drain(p.out)))
        self._complete(p)

    def _complete(self, p: Pair) -> None:
        done, p.out.completions = p.out.completions, []
        for w, err in done:
            if type(err) is PeerUnreachable:
                others = [r for r in range(self.rails) if r != w.rail]
                w.rail = self.rng.choice(others) if others else w.rail
                w.again = True
                self.post(w)
            else:
                w.result.append(err)

    def step(self) -> bool:
        """One move of the network; False once nothing is left in flight."""
        busy = [r for r in range(self.rails) if self.wire[r] or self.acks[r]]
        if not busy:
            return False
        r = self.rng.choice(busy)
        p = self.links[r]
        assert p is not None
        if self.rng.random() < self.cut:
            self.cuts += 1
            self.wire[r].clear()
            self.acks[r].clear()
            p.inb.close(PeerUnreachable("cut"))
            p.out.close(PeerUnreachable("cut"))
            self._complete(p)
            return True
        if self.rng.random() < self.delay:
            return True
        if self.wire[r] and (not self.acks[r] or self.rng.random() < 0.5):
            frame = self.wire[r].popleft()
            feed(p.inb, frame)
            # A frame with a write id may come twice (a retry); one without is a new
            # write each time it comes, so only those are repeated.
            if self.repeat and frame[0] == 0x41 and frame[1] & 0x04 \
                    and self.rng.random() < self.repeat:
                self.wire[r].append(frame)
            self.acks[r].extend(frames(drain(p.inb)))
        else:
            feed(p.out, self.acks[r].popleft())
            self._complete(p)
        return True

    def run(self, limit: int = 1_000_000) -> None:
        for _ in range(limit):
            if not self.step():
                return
        raise AssertionError("the shuffler did not settle")


__all__ = ["SECRET", "HostMemory", "Pair", "Shuffler", "Write", "drain", "feed", "frames",
           "identity", "link_pair"]
