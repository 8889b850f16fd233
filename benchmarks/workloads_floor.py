"""The workloads' floor: the same bytes and messages moved by plain sockets.

A :class:`FloorNode` is what a workload node would be with nothing but the kernel between
it and its peers: a buffer (anonymous memory, faulted in), a listening socket, and for each
peer it writes to one TCP connection per rail (:class:`Link`).  A message is a 24-byte
header and its bytes, sent with ``sendmsg`` from where they lie and received with
``recv_into`` / ``recvmsg_into`` straight into the destination:

- ``DATA``: ``length`` bytes to ``offset`` of the receiver's buffer (a single write, one
  destination of a scatter);
- ``PAGES``: ``count`` pages of ``page_len`` bytes, the destination page indices (u32
  each) after the header, then the pages (a paged write);
- ``BARRIER``: nothing but its tag (a barrier's zero-byte write).

The receiver counts each message under its tag once it is in place (:class:`Tally`, what
an ImmCounter does, one count per message) and answers an ``ACK`` of the same tag, which
the sender counts in its own Tally: the initiator's completion.  Each connection carries
one direction's data and the other's acks only, each written by one thread, so no lock
and no wait cycle: a reader thread per connection on both ends.  Every wait is bounded.
"""

from __future__ import annotations

import array
import socket
import struct
import threading
import time
from collections.abc import Sequence

from .engine_peers import Buffer, _recv_exact, _scatter

HDR = struct.Struct("<BxxxIQQ")  # kind, tag, offset / page_len, length / count
DATA, PAGES, BARRIER, ACK = 1, 2, 3, 4
MAX_PAGES = 1 << 20


class Tally:
    """Messages counted per tag, and when each was; ``wait`` consumes what it waited for."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._times: dict[int, list[int]] = {}

    def add(self, tag: int) -> None:
        t = time.monotonic_ns()
        with self._cond:
            self._times.setdefault(tag, []).append(t)
            self._cond.notify_all()

    def wait(self, tag: int, n: int, timeout: float = 30.0) -> int:
        """Until ``n`` messages of ``tag`` counted; the time of the n-th (monotonic ns)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._times.get(tag, ())) >= n, timeout):
                got = len(self._times.get(tag, ()))
                raise TimeoutError(f"tag {tag}: {got} of {n} messages in {timeout:g} s")
            times = self._times[tag]
            when = times[n - 1]
            del times[:n]
            return when


def _nodelay(s: socket.socket) -> socket.socket:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


class FloorNode:
    """A node's memory and its listening socket; peers' messages land here."""

    def __init__(self, size: int, host: str = "127.0.0.1") -> None:
        self.buf = Buffer(max(size, 4096), False)
        self.size = size
        self.landed = Tally()  # messages that landed here, by tag
        self.acked = Tally()  # acks of messages this node sent, by tag
        self.refused: list[str] = []  # why each connection closed on a bad message
        self.srv = socket.create_server((host, 0), backlog=256)
        self.port = int(self.srv.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(_nodelay(conn),), daemon=True).start()

    def _check(self, off: int, n: int) -> None:
        if off < 0 or n < 0 or off + n > self.size:
            raise ValueError(f"[{off}, {off + n}) is outside this node's {self.size} bytes")

    def _serve(self, conn: socket.socket) -> None:
        hdr = bytearray(HDR.size)
        with conn:
            while True:
                try:
                    _recv_exact(conn, memoryview(hdr))
                    self._land(conn, *HDR.unpack(hdr))
                except (ConnectionError, OSError):
                    return
                except ValueError as exc:  # a message this node cannot place: refused
                    self.refused.append(str(exc))
                    return

    def _land(self, conn: socket.socket, kind: int, tag: int, a: int, b: int) -> None:
        """One message's bytes into place (checked first), counted, acknowledged."""
        view = self.buf.view
        if kind == DATA:
            self._check(a, b)
            _recv_exact(conn, view[a:a + b])
        elif kind == PAGES:
            if b > MAX_PAGES:
                raise ValueError(f"{b} pages in one message (at most {MAX_PAGES})")
            idx = array.array("I", bytes(4 * b))
            _recv_exact(conn, memoryview(idx).cast("B"))
            for i in idx:
                self._check(i * a, a)
            _scatter(lambda views: conn.recvmsg_into(views)[0],
                     [view[i * a:(i + 1) * a] for i in idx])
        elif kind != BARRIER:
            raise ValueError(f"message kind {kind}")
        self.landed.add(tag)
        conn.sendall(HDR.pack(ACK, tag, 0, 0))

    def link(self, port: int, host: str = "127.0.0.1") -> Link:
        return Link(self, port, host)

    def close(self) -> None:
        self.srv.close()


class Link:
    """One connection to a peer's :class:`FloorNode`: this node's messages out, acks in."""

    def __init__(self, node: FloorNode, port: int, host: str = "127.0.0.1") -> None:
        self.node = node
        self.sock = _nodelay(socket.create_connection((host, port)))
        threading.Thread(target=self._acks, daemon=True).start()

    def _acks(self) -> None:
        hdr = bytearray(HDR.size)
        while True:
            try:
                _recv_exact(self.sock, memoryview(hdr))
            except (ConnectionError, OSError):
                return
            self.node.acked.add(HDR.unpack(hdr)[1])

    def _send(self, views: list[memoryview | bytes]) -> None:
        _scatter(self.sock.sendmsg, [memoryview(v) for v in views])

    def write(self, tag: int, offset: int, data: memoryview) -> None:
        self._send([HDR.pack(DATA, tag, offset, len(data)), data])

    def pages(self, tag: int, page_len: int, dst: Sequence[int],
              src: Sequence[memoryview]) -> None:
        idx = array.array("I", dst)
        self._send([HDR.pack(PAGES, tag, page_len, len(idx)), idx.tobytes(), *src])

    def barrier(self, tag: int) -> None:
        self._send([HDR.pack(BARRIER, tag, 0, 0)])

    def close(self) -> None:
        self.sock.close()
