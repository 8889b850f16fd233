"""The asyncio client: ``Client.connect(url)`` and the methods of DESIGN.md's API.

``Client`` holds the connection and the queue of reads and writes (its flush
points); the rest is done by parts it holds, each taking the Client as the
small interface of client/calls.py: ``engine`` (regions, writes, peer
groups, messages, counts), ``copies`` (async device copies), ``cuda_ipc``,
``leases`` and ``watchers``.  The methods of the API that belong to a part
hand the call to it.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from transferd import __version__, transports
from transferd.copies import COUNTING, count
from transferd.discovery.records import Peer, Value
from transferd.protocol import auth as auth_methods
from transferd.protocol.constants import (
    DEFAULT_MAX_BODY,
    PROTO_MINOR,
    Command,
)
from transferd.protocol.errors import BadFrame, BadRequest, TransferdError
from transferd.protocol.frames import Frame
from transferd.protocol.messages import Tensor, as_tensor

from .buffers import RemoteBuffer
from .calls import Closed, weak_method
from .connection import Connection
from .copies import Copies
from .cuda_ipc import CudaIpc
from .engine import (
    Completion,
    EngineEvents,
    EngineOps,
    MessageHandler,
    MrHandle,
    PeerGroup,
    TracedMessageHandler,
)
from .leases import Lease, Leases, owner_fields
from .names import NameInfo, Names, Published, Watch
from .queue import (
    Columns,
    PackedTensors,
    QueuedGet,
    QueuedSet,
    Reads,
    TensorQueue,
    columns,
    overlaps_any,
    ranges,
    segments,
)
from .reads import ReadOps
from .replies import out_view, reply_field, reply_uint
from .shared import SharedBuffer, map_shared, read_local
from .switches import Switches
from .watchers import Change, UvmWatcher, Watchers

if TYPE_CHECKING:
    from transferd.memory.staging import StagingPool
    from transferd.protocol.values import MrDesc, NetAddr, Pages, ScatterDst

__all__ = ["Client", "RemoteBuffer", "Switches"]


def _as_view(data: Any) -> memoryview:
    return memoryview(data).cast("B")


# Module-level aliases for the per-request path: in Python 3.11 ``Command.X``
# goes through EnumType.__getattr__, ten times slower than a global.
_GET_TENSOR = Command.GET_TENSOR
_SET_TENSOR = Command.SET_TENSOR
_GET_TENSORS = Command.GET_TENSORS
# The most futures a client makes ahead for queued reads (Client._spare).
SPARE_FUTURES = 256
_SET_TENSORS = Command.SET_TENSORS


def _collect(size: int) -> Callable[[Frame], None]:
    """The sink of a read collected whole: its reply must carry ``size`` bytes (the
    size the client asked for, never one only the server vouches for)."""
    def sink(frame: Frame) -> None:
        if frame.payload_len != size:
            raise BadFrame(f"payload of {frame.payload_len} bytes where {size} were expected",
                           seq=frame.seq)
    return sink


def client_class(url: str) -> type[Client]:
    """The class that serves ``url``: :class:`Client`, or for ``inproc://`` the engine in
    this process (imported only then: ``import client`` loads no daemon module)."""
    if url.split(":", 1)[0].lower() == "inproc":
        from .inproc import InprocClient

        return InprocClient
    return Client


class Client:
    """Async client.  ``async with await Client.connect(url) as c: ...``"""

    # Whether the engine runs in this process (client/inproc.py), not behind a connection.
    in_process = False

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
        # The queue of async reads and writes: as columns (client/queue.py), or, while
        # an async device copy is in it, as ops (_op_queue; client/copies.py).
        self._flat = TensorQueue()
        # The last SET_TENSORS and GET_TENSORS bodies, packed (a step repeats them).
        self._packed_set = PackedTensors()
        self._packed_get = PackedTensors()
        self._queue: list[QueuedSet | QueuedGet] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # Futures made ahead for the next queued reads, while a flush waits for its
        # reply (the client's idle time): as many as that flush's reads, at most
        # SPARE_FUTURES.  A queued read takes one instead of making it (0.2 us a row).
        self._spare: list[asyncio.Future[Any]] = []
        self._reads_in_flight: set[asyncio.Future[Frame]] = set()
        self._stats_task: asyncio.Task[None] | None = None
        self._events = EngineEvents()
        # Shared buffers mapped here, by id: their tensors are read and
        # written in this process, not over the wire.
        self._shared: dict[int, SharedBuffer] = {}
        # The parts: each takes this Client as the interface of client/calls.py.
        self.engine = EngineOps(self, self._events)
        self.read_ops = ReadOps(self.engine)
        self.copies = Copies(self)
        self.cuda_ipc = CudaIpc(self)
        self.leases = Leases(self, self.alloc_buffer)
        self.watchers = Watchers(self, self._events)
        # The names part (client/names.py), once connected.
        self._names: Names | None = None

    # -- lifecycle --------------------------------------------------------------

    @classmethod
    async def connect(cls, url: str, token: str | None = None, **kw: Any) -> Client:
        """A connected client; ``inproc://`` starts the engine in this process instead
        (client/inproc.py: the same API, no daemon)."""
        c = client_class(url)(url, token=token, **kw)
        await c.open()
        return c

    async def open(self) -> None:
        # Queued reads' futures belong to this loop (looked up once, not per read).
        self._loop = asyncio.get_running_loop()
        self._spare = []  # (futures of this loop only)
        self.switches = Switches.from_env()
        opts = transports.TransportOptions(tls_ca=self.tls_ca or "", ssl_context=self.ssl_context)
        self._conn = await Connection.open(self.url, self.connect_timeout, opts)
        self._conn.on_event = self._on_event
        self._conn.on_lost = self._lost
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
        self._names = Names(self._conn, flush=self.flush, timeout=self.timeout,
                            features=self.features if self.minor >= 2 else [])
        if self.switches.stats_ms:
            self._stats_task = asyncio.ensure_future(self._print_stats(self.switches.stats_ms))

    async def close(self, *, linger: float | None = None) -> None:
        """Flush, half-close, and wait up to ``linger`` seconds (None: 5) for the
        server to run what was sent and close its side, then close outright."""
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self._conn is not None:
            try:
                if self._conn.lost is None:
                    await self.flush()
            finally:
                await self._conn.close(*(() if linger is None else (linger,)))
                self.copies.close()
                # The daemon frees this connection's shared buffers; our
                # mappings go too (arrays still over one keep it until they go).
                shared, self._shared = self._shared, {}
                for buf in shared.values():
                    buf.unmap()
                self._detach_parts()

    def _detach_parts(self) -> None:
        """The parts hold this client weakly from now on (:class:`client.calls.Closed`):
        each held it, and it them, a reference cycle per client that only the cyclic
        collector frees (some 35 objects with everything they reach)."""
        held = Closed(self)
        c: Any = held
        self.engine._client = self.copies._client = self.cuda_ipc._client = c
        self.watchers._client = c
        self.leases.client = c
        self.leases.alloc = weak_method(held, "alloc_buffer")
        if self._names is not None:
            self._names._flush = weak_method(held, "flush")

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
        conn = self._conn if self._conn is not None else self.conn  # (raises: not connected)
        first = self._flat.segs[0]  # (anything queued is in the first segment)
        if first.set_t or first.get_t or self._queue or conn.failed:
            # A flush point: queued work goes first, and one-way failures
            # reported since the last one are raised here.
            return self._flush_then_call(cmd, body, payload, sink)
        return conn.request(cmd, body, payload, sink=sink, timeout=self.timeout)

    async def _flush_then_call(
        self, cmd: Command, body: dict[str, Any] | None, payload: Sequence[Any], sink: Any
    ) -> Frame:
        await self.flush()
        return await self.conn.request(cmd, body, payload, sink=sink, timeout=self.timeout)

    def _queued(self) -> bool:
        return bool(self._flat) or bool(self._queue)

    def _op_queue(self) -> list[QueuedSet | QueuedGet]:
        """The queue as ops, for an async device copy to join (what was queued as columns
        goes first, in its order)."""
        if self._flat:
            self._queue[:0] = self._flat.to_ops()
        return self._queue

    # -- devices and buffers --------------------------------------------------------

    async def get_devices(self) -> list[dict[str, Any]]:
        return list(reply_field(await self._call(Command.GET_DEVICES), "devices", list))

    async def alloc_buffer(self, size: int, device: str = "cpu", *, owner: str | None = None,
                           lease: str | None = None) -> RemoteBuffer:
        """A buffer on ``device``; ``"shm"`` (unix:// or seqpacket:// only) maps it here too.

        A shared buffer is a :class:`SharedBuffer`: ``.array`` and ``.view``
        are its memory in this process.  ``owner``: ``"daemon"`` (kept until
        freed), ``"connection"`` (freed when this client disconnects); ``lease``:
        the name of a lease that owns it; neither: the daemon's default
        (memory.default_owner; a shared buffer is the connection's).
        """
        body = {"device": device, "size": size, **owner_fields(owner, lease)}
        r = await self._call(Command.ALLOC_BUFFER, body)
        buffer_id, got = reply_uint(r, "buffer"), reply_uint(r, "size")
        nfds = r.body.get("fds", 0)
        if not nfds:
            return RemoteBuffer(buffer_id, got, device)
        try:
            if not isinstance(nfds, int) or nfds < 0 or not self.conn.carries_fds:
                raise BadRequest(f"ALLOC_BUFFER reply announces {nfds!r} descriptors")
            buf = map_shared(buffer_id, got, device, r.body, self.conn.take_fds(nfds))
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
        t = as_tensor(t)
        view = _as_view(data)
        if view.nbytes != t.size:
            raise BadRequest(f"{view.nbytes} bytes of data for a tensor of {t.size}")
        if self._shared and t.buffer in self._shared:
            if self._queued():
                await self.flush()  # a flush point, as over the wire
            self._shared[t.buffer].local(t.offset, t.size)[:] = view
            if COUNTING:
                count("client.shared_set", t.size)
            return
        # A Tensor is a tuple: msgpack writes it as the [buffer, offset, size] array.
        await self._call(_SET_TENSOR, {"tensor": t}, [view])

    async def get_tensor(self, t: Tensor | Sequence[int], out: Any = None) -> Any:
        if type(t) is not Tensor:
            t = as_tensor(t)
        if self._shared and t.buffer in self._shared:
            if self._queued():
                await self.flush()
            return read_local(self._shared[t.buffer], t, out)
        if out is None:
            # The reply's payload is allocated when it arrives, once the server
            # has checked the tensor: a bad request costs no client memory.
            reply = await self._call(_GET_TENSOR, {"tensor": t}, sink=_collect(t.size))
            if reply.payload is None and t.size:
                raise BadFrame(f"a reply of no payload to a read of {t.size} bytes")
            return reply.payload if reply.payload is not None else bytearray()
        await self._call(_GET_TENSOR, {"tensor": t}, sink=[out_view(t, out)])
        return out

    async def copy_tensor(self, src: Tensor | Sequence[int], dst: Tensor | Sequence[int]) -> None:
        await self._call(
            Command.COPY_TENSOR, {"src": as_tensor(src).to_wire(), "dst": as_tensor(dst).to_wire()}
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
            t = as_tensor(t)
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
        else:
            view = _as_view(data)
            if view.nbytes != t.size:
                raise BadRequest(f"{view.nbytes} bytes of data for a tensor of {t.size}")
            if copy and not view.readonly:
                data = bytes(view)
                if COUNTING:
                    count("client.queue_copy", t.size)
            else:
                data = view
        if self._queue:  # an async copy is queued: after it, in order
            self._queue.append(QueuedSet(t, data))
            return
        # TensorQueue.add_set, inlined (per row of a batched step).
        flat = self._flat
        cur = flat.cur
        if cur.get_t and overlaps_any(t, cur.get_t):
            flat.add_set(t, data)  # a write after a read of the same bytes: a new segment
            return
        cur.set_t.append(t)
        cur.set_d.append(data)

    def get_tensor_async(self, t: Tensor | Sequence[int], out: Any = None) -> asyncio.Future[Any]:
        """Queue a read; the future resolves at the next flush point.

        With ``out`` (any writable buffer of the tensor's size) the bytes are
        received straight into it and the future resolves to ``out``.
        """
        if type(t) is not Tensor:
            t = as_tensor(t)
        spare = self._spare
        fut: asyncio.Future[Any] = spare.pop() if spare else \
            (self._loop or asyncio.get_running_loop()).create_future()
        if self._shared and t.buffer in self._shared:
            # Shared memory: read now, in this process (no queue, no wire).
            try:
                fut.set_result(read_local(self._shared[t.buffer], t, out))
            except TransferdError as exc:
                fut.set_exception(exc)
            return fut
        if out is not None:
            dest = out_view(t, out)
            if self._queue:  # an async copy is queued: after it, in order
                self._queue.append(QueuedGet(t, fut, dest, out))
            else:
                self._flat.add_get(t, fut, dest, out)
            return fut
        if self._queue:
            self._queue.append(QueuedGet(t, fut))
            return fut
        # TensorQueue.add_get of a read without out=, inlined (per row of a batched step).
        flat = self._flat
        cur = flat.cur
        cur.get_t.append(t)
        cur.get_f.append(fut)
        return fut

    async def flush(self) -> None:
        """Send everything queued: one SET_TENSORS and one GET_TENSORS per segment."""
        copies = self.copies
        if copies.queued:  # async device copies queued: their bytes must be in staging first
            ops = await copies.take_queue()
            try:
                await self._flush_segments([columns(s) for s in segments(ops)])
            finally:
                await copies.release_sent(ops)
            return
        if self._queue:
            ops, self._queue = self._queue, []
            await self._flush_segments([columns(s) for s in segments(ops)])
            return
        await self._flush_segments(self._flat.take())

    def _send_now(self, ops: list[QueuedSet | QueuedGet]) -> None:
        """Send ``ops`` now; their reads resolve when their replies come (a later flush
        waits for them)."""
        for seg in segments(ops):
            for reads, fut in self._send_columns(columns(seg)):
                fut.add_done_callback(reads.settle)
                self._reads_in_flight.add(fut)
                fut.add_done_callback(self._reads_in_flight.discard)

    async def _flush_segments(self, segs: list[Columns]) -> None:
        conn = self.conn
        waits: list[tuple[Reads, asyncio.Future[Frame]]] = []
        try:
            for seg in segs:
                waits += self._send_columns(seg)
        except TransferdError as exc:
            for seg in segs:
                for f in seg.get_f:
                    if not f.done():
                        f.set_exception(exc)
            raise
        # Reads another task's flush (or synchronous call) already sent may hold
        # futures queued before this flush: wait for those too.
        earlier = [f for f in self._reads_in_flight if not f.done()] \
            if self._reads_in_flight else []
        for reads, fut in waits:
            # Settled by callback too, so a cancelled flush orphans no read.
            fut.add_done_callback(reads.settle)
            self._reads_in_flight.add(fut)
            fut.add_done_callback(self._reads_in_flight.discard)
        if waits and self._loop is not None:
            # The next step's futures, made while the daemon answers this one.
            want = min(sum([len(seg.get_f) for seg in segs]), SPARE_FUTURES) - len(self._spare)
            if want > 0:
                make = self._loop.create_future
                self._spare += [make() for _ in range(want)]
        first_error: BaseException | None = None
        for reads, fut in waits:
            try:
                await fut
            except TransferdError as exc:
                first_error = first_error or exc
            reads.settle(fut)  # now, not when the callback gets its turn
        if earlier:
            await asyncio.wait(earlier)
        self._raise_failures()
        if first_error is not None:
            raise first_error
        await conn.drain()

    def _send_columns(self, seg: Columns) -> list[tuple[Reads, asyncio.Future[Frame]]]:
        """A segment's writes (one-way), then its reads: one SET_TENSORS and one
        GET_TENSORS when they fit the server's limits, their columns sent as they are."""
        conn = self.conn
        batched = self.minor >= 2
        if seg.set_t:
            if batched and self.switches.batched_set:
                t, d = seg.set_t, seg.set_d
                for lo, hi in ranges(t, seg.set_bytes, self.max_body, self.max_payload,
                                     self.max_tensors):
                    whole = hi - lo == len(t)
                    # Tensors are tuples: msgpack writes each as its [buffer, offset, size].
                    conn.send_views(_SET_TENSORS,
                                    self._packed_set.body(t) if whole else {"tensors": t[lo:hi]},
                                    d if whole else d[lo:hi],
                                    seg.set_bytes if whole else None, oneway=True)
            else:
                for t1, d1 in zip(seg.set_t, seg.set_d, strict=True):
                    conn.send_views(_SET_TENSOR, {"tensor": t1}, (d1,), t1[2], oneway=True)
        if not seg.get_t:
            return []
        waits: list[tuple[Reads, asyncio.Future[Frame]]] = []
        if batched and self.switches.batched_get:
            t = seg.get_t
            for lo, hi in ranges(t, seg.get_bytes, self.max_body,
                                 min(self.max_payload, self.max_reply), self.max_tensors):
                whole = hi - lo == len(t)
                reads = Reads(seg, lo, hi, seg.get_bytes if whole else
                              sum([x[2] for x in t[lo:hi]]))
                fut = conn.request(_GET_TENSORS,
                                   self._packed_get.body(t) if whole else {"tensors": t[lo:hi]},
                                   sink=reads.sink, timeout=self.timeout)
                waits.append((reads, fut))
        else:
            for i, t1 in enumerate(seg.get_t):
                reads = Reads(seg, i, i + 1, t1[2])
                fut = conn.request(_GET_TENSOR, {"tensor": t1}, sink=reads.sink,
                                   timeout=self.timeout)
                waits.append((reads, fut))
        return waits

    # -- the engine (client/engine.py) -------------------------------------------------

    async def main_address(self) -> NetAddr:
        return await self.engine.main_address()

    async def reg_mr(self, buf: RemoteBuffer, access: str = "w") -> tuple[MrHandle, MrDesc]:
        """``access``: ``"w"`` (peers write, the default), ``"r"`` (peers read), ``"rw"``."""
        return await self.engine.reg_mr(buf, access)

    async def dereg_mr(self, mr: MrHandle) -> None:
        await self.engine.dereg_mr(mr)

    async def submit_single_write(
        self, length: int, imm: int | None, src: tuple[MrHandle, int],
        dst: tuple[MrDesc, int], *, timeout: float | None = None, wid: int | None = None,
        verify: bool | None = None, traceparent: str | None = None,
    ) -> Completion:
        """See :meth:`EngineOps.submit_single_write` (``wid``: a write id; ``verify``,
        ``traceparent``: docs/integrity.md)."""
        return await self.engine.submit_single_write(length, imm, src, dst, timeout=timeout,
                                                     wid=wid, verify=verify,
                                                     traceparent=traceparent)

    async def submit_paged_writes(
        self, page_len: int, imm: int | None, src: tuple[MrHandle, Pages],
        dst: tuple[MrDesc, Pages], *, timeout: float | None = None, wid: int | None = None,
        verify: bool | None = None, traceparent: str | None = None,
    ) -> Completion:
        return await self.engine.submit_paged_writes(page_len, imm, src, dst,
                                                     timeout=timeout, wid=wid, verify=verify,
                                                     traceparent=traceparent)

    # -- one-sided reads (client/reads.py) ----------------------------------------------

    async def submit_single_read(
        self, length: int, dst: tuple[MrHandle, int], src: tuple[MrDesc, int],
        *, timeout: float | None = None, verify: bool | None = None,
        traceparent: str | None = None,
    ) -> Completion:
        """``length`` bytes of the peer region ``src`` into your region ``dst``
        (``verify``, ``traceparent``: docs/integrity.md, as for a write)."""
        return await self.read_ops.submit_single_read(length, dst, src, timeout=timeout,
                                                      verify=verify, traceparent=traceparent)

    async def submit_paged_reads(
        self, page_len: int, dst: tuple[MrHandle, Pages], src: tuple[MrDesc, Pages],
        *, timeout: float | None = None, verify: bool | None = None,
        traceparent: str | None = None,
    ) -> Completion:
        return await self.read_ops.submit_paged_reads(page_len, dst, src, timeout=timeout,
                                                      verify=verify, traceparent=traceparent)

    async def submit_gather(
        self, dst: MrHandle, srcs: Sequence[tuple[int, int, MrDesc, int]],
        *, timeout: float | None = None, verify: bool | None = None,
        traceparent: str | None = None,
    ) -> Completion:
        return await self.read_ops.submit_gather(dst, srcs, timeout=timeout, verify=verify,
                                                 traceparent=traceparent)

    async def add_peer_group(self, addrs: Sequence[NetAddr]) -> PeerGroup:
        return await self.engine.add_peer_group(addrs)

    async def submit_scatter(
        self, group: PeerGroup | None, imm: int | None, src: MrHandle,
        dsts: Sequence[ScatterDst], *, timeout: float | None = None,
        verify: bool | None = None, traceparent: str | None = None,
    ) -> Completion:
        return await self.engine.submit_scatter(group, imm, src, dsts, timeout=timeout,
                                                verify=verify, traceparent=traceparent)

    async def submit_barrier(
        self, group: PeerGroup | None, imm: int, dsts: Sequence[MrDesc],
        *, timeout: float | None = None, traceparent: str | None = None,
    ) -> Completion:
        return await self.engine.submit_barrier(group, imm, dsts, timeout=timeout,
                                                traceparent=traceparent)

    async def submit_send(self, addr: NetAddr, msg: Any, *, timeout: float | None = None,
                          traceparent: str | None = None) -> Completion:
        return await self.engine.submit_send(addr, msg, timeout=timeout,
                                             traceparent=traceparent)

    def submit_recvs(self, length: int, count: int,
                     callback: MessageHandler | TracedMessageHandler, *,
                     traced: bool = False) -> None:
        self.engine.submit_recvs(length, count, callback, traced=traced)

    async def expect_imm_count(
        self, imm: int, count: int, callback: Callable[[], None] | None = None,
        *, wait: bool | None = None, timeout: float | None = None,
    ) -> Completion:
        """See :meth:`EngineOps.expect_imm_count`."""
        return await self.engine.expect_imm_count(imm, count, callback, wait=wait,
                                                  timeout=timeout)

    async def imm_count(self, imm: int) -> int:
        return await self.engine.imm_count(imm)

    # -- async device copies, CUDA IPC (client/copies.py, client/cuda_ipc.py) ------------

    def use_copy_staging(self, pool: StagingPool) -> None:
        """Use ``pool`` (pinned, bounded) for this client's async copies."""
        self.copies.use_staging(pool)

    async def copy_from_device(self, t: Tensor | tuple[int, int, int], src: Any, *,
                               stream: Any = None) -> None:
        """Device -> remote tensor ``t``: enqueued on ``stream``, sent once copied."""
        await self.copies.copy_from_device(t, src, stream=stream)

    async def copy_to_device(self, dst: Any, t: Tensor | tuple[int, int, int], *,
                             stream: Any = None) -> None:
        """Remote tensor ``t`` -> device: read into staging, async H2D on ``stream``."""
        await self.copies.copy_to_device(dst, t, stream=stream)

    async def register_cuda_memory(self, mem: Any, *, device: str | None = None
                                   ) -> RemoteBuffer:
        """Register this process's device memory (client/cuda_ipc.py)."""
        return await self.cuda_ipc.register_cuda_memory(mem, device=device)

    # -- leases and watchers (client/leases.py, client/watchers.py) -----------------------

    def lease(self, name: str, ttl: float, *, end: bool = True, join: bool = False) -> Lease:
        """An async context manager: makes lease ``name`` (``join=True``: or joins the one
        another connection made), renews it meanwhile, and ends it when the block ends
        (``end=False``: leaves it to run out)."""
        return self.leases.lease(name, ttl, end=end, join=join)

    async def renew_lease(self, name: str, ttl: float, *, join: bool = False) -> bool:
        """LEASE: make ``name`` (True) or renew it (False) for ``ttl`` seconds from now;
        one another connection made is refused (BadRequest) unless ``join``."""
        return await self.leases.renew_lease(name, ttl, join=join)

    async def end_lease(self, name: str, *, join: bool = False) -> int:
        """END_LEASE: free the lease's buffers now; how many there were (``join``: one
        this connection neither made nor joined)."""
        return await self.leases.end_lease(name, join=join)

    async def alloc_uvm_watcher(
        self, callback: Change, *, buffer: RemoteBuffer | int | None = None, offset: int = 0,
    ) -> UvmWatcher:
        """A word the daemon watches; ``callback(old, new)`` on every change it sees."""
        return await self.watchers.alloc_uvm_watcher(callback, buffer=buffer, offset=offset)

    async def arm_paged_writes(
        self, watcher: UvmWatcher | int, value: int, page_len: int, imm: int | None,
        src: tuple[MrHandle, Pages], dst: tuple[MrDesc, Pages], *,
        timeout: float | None = None, verify: bool | None = None,
        traceparent: str | None = None,
    ) -> Completion:
        """A paged write the daemon fires itself once ``watcher``'s word reaches
        ``value`` (see :meth:`Watchers.arm_paged_writes`)."""
        return await self.watchers.arm_paged_writes(
            watcher, value, page_len, imm, src, dst, timeout=timeout, verify=verify,
            traceparent=traceparent)

    # -- helpers ----------------------------------------------------------------------

    def _raise_failures(self) -> None:
        failed = self.conn.take_failures()
        dropped = self.conn.take_dropped()
        if failed:
            first = failed[0]
            if len(failed) + dropped > 1:
                first.add_note(
                    f"and {len(failed) - 1 + dropped} more one-way command(s) failed: "
                    + "; ".join(str(f) for f in failed[1:4])
                )
            raise first

    def _on_event(self, frame: Frame) -> bool:
        names = self._names
        if names is not None and names.on_event(frame):
            return True
        return self._events.on_event(frame)

    def _lost(self, exc: TransferdError) -> None:
        self._events.lost(exc)
        if self._names is not None:
            self._names.lost(exc)

    # -- names (the cluster's directory): delegated to the part in client/names.py ------

    @property
    def names_part(self) -> Names:
        if self._names is None:
            raise TransferdError("not connected: call open() or use Client.connect()")
        return self._names

    async def publish(self, name: str, value: Value, ttl: float | None = None, *,
                      owner: str | None = None, lease: str | None = None) -> Published:
        return await self.names_part.publish(name, value, ttl, owner=owner, lease=lease)

    async def lookup(self, name: str) -> Value:
        return await self.names_part.lookup(name)

    async def unpublish(self, name: str) -> bool:
        return await self.names_part.unpublish(name)

    def watch(self, prefix: str = "", *, initial: bool = True) -> Watch:
        return self.names_part.watch(prefix, initial=initial)

    async def peers(self) -> list[Peer]:
        return await self.names_part.peers()

    async def names(self, prefix: str = "", limit: int | None = None) -> list[NameInfo]:
        return await self.names_part.names(prefix, limit)

    async def discovery_status(self) -> dict[str, Any]:
        return await self.names_part.discovery_status()

    async def _print_stats(self, period_ms: int) -> None:
        while True:
            await asyncio.sleep(period_ms / 1000)
            if self._conn is not None:
                print(self._conn.stats.line(), file=sys.stderr, flush=True)
