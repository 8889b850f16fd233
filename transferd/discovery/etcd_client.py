"""A small etcd v3 client over etcd's JSON gateway (``POST /v3/...``, etcd 3.4 and later).

Why the gateway and not gRPC (aetcd, etcd3): the gateway is part of every etcd
server since 3.3 (``/v3`` since 3.4), speaks JSON over HTTP/1.1, and with h11
(sans-IO, pure Python, no compiled code) it needs no grpcio/protobuf wheels in
the daemon; the few calls the directory makes (lease grant/keepalive/revoke,
txn, range, watch, authenticate) are one POST each.  docs/discovery.md says more.

Keys and values travel base64-encoded, 64-bit numbers as strings (proto3 JSON);
fields equal to their default are left out of replies.  Unary calls share a
few kept-alive connections (:data:`POOL`), each watch has its own.  With a
user, the token from ``/v3/auth/authenticate`` goes in ``Authorization``; an
expired token (401) is renewed once per call.  A call that cannot reach one
endpoint tries the next.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
from collections.abc import AsyncIterator, Sequence
from typing import Any

from .http import HttpConnection, StoreError, TooLarge, Unavailable, check_status

# Unary connections kept per client: the keepalive never queues behind a write.
POOL = 3


def b64(raw: bytes | str) -> str:
    return base64.b64encode(raw.encode() if isinstance(raw, str) else raw).decode()


def unb64(text: Any) -> bytes:
    if text is not None and not isinstance(text, str):
        raise ValueError(f"not base64 text: {type(text).__name__}")
    return base64.b64decode(text or "")


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes a range of every key starting with ``prefix``."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"


class EtcdClient:
    def __init__(self, endpoints: Sequence[tuple[str, int]], *,
                 ssl_context: ssl.SSLContext | None = None, user: str = "",
                 password: str = "", timeout: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = list(endpoints)
        self.ssl = ssl_context
        self.user = user
        self.password = password
        self.timeout = timeout
        self._at = 0
        self._token: str | None = None
        self._idle: list[HttpConnection] = []
        self._slots = asyncio.Semaphore(POOL)
        self._auth_lock = asyncio.Lock()

    @property
    def where(self) -> str:
        host, port = self.endpoints[self._at]
        return f"{host}:{port}"

    def _new(self) -> HttpConnection:
        host, port = self.endpoints[self._at]
        return HttpConnection(host, port, self.ssl, self.timeout)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": self._token} if self._token else {}

    async def call(self, path: str, payload: dict[str, Any], *,
                   max_response: int | None = None) -> Any:
        """POST to one endpoint after another until one answers; its JSON reply
        (:class:`~.http.TooLarge` when over ``max_response`` bytes)."""
        async with self._slots:
            conn = self._idle.pop() if self._idle else self._new()
            try:
                out = await self._call(conn, path, payload, max_response)
            except BaseException:
                conn.close()
                raise
            if conn.open:
                self._idle.append(conn)
            else:
                conn.close()
            return out

    async def _call(self, conn: HttpConnection, path: str, payload: dict[str, Any],
                    max_response: int | None) -> Any:
        last: Unavailable | None = None
        for _ in range(len(self.endpoints)):
            try:
                await self._ensure_token(conn)
                status, body = await conn.request(path, payload, self._headers(),
                                                  max_response)
                if status == 401 and self.user:  # the token expired: a new one, once
                    self._token = None
                    await self._ensure_token(conn)
                    status, body = await conn.request(path, payload, self._headers(),
                                                      max_response)
                return check_status(status, body)
            except TooLarge:
                raise  # the store answered: too much, and another member would too
            except Unavailable as exc:
                last = exc
                conn.close()
                self._at = (self._at + 1) % len(self.endpoints)
                host, port = self.endpoints[self._at]
                conn.host, conn.port = host, port
        assert last is not None
        raise last

    async def _ensure_token(self, conn: HttpConnection) -> None:
        if not self.user or self._token is not None:
            return
        async with self._auth_lock:
            if self._token is not None:
                return
            status, body = await conn.request(
                "/v3/auth/authenticate", {"name": self.user, "password": self.password})
            body = check_status(status, body)
            token = body.get("token") if isinstance(body, dict) else None
            if not token:
                raise StoreError(status, "authenticate: no token in the reply")
            self._token = str(token)

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    # -- the calls the directory makes ---------------------------------------------------

    async def grant(self, ttl: int) -> int:
        r = await self.call("/v3/lease/grant", {"TTL": ttl})
        if r.get("error"):
            raise StoreError(200, str(r["error"]))
        return int(r["ID"])

    async def keepalive(self, lease: int) -> int:
        """The lease's ttl left after a keepalive: 0 when it is gone."""
        r = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        res = r.get("result", r) if isinstance(r, dict) else {}
        if "error" in r:
            return 0
        return int(res.get("TTL", 0) or 0)

    async def revoke(self, lease: int) -> None:
        with contextlib.suppress(StoreError):  # gone already
            await self.call("/v3/lease/revoke", {"ID": str(lease)})

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> Any:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        return await self.call("/v3/kv/put", body)

    async def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
                  failure: list[dict[str, Any]] | None = None) -> Any:
        return await self.call("/v3/kv/txn", {"compare": compare, "success": success,
                                             "failure": failure or []})

    async def range(self, key: bytes, range_end: bytes | None = None, *, limit: int = 0,
                    revision: int = 0, keys_only: bool = False,
                    max_response: int | None = None) -> Any:
        body: dict[str, Any] = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        if limit:
            body["limit"] = str(limit)
        if revision:
            body["revision"] = str(revision)
        if keys_only:
            body["keys_only"] = True
        return await self.call("/v3/kv/range", body, max_response=max_response)

    async def status(self) -> Any:
        return await self.call("/v3/maintenance/status", {})

    async def watch(self, key: bytes, range_end: bytes, start_revision: int
                    ) -> AsyncIterator[Any]:
        """Every watch response (``result``) from ``start_revision`` on, on its own connection."""
        conn = self._new()
        try:
            await self._ensure_token(conn)
            body = {"create_request": {"key": b64(key), "range_end": b64(range_end),
                                       "start_revision": str(start_revision)}}
            async for obj in conn.stream("/v3/watch", body, self._headers()):
                if not isinstance(obj, dict):
                    raise Unavailable(f"{conn.where}/v3/watch: a reply that is not an object")
                if "error" in obj:
                    err = obj["error"]
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    raise Unavailable(f"{conn.where}/v3/watch: {msg}")
                yield obj.get("result") or {}
        finally:
            conn.close()


def kv_value(kv: dict[str, Any]) -> bytes:
    return unb64(kv.get("value"))


def kv_key(kv: dict[str, Any]) -> bytes:
    return unb64(kv.get("key"))


def first_kvs(txn_reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The kvs of a txn's first response, where that response is a range."""
    for r in txn_reply.get("responses") or ():
        rr = r.get("response_range")
        if rr is not None:
            return list(rr.get("kvs") or ())
    return []

