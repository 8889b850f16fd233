"""The asyncio client: ``Client.connect(url)`` and the methods of DESIGN.md's API."""

from __future__ import annotations

import asyncio
import functools
import os
import ssl
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transferd import __version__, transports
from transferd.copies import COUNTING, count
from transferd.protocol import auth as auth_methods
from transferd.protocol.constants import (
    DEFAULT_MAX_BODY,
    PROTO_MINOR,
    Command,
)
from transferd.protocol.errors import BadRequest, TransferdError
from transferd.protocol.frames import Frame
from transferd.protocol.messages import Tensor

from .buffers import RemoteBuffer
from .connection import Connection
from .copies import CopiesMixin, release_sent
from .cuda_ipc import IpcMixin
from .engine import EngineEvents, EngineMixin
from .leases import LeaseMixin
from .queue import QueuedGet, QueuedSet, chunks, segments
from .shared import SharedBuffer, map_shared
from .watchers import WatcherMixin


def _resolve_gets(gets: list[QueuedGet], fut: asyncio.Future[Frame]) -> None:
    """Settle queued reads from their GET_TENSOR(S) reply future."""
    if fut.cancelled():
        for g in gets:
            if not g.future.done():
                g.future.cancel()
    elif (exc := fut.exception()) is not None:
        for g in gets:
            if not g.future.done():
                g.future.set_exception(exc)
    else:
        payload = fut.result().payload
        if payload is not None:  # gathered whole (see _lazy_sink): cut it up
            if len(gets) == 1:
                gets[0].result = payload
            else:
                pos = 0
                for g in gets:
                    end = pos + g.tensor[2]
                    # Called twice per reply (its done callback, then the flush
                    # itself): a read already settled is not cut out again.
                    if not g.future.done():
                        g.result = payload[pos:end]
                        if COUNTING:
                            count("client.batch_cut", end - pos)
                    pos = end
        for g in gets:
            f = g.future
            if not f.done():
                # No result yet: a zero-byte read, whose sink was never asked for.
                r = g.result
                f.set_result(r if r is not None else bytearray())


# A small reply for reads without ``out=`` is received whole and cut into the
# reads' results: cheaper than scattering it over one small buffer per read.
GATHER_SMALL = 64 * 1024


def _lazy_sink(gets: list[QueuedGet]) -> Callable[[Frame], list[memoryview] | None]:
    """Where a GET reply's payload goes, decided when the reply arrives.

    Reads without ``out=`` get their bytearray only then, after the server has
    checked every tensor: a read the server refuses allocates nothing.
    """

    def sink(frame: Frame) -> list[memoryview] | None:
        if frame.payload_len <= GATHER_SMALL and all(g.out is None for g in gets):
            return None  # the decoder gathers the payload; _resolve_gets cuts it
        views: list[memoryview] = []
        append = views.append
        for g in gets:
            out = g.out
            if out is None:
                g.result = r = bytearray(g.tensor[2])
                g.out = out = memoryview(r)
            append(out)
        return views

    return sink


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Switches:
    """The A/B switches of PROTOCOL.md, read once at connect time."""

    batched_get: bool = True
    batched_set: bool = True
    async_copy: bool = True
    stats_ms: int = 0

    @classmethod
    def from_env(cls) -> Switches:
        stats_ms = 0
        if _env_flag("TRANSFERD_STATS"):
            stats_ms = int(os.environ.get("TRANSFERD_STATS_MS", "5000") or 5000)
        return cls(
            batched_get=not _env_flag("TRANSFERD_NO_BATCHED_GET"),
            batched_set=not _env_flag("TRANSFERD_NO_BATCHED_SET"),
            async_copy=not _env_flag("TRANSFERD_NO_ASYNC_COPY"),
            stats_ms=stats_ms,
        )


def _as_view(data: Any) -> memoryview:
    return memoryview(data).cast("B")


def _tensor(t: Tensor | Sequence[int]) -> Tensor:
    return t if type(t) is Tensor else Tensor(*t)


# Module-level aliases for the per-request path: in Python 3.11 ``Command.X``
# goes through EnumType.__getattr__, ten times slower than a global.
_GET_TENSOR = Command.GET_TENSOR
_SET_TENSOR = Command.SET_TENSOR
_GET_TENSORS = Command.GET_TENSORS
_SET_TENSORS = Command.SET_TENSORS


