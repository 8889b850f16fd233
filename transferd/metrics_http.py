"""The /metrics endpoint: a small HTTP server on a thread of its own, bounded.

prometheus_client's own server starts a thread per connection and reads without
a timeout: 300 connections that send nothing held 300 threads forever, and a
slow reader held its thread in ``sendall``.  This one serves every connection
from one asyncio loop, on a daemon thread (a hung event loop of the daemon still
shows in its scrapes' absence, not here):

- at most ``max_connections`` at once; when a new one comes at the cap, the oldest
  connection that has not sent a whole request yet is closed to make room (so
  silent connections cannot lock a scrape out), else the new one is closed;
- a request is at most 8 KiB of headers; one request per connection (the answer
  says ``Connection: close``);
- every connection is aborted ``timeout_s`` after it was accepted, whether it is
  still sending its request or not reading its answer;
- pages are made one at a time, and after a page that took ``c`` seconds of this
  thread's CPU the next is not begun before ``c * (1 / DUTY - 1)`` has passed: the
  collectors read the engine under the GIL, so a flood of scrapes from anyone who
  reaches the port would otherwise take the daemon's loop half its CPU (measured:
  8 scrapers, 5,000 pages in 5 s, the daemon at 96 %, another client's round trip
  0.16 -> 0.27 ms p50, 17 ms at worst). A request waits for its turn within its
  connection's ``timeout_s``; a scrape every few seconds never waits.

A connection holds at most its request (8 KiB) and one answer (the page, tens of
KiB): the endpoint's memory is bounded by ``max_connections`` times that.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import gzip
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

MAX_REQUEST = 8192
# The most of this thread's time that making pages may take, over any stretch of scrapes.
DUTY = 0.1
# What may not appear inside a line of a request head (tab may: it separates words).
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f]")


class _Stage(enum.Enum):
    READING = "reading"  # its request head is not whole yet
    QUEUED = "queued"  # a page is asked for and waits for its turn (MetricsServer.render)
    ANSWERED = "answered"


class _Conn(asyncio.Protocol):
    def __init__(self, server: MetricsServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.stage = _Stage.READING
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t = self.transport = cast(asyncio.Transport, transport)
        if not self.server.admit(self):
            t.abort()
            return
        self.timer = asyncio.get_running_loop().call_later(self.server.timeout_s, t.abort)

    def data_received(self, data: bytes) -> None:
        if self.stage is not _Stage.READING or self.transport is None:
            return
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_REQUEST:
                self._answer(431, b"request headers too large\n")
            return
        if end > MAX_REQUEST:
            self._answer(431, b"request headers too large\n")
            return
        self._serve(bytes(self.buf[:end]))

    def _serve(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        # Lines are split at CRLF only: a bare CR or LF (or another control byte) left
        # inside a line would reach the answer's headers, where prometheus_client echoes
        # an Accept header's OpenMetrics version into Content-Type (a header line of the
        # requester's choosing: response splitting). HTTP forbids them; refuse whole.
        if any(_CONTROL.search(line) for line in lines):
            self._answer(400, b"bad request: a control byte in the request head\n")
            return
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self._answer(400, b"bad request\n")
            return
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            self._answer(405, b"only GET\n")
            return
        try:
            url = urlsplit(target)
        except ValueError:  # an unclosed IPv6 bracket: the requester's, not a bug here
            self._answer(400, b"bad request: the request target is not a URL\n")
            return
        if url.path not in ("/metrics", "/"):
            self._answer(404, b"see /metrics\n")
            return
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        try:
            encoder, ctype = choose_encoder(headers.get("accept", ""))
        except (TypeError, ValueError):  # e.g. ``version=abc``: its parser compares it
            self._answer(400, b"bad request: the Accept header cannot be parsed\n")
            return
        names = parse_qs(url.query).get("name[]")
        gzipped = "gzip" in headers.get("accept-encoding", "")

        def page() -> None:
            try:
                registry: Any = self.server.registry
                if names:
                    registry = registry.restricted_registry(names)
                body = encoder(registry)
            except Exception as exc:  # a collector's bug must not kill the endpoint
                self._answer(500, f"error: {type(exc).__name__}: {exc}\n".encode())
                return
            extra = []
            if gzipped:
                body = gzip.compress(body)
                extra.append("Content-Encoding: gzip")
            self._answer(200, body, ctype, extra, head_only=method == "HEAD")

        self.stage = _Stage.QUEUED
        self.buf = bytearray()
        self.server.answering(self)
        self.server.render(self, page)

    def _answer(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8",
                extra: list[str] | None = None, head_only: bool = False) -> None:
        t = self.transport
        if t is None:
            return
        self.stage = _Stage.ANSWERED
        self.buf = bytearray()
        self.server.answering(self)
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                  431: "Request Header Fields Too Large", 500: "Internal Server Error"}[status]
        head = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {ctype}",
                f"Content-Length: {len(body)}", "Connection: close", *(extra or [])]
        t.write(("\r\n".join(head) + "\r\n\r\n").encode() + (b"" if head_only else body))
        t.close()  # once written; the timer aborts a reader that does not read

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.server.gone(self)


class MetricsServer:
    """Serves ``registry`` at http://host:port/metrics (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 timeout_s: float = 10.0, max_connections: int = 64) -> None:
        self.registry = registry
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        # Connections still sending their request, oldest first; and all of them.
        self._waiting: collections.OrderedDict[_Conn, None] = collections.OrderedDict()
        self._open: set[_Conn] = set()
        # Pages asked for, in order (at most one per open connection), and when the next
        # may be begun (time.monotonic()); the timer that begins it.
        self._pages: collections.deque[tuple[_Conn, Callable[[], None]]] = collections.deque()
        self._next = 0.0
        self._turn: asyncio.TimerHandle | None = None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # Bound here, in the caller's thread: a port taken is the caller's error.
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(128)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)
        self._thread.start()
        self._started.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def serve() -> None:
            await self._loop.create_server(lambda: _Conn(self), sock=self._sock)
            self._started.set()

        self._loop.run_until_complete(serve())
        self._loop.run_forever()

    # -- the caps (on the server's loop) -------------------------------------------------

    def admit(self, conn: _Conn) -> bool:
        if len(self._open) >= self.max_connections:
            if not self._waiting:
                return False
            oldest, _ = self._waiting.popitem(last=False)
            if oldest.transport is not None:
                oldest.transport.abort()
            self._open.discard(oldest)
        self._open.add(conn)
        self._waiting[conn] = None
        return True

    def answering(self, conn: _Conn) -> None:
        self._waiting.pop(conn, None)

    def render(self, conn: _Conn, page: Callable[[], None]) -> None:
        """Make ``conn``'s page in its turn (the module docstring: DUTY)."""
        self._pages.append((conn, page))
        if self._turn is None:
            self._turn = self._loop.call_at(self._at(self._next), self._page)

    def _at(self, monotonic: float) -> float:
        return self._loop.time() + max(0.0, monotonic - time.monotonic())

    def _page(self) -> None:
        self._turn = None
        while self._pages:
            conn, page = self._pages.popleft()
            if conn in self._open:  # else gone (timed out, hung up) while it waited
                began = time.thread_time()
                page()
                cost = time.thread_time() - began
                self._next = time.monotonic() + cost * (1 / DUTY - 1)
                break
        if self._pages:
            self._turn = self._loop.call_at(self._at(self._next), self._page)

    def gone(self, conn: _Conn) -> None:
        self._waiting.pop(conn, None)
        self._open.discard(conn)

    @property
    def connections(self) -> int:
        return len(self._open)

    def close(self) -> None:
        def stop() -> None:
            for c in list(self._open):
                if c.transport is not None:
                    c.transport.abort()
            self._loop.stop()

        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(stop)
        self._thread.join(5)
