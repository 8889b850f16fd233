"""HTTP/1.1 for etcd's JSON gateway: h11 (sans-IO) fed by asyncio streams.

One :class:`HttpConnection` is one TCP (or TLS) connection, kept alive for
request after request; :meth:`HttpConnection.request` reads a whole response
(bounded by ``max_response``), :meth:`HttpConnection.stream` yields a
streaming response's body as it comes (a watch: one JSON object a line, as
etcd's gateway writes them), also bounded per buffered object.  Any failure
(refused, reset, a timeout, a response h11 cannot read, JSON nested past
Python's recursion limit) closes the connection and raises :class:`Unavailable`
(:class:`TooLarge` for a response over its bound): the caller dials again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

import h11

# A unary response larger than this is refused (a range of the whole cluster's
# names is paged well under it).
MAX_RESPONSE = 16 << 20
_READ = 64 * 1024


class StoreError(Exception):
    """The store answered, with an error (HTTP status and its message)."""

    def __init__(self, status: int, message: str, code: int = 0) -> None:
        super().__init__(f"{message} (HTTP {status})")
        self.status = status
        self.message = message
        self.code = code


class Unavailable(Exception):
    """The store could not be reached or stopped answering."""


class TooLarge(Unavailable):
    """A response, or one streamed object, over its bound (read no further)."""


# What a response that cannot be read raises, besides the socket's own errors.
_MALFORMED = (h11.ProtocolError, ValueError, UnicodeDecodeError, RecursionError)


class HttpConnection:
    def __init__(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                 timeout: float = 2.0, max_response: int = MAX_RESPONSE) -> None:
        self.host = host
        self.port = port
        self.ssl = ssl_context
        self.timeout = timeout
        self.max_response = max_response
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._h11: h11.Connection | None = None

    @property
    def where(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.ssl else 'http'}://{host}:{self.port}"

    @property
    def open(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def connect(self) -> None:
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self.ssl,
                                        server_hostname=self.host if self.ssl else None),
                self.timeout)
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            self.close()
            raise Unavailable(f"{self.where}: {_why(exc)}") from None
        self._h11 = h11.Connection(our_role=h11.CLIENT)

    def close(self) -> None:
        w, self._writer = self._writer, None
        self._reader = None
        self._h11 = None
        if w is not None:
            with contextlib.suppress(Exception):
                w.close()

    async def request(self, path: str, payload: dict[str, Any],
                      headers: dict[str, str] | None = None,
                      max_response: int | None = None) -> tuple[int, Any]:
        """POST ``payload`` as JSON to ``path``; the status and the decoded JSON reply.

        A reply over ``max_response`` bytes (default: the connection's bound)
        raises :class:`TooLarge` once that many came, read no further."""
        limit = self.max_response if max_response is None else max_response
        try:
            return await asyncio.wait_for(self._request(path, payload, headers, limit),
                                          self.timeout)
        except TimeoutError:
            self.close()
            raise Unavailable(f"{self.where}{path}: no answer within {self.timeout:g} s") \
                from None
        except TooLarge as exc:
            self.close()  # the rest is unread: the connection cannot be reused
            raise TooLarge(f"{self.where}{path}: {exc}") from None
        except (OSError, ssl.SSLError, *_MALFORMED) as exc:
            self.close()
            raise Unavailable(f"{self.where}{path}: {_why(exc)}") from None

    async def _request(self, path: str, payload: dict[str, Any],
                       headers: dict[str, str] | None, limit: int) -> tuple[int, Any]:
        if not self.open:
            await self.connect()
        status = await self._send(path, payload, headers)
        body = bytearray()
        while True:
            ev = await self._next()
            if isinstance(ev, h11.Data):
                body += ev.data
                if len(body) > limit:
                    raise TooLarge(f"a response over {limit} bytes")
            elif isinstance(ev, h11.EndOfMessage):
                break
        conn = self._h11
        assert conn is not None
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()  # kept alive for the next request
        else:
            self.close()
        # An error may come as plain text (etcd's own refusals): its words are the message.
        return status, _loads(bytes(body))

    async def stream(self, path: str, payload: dict[str, Any],
                     headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        """POST, then yield each JSON object of the streamed reply as it arrives.

        etcd's gateway ends each object with a newline.  Each byte is looked at
        once (a newline is searched for only in what came since the last look; a
        line is parsed once, when whole), so a peer that dribbles a never-ending
        object costs its bytes, bounded by ``max_response``, not a parse per
        read.  The status line must come within the timeout; after it the stream
        may be idle for as long as it likes (the caller's liveness check ends
        it).  An error status raises :class:`StoreError`; the stream's end raises
        :class:`Unavailable` (a watch never ends by itself).
        """
        try:
            if not self.open:
                await self.connect()
            status = await asyncio.wait_for(self._send(path, payload, headers), self.timeout)
            buf = bytearray()
            scanned = 0  # buf[:scanned] holds no newline
            while True:
                ev = await self._next()
                if isinstance(ev, h11.EndOfMessage):
                    if status != 200:
                        _raise_status(status, _loads(bytes(buf)))
                    raise Unavailable(f"{self.where}{path}: the stream ended")
                if not isinstance(ev, h11.Data):
                    continue
                buf += ev.data
                if status != 200:
                    if len(buf) > self.max_response:
                        raise TooLarge("an error response too large")
                    continue
                while True:
                    nl = buf.find(b"\n", scanned)
                    if nl < 0:
                        scanned = len(buf)
                        if scanned > self.max_response:
                            raise TooLarge(f"a streamed object over {self.max_response} "
                                           "bytes")
                        break
                    line = bytes(buf[:nl])
                    del buf[:nl + 1]
                    scanned = 0
                    if line.strip():
                        yield json.loads(line)
        except TimeoutError:
            self.close()
            raise Unavailable(f"{self.where}{path}: no answer within {self.timeout:g} s") \
                from None
        except TooLarge as exc:
            self.close()
            raise TooLarge(f"{self.where}{path}: {exc}") from None
        except (OSError, ssl.SSLError, *_MALFORMED) as exc:
            self.close()
            raise Unavailable(f"{self.where}{path}: {_why(exc)}") from None
        finally:
            # A stream is not reused: its request never ends on our side.
            self.close()

    async def _send(self, path: str, payload: dict[str, Any],
                    headers: dict[str, str] | None) -> int:
        conn, w = self._h11, self._writer
        assert conn is not None and w is not None
        body = json.dumps(payload).encode()
        hs = [("Host", f"{self.host}:{self.port}"), ("Content-Type", "application/json"),
              ("Content-Length", str(len(body)))]
        hs += list((headers or {}).items())
        w.write(conn.send(h11.Request(method="POST", target=path, headers=hs)) or b"")
        w.write(conn.send(h11.Data(data=body)) or b"")
        w.write(conn.send(h11.EndOfMessage()) or b"")
        await w.drain()
        while True:
            ev = await self._next()
            if isinstance(ev, h11.Response):
                return int(ev.status_code)
            # InformationalResponse (100 Continue): wait for the real one.

    async def _next(self) -> Any:
        conn, r = self._h11, self._reader
        assert conn is not None and r is not None
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                data = await r.read(_READ)
                conn.receive_data(data)  # b"" is the peer's close: h11 then says so
                continue
            if isinstance(ev, h11.ConnectionClosed) or ev is h11.PAUSED:
                raise OSError("the connection closed")
            return ev


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        return {"message": raw[:200].decode(errors="replace")}


def _raise_status(status: int, body: Any) -> None:
    if not isinstance(body, dict):
        raise StoreError(status, str(body)[:200])
    msg = body.get("message") or body.get("error") or "error"
    code = body.get("code", 0)
    raise StoreError(status, str(msg), code if isinstance(code, int) else 0)


def check_status(status: int, body: Any) -> Any:
    """The body of a 200 reply; else the store's error as a :class:`StoreError`."""
    if status != 200:
        _raise_status(status, body)
    return body


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