class Client(EngineMixin, LeaseMixin, WatcherMixin, CopiesMixin, IpcMixin):
    """Async client.  ``async with await Client.connect(url) as c: ...``"""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float | None = None,
        connect_timeout: float = 10.0,
        name: str | None = None,
        max_minor: int = PROTO_MINOR,
        tls_ca: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        auth: str = "hmac-sha256",
    ) -> None:
        self.url = url
        # tls:// only: verify the server with this CA file (or a ready context).
        self.tls_ca = tls_ca
        self.ssl_context = ssl_context
        # How to prove the token when the server asks: "hmac-sha256" (always
        # offered) or "token" (sent in HELLO; only where the server offers it).
        self.auth = auth
        self.token = token
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.name = name or f"transferd-client/{__version__}"
        # Speak at most this minor (1 makes this an old client, for tests and A/B).
        self.max_minor = max_minor
        self.switches = Switches()
        self.version: tuple[int, int, int] = (0, 0, 0)
        self.server = ""
        self.features: list[str] = []
        self.max_body = DEFAULT_MAX_BODY
        self.max_payload = 1 << 34
        # Per-request caps the server announced (0: none announced).
        self.max_tensors = 0
        self.max_reply = 1 << 34
        self._conn: Connection | None = None
        self._queue: list[QueuedSet | QueuedGet] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reads_in_flight: set[asyncio.Future[Frame]] = set()
        self._stats_task: asyncio.Task[None] | None = None
        self._events = EngineEvents()
        # Shared buffers mapped here, by id: their tensors are read and
        # written in this process, not over the wire.
        self._shared: dict[int, SharedBuffer] = {}

    # -- lifecycle --------------------------------------------------------------

    @classmethod
    async def connect(cls, url: str, token: str | None = None, **kw: Any) -> Client:
        c = cls(url, token=token, **kw)
        await c.open()
        return c

    async def open(self) -> None:
        # Queued reads' futures belong to this loop (looked up once, not per read).
        self._loop = asyncio.get_running_loop()
        self.switches = Switches.from_env()
        opts = transports.TransportOptions(tls_ca=self.tls_ca or "", ssl_context=self.ssl_context)
        self._conn = await Connection.open(self.url, self.connect_timeout, opts)
        self._conn.on_event = self._on_event
        self._conn.on_lost = self._events.lost
        # The handshake is the sans-IO ClientConnection's: hmac-sha256 whenever
        # the server asks for authentication (the secret never crosses the
        # wire, and the server proves it knows it too); auth="token" sends it.
        b = await self._conn.handshake(
            name=self.name, max_minor=self.max_minor,
            secret=auth_methods.secret_from_text(self.token) if self.token else None,
            method=self.auth, timeout=self.connect_timeout,
        )
        self.version = (int(b["major"]), int(b["minor"]), int(b["patch"]))
        self.server = str(b.get("server", ""))
        self.features = list(b.get("features", []))
        self.max_body = int(b.get("max_body", DEFAULT_MAX_BODY))
        self.max_payload = int(b.get("max_payload", self.max_payload))
        self.max_tensors = int(b.get("max_tensors", 0))
        self.max_reply = int(b.get("max_reply", self.max_payload))
        self._conn.decoder.max_body = max(DEFAULT_MAX_BODY, self.max_body)
        if "max_message" in b:
            self._conn.set_max_message(int(b["max_message"]))
        if self.switches.stats_ms:
            self._stats_task = asyncio.ensure_future(self._print_stats(self.switches.stats_ms))

    async def close(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self._conn is not None:
            try:
                if self._conn.lost is None:
                    await self.flush()
            finally:
                await self._conn.close()
                self._close_copies()
                # The daemon frees this connection's shared buffers; our
                # mappings go too (arrays still over one keep it until they go).
                shared, self._shared = self._shared, {}
                for buf in shared.values():
                    buf.unmap()

    async def __aenter__(self) -> Client:
        if self._conn is None:
            await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def minor(self) -> int:
        """The minor this client speaks: the smaller of its own and the server's."""
        return min(self.max_minor, self.version[1])

    @property
    def conn(self) -> Connection:
        if self._conn is None:
            raise TransferdError("not connected: call open() or use Client.connect()")
        return self._conn

    def _call(
        self,
        cmd: Command,
        body: dict[str, Any] | None = None,
        payload: Sequence[Any] = (),
        sink: Any = None,
    ) -> Awaitable[Frame]:
        """A synchronous command: a flush point, then one round trip.

        With nothing queued this is the request's own future (no coroutine
        in between: one less frame to create and resume per round trip).
        """
        if self._queue or self.conn.failed:
            # A flush point: queued work goes first, and one-way failures
            # reported since the last one are raised here.
            return self._flush_then_call(cmd, body, payload, sink)
        return self.conn.request(cmd, body, payload, sink=sink, timeout=self.timeout)

    async def _flush_then_call(
        self, cmd: Command, body: dict[str, Any] | None, payload: Sequence[Any], sink: Any
    ) -> Frame:
        await self.flush()
        return await self.conn.request(cmd, body, payload, sink=sink, timeout=self.timeout)

    # -- devices and buffers --------------------------------------------------------

    async def get_devices(self) -> list[dict[str, Any]]:
        return list((await self._call(Command.GET_DEVICES)).body["devices"])

    async def alloc_buffer(self, size: int, device: str = "cpu", *, owner: str | None = None,
                           lease: str | None = None) -> RemoteBuffer:
        """A buffer on ``device``; ``"shm"`` (unix:// or seqpacket:// only) maps it here too.

        A shared buffer is a :class:`SharedBuffer`: ``.array`` and ``.view``
        are its memory in this process.  ``owner``: ``"daemon"`` (kept until
        freed), ``"connection"`` (freed when this client disconnects); ``lease``:
        the name of a lease that owns it; neither: the daemon's default
        (memory.default_owner; a shared buffer is the connection's).
        """
        body = {"device": device, "size": size, **self._owner_fields(owner, lease)}
        r = await self._call(Command.ALLOC_BUFFER, body)
        buffer_id, got = int(r.body["buffer"]), int(r.body["size"])
        nfds = r.body.get("fds", 0)
        if not nfds:
            return RemoteBuffer(buffer_id, got, device)
        take = getattr(self.conn, "take_fds", None)
        try:
            if not isinstance(nfds, int) or nfds < 0 or take is None:
                raise BadRequest(f"ALLOC_BUFFER reply announces {nfds!r} descriptors")
            buf = map_shared(buffer_id, got, device, r.body, take(nfds))
        except TransferdError:
            # Nothing mapped: the daemon's buffer is not ours to keep.
            await self._call(Command.FREE_BUFFER, {"buffer": buffer_id})
            raise
        self._shared[buffer_id] = buf
        return buf

    async def alloc_shared(self, size: int, device: str = "shm") -> SharedBuffer:
        """``alloc_buffer`` of shared memory, typed: BadRequest over TCP or TLS."""
        buf = await self.alloc_buffer(size, device)
        if not isinstance(buf, SharedBuffer):
            await self.free_buffer(buf)
            raise BadRequest(f"{device!r} buffers are not shared memory on this daemon")
        return buf

    async def free_buffer(self, buf: RemoteBuffer | int) -> None:
        buffer_id = buf if isinstance(buf, int) else buf.id
        await self._call(Command.FREE_BUFFER, {"buffer": buffer_id})
        shared = self._shared.pop(buffer_id, None)
        if shared is not None:
            shared.unmap()

    async def buffer_clear(self, buf: RemoteBuffer | int, value: int = 0) -> None:
        await self._call(Command.BUFFER_CLEAR, {"buffer": getattr(buf, "id", buf), "value": value})

    # -- tensors, synchronous ---------------------------------------------------------

    async def set_tensor(self, t: Tensor | Sequence[int], data: Any) -> None:
        t = _tensor(t)
        view = _as_view(data)
        if view.nbytes != t.size:
            raise BadRequest(f"{view.nbytes} bytes of data for a tensor of {t.size}")
        if self._shared and t.buffer in self._shared:
            if self._queue:
                await self.flush()  # a flush point, as over the wire
            self._shared[t.buffer].local(t.offset, t.size)[:] = view
            if COUNTING:
                count("client.shared_set", t.size)
            return
        # A Tensor is a tuple: msgpack writes it as the [buffer, offset, size] array.
        await self._call(_SET_TENSOR, {"tensor": t}, [view])

    async def get_tensor(self, t: Tensor | Sequence[int], out: Any = None) -> Any:
        if type(t) is not Tensor:
            t = _tensor(t)
        if self._shared and t.buffer in self._shared:
            if self._queue:
                await self.flush()
            return self._get_local(t, out)
        if out is None:
            # The reply's payload is allocated when it arrives, once the server
            # has checked the tensor: a bad request costs no client memory.
            reply = await self._call(_GET_TENSOR, {"tensor": t})
            return reply.payload if reply.payload is not None else bytearray()
        await self._call(_GET_TENSOR, {"tensor": t}, sink=[self._out_view(t, out)])
        return out

    async def copy_tensor(self, src: Tensor | Sequence[int], dst: Tensor | Sequence[int]) -> None:
        await self._call(
            Command.COPY_TENSOR, {"src": _tensor(src).to_wire(), "dst": _tensor(dst).to_wire()}
        )

    async def synchronize(self) -> None:
        await self._call(Command.SYNCHRONIZE)
        self._raise_failures()

    async def server_stats(self) -> dict[str, Any]:
        return dict((await self._call(Command.STATS)).body)

    def stats(self) -> dict[str, Any]:
        """Client-side counts per command sent, and bytes each way."""
        return self.conn.stats.snapshot()

    # -- the queue --------------------------------------------------------------------

    def set_tensor_async(self, t: Tensor | Sequence[int], data: Any, *, copy: bool = True) -> None:
        """Queue a write; sent at the next flush point.

        The tensor is held by value.  Data in a mutable buffer is copied now
        (``copy=False`` trusts the caller to leave it alone until the flush);
        immutable ``bytes`` are held as they are.
        """
        if type(t) is not Tensor:
            t = _tensor(t)
        if self._shared and t.buffer in self._shared:
            # Shared memory: written now, in this process (no queue, no wire).
            view = _as_view(data)
            if view.nbytes != t.size:
                raise BadRequest(f"{view.nbytes} bytes of data for a tensor of {t.size}")
            self._shared[t.buffer].local(t.offset, t.size)[:] = view
            if COUNTING:
                count("client.shared_set", t.size)
            return
        if type(data) is bytes:  # immutable, one byte per item: held as is
            if len(data) != t.size:
                raise BadRequest(f"{len(data)} bytes of data for a tensor of {t.size}")
            self._queue.append(QueuedSet(t, data))
            return
        view = _as_view(data)
        if view.nbytes != t.size:
            raise BadRequest(f"{view.nbytes} bytes of data for a tensor of {t.size}")
        if copy and not view.readonly:
            data = bytes(view)
            if COUNTING:
                count("client.queue_copy", t.size)
        self._queue.append(QueuedSet(t, data))

    def get_tensor_async(self, t: Tensor | Sequence[int], out: Any = None) -> asyncio.Future[Any]:
        """Queue a read; the future resolves at the next flush point.

        With ``out`` (any writable buffer of the tensor's size) the bytes are
        received straight into it and the future resolves to ``out``.
        """
        if type(t) is not Tensor:
            t = _tensor(t)
        fut: asyncio.Future[Any] = (self._loop or asyncio.get_running_loop()).create_future()
        if self._shared and t.buffer in self._shared:
            # Shared memory: read now, in this process (no queue, no wire).
            try:
                fut.set_result(self._get_local(t, out))
            except TransferdError as exc:
                fut.set_exception(exc)
            return fut
        dest = self._out_view(t, out) if out is not None else None
        self._queue.append(QueuedGet(t, fut, dest, out))
        return fut

    async def flush(self) -> None:
        """Send everything queued: one SET_TENSORS and one GET_TENSORS per segment."""
        copies = self._n_copies > 0
        if copies:  # async device copies queued: their bytes must be in staging first
            await self._await_copies()
            self._n_copies = 0
        ops, self._queue = self._queue, []
        if copies:
            try:
                await self._flush_ops(ops)
            finally:
                await release_sent(self, ops)
            return
        await self._flush_ops(ops)

    async def _flush_ops(self, ops: list[QueuedSet | QueuedGet]) -> None:
        conn = self.conn
        waits: list[tuple[list[QueuedGet], asyncio.Future[Frame]]] = []
        try:
            for seg in segments(ops):
                self._send_sets(seg.sets)
                waits += self._send_gets(seg.gets)
        except TransferdError as exc:
            for op in ops:
                if isinstance(op, QueuedGet) and not op.future.done():
                    op.future.set_exception(exc)
            raise
        # Reads another task's flush (or synchronous call) already sent may hold
        # futures queued before this flush: wait for those too.
        earlier = [f for f in self._reads_in_flight if not f.done()]
        for gets, fut in waits:
            # Resolved by callback, so a cancelled flush orphans no read.
            fut.add_done_callback(functools.partial(_resolve_gets, gets))
            self._reads_in_flight.add(fut)
            fut.add_done_callback(self._reads_in_flight.discard)
        first_error: BaseException | None = None
        for gets, fut in waits:
            try:
                await fut
            except TransferdError as exc:
                first_error = first_error or exc
            _resolve_gets(gets, fut)  # now, not when the callback gets its turn
        if earlier:
            await asyncio.wait(earlier)
        self._raise_failures()
        if first_error is not None:
            raise first_error
        await conn.drain()

    def _send_sets(self, sets: list[QueuedSet]) -> None:
        if not sets:
            return
        conn = self.conn
        if self.minor >= 2 and self.switches.batched_set:
            for part in chunks(sets, self.max_body, self.max_payload, self.max_tensors):
                # Tensors are tuples: msgpack writes each as its [buffer, offset, size].
                conn.send_oneway(
                    _SET_TENSORS, {"tensors": [s.tensor for s in part]}, [s.data for s in part]
                )
        else:
            for s in sets:
                conn.send_oneway(_SET_TENSOR, {"tensor": s.tensor}, [s.data])

    def _send_gets(
        self, gets: list[QueuedGet]
    ) -> list[tuple[list[QueuedGet], asyncio.Future[Frame]]]:
        if not gets:
            return []
        conn = self.conn
        waits: list[tuple[list[QueuedGet], asyncio.Future[Frame]]] = []
        if self.minor >= 2 and self.switches.batched_get:
            for part in chunks(gets, self.max_body, min(self.max_payload, self.max_reply),
                               self.max_tensors):
                fut = conn.request(
                    _GET_TENSORS,
                    {"tensors": [g.tensor for g in part]},
                    sink=_lazy_sink(part),
                    timeout=self.timeout,
                )
                waits.append((part, fut))
        else:
            for g in gets:
                fut = conn.request(
                    _GET_TENSOR, {"tensor": g.tensor}, sink=_lazy_sink([g]), timeout=self.timeout
                )
                waits.append(([g], fut))
        return waits

    # -- helpers ----------------------------------------------------------------------

    def _get_local(self, t: Tensor, out: Any) -> Any:
        """A shared buffer's tensor, copied out of this process's mapping."""
        src = self._shared[t.buffer].local(t.offset, t.size)
        if COUNTING:
            count("client.shared_get", t.size)
        if out is None:
            return bytearray(src)
        self._out_view(t, out)[:] = src
        return out

    @staticmethod
    def _out_view(t: Tensor, out: Any) -> memoryview:
        if out is None:
            return memoryview(bytearray(t.size))
        view = _as_view(out)
        if view.readonly:
            raise BadRequest("out= must be a writable buffer")
        if view.nbytes != t.size:
            raise BadRequest(f"out= holds {view.nbytes} bytes for a tensor of {t.size}")
        return view

    def _raise_failures(self) -> None:
        failed = self.conn.take_failures()
        if failed:
            first = failed[0]
            if len(failed) > 1:
                first.add_note(
                    f"and {len(failed) - 1} more one-way command(s) failed: "
                    + "; ".join(str(f) for f in failed[1:4])
                )
            raise first

    def _on_event(self, frame: Frame) -> bool:
        return self._events.on_event(frame)

    async def _print_stats(self, period_ms: int) -> None:
        while True:
            await asyncio.sleep(period_ms / 1000)
            if self._conn is not None:
                print(self._conn.stats.line(), file=sys.stderr, flush=True)
