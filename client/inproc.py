"""The engine inside the caller's process: ``await Client.connect("inproc://")``.

An :class:`InprocClient` builds a transferd node in this process (transferd/node.py:
its buffers, its engine with its rails and peer plane, its immediates, its names)
on the caller's event loop (a :class:`~client.SyncClient`: on its own loop thread)
and calls the node's :class:`~transferd.service.Service`, the interface the RPC
server's handlers call for a daemon's clients.  So every check, charge, owner,
deadline and completion is the daemon's own; what differs is that nothing crosses
a socket between the caller and its engine: a write to a daemon is two hops (this
process -> the peer -> this process), not four.

The node reads the daemon's configuration (``config=PATH`` in the URL's query, or
the ``config`` keyword; the same ``TRANSFERD_*`` variables; ``overrides`` as the
daemon's flags, ``{"engine.host_rails": "10.0.0.5"}``) and its secrets: the cluster
secret of engine.secret_file, which it proves to every peer as a daemon does.  Peers
see it as a daemon: same handshake, same trust.

Memory may be the caller's own: :meth:`InprocClient.register_memory` takes a numpy
array, a ``bytearray``, an ``mmap``, or a CuPy array (a GPU of gpu.devices) and makes
it a buffer without copying it and without CUDA IPC.  What has no meaning without
a connection (a token, TLS, async device copies through the client's staging)
raises :class:`~transferd.protocol.errors.BadRequest` or UnknownCommand, never
silently nothing.  docs/inproc.md says when to choose this over a daemon.

This module is imported only by ``Client.connect("inproc://...")``: ``import
client`` loads no daemon module, and this one loads them when the node starts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qsl, urlsplit

from transferd import __version__
from transferd.copies import COUNTING, count
from transferd.discovery.records import Peer, Value, decode_value, encode_value
from transferd.protocol.constants import PROTO_MAJOR, PROTO_MINOR, PROTO_PATCH
from transferd.protocol.errors import (
    BadRequest,
    ConnectionLost,
    NotFound,
    TransferdError,
    UnknownCommand,
)
from transferd.protocol.messages import Tensor, as_tensor

from .buffers import RemoteBuffer
from .client import Client
from .engine import (
    Completion,
    MessageHandler,
    MrHandle,
    PeerGroup,
    TracedMessageHandler,
    abandoned_ended,
    if_reached,
)
from .leases import Leases
from .names import NameInfo, Published, Watch
from .shared import SharedBuffer
from .tracing import current_traceparent
from .watchers import UvmWatcher

if TYPE_CHECKING:
    from transferd.config import Config
    from transferd.discovery.directory import Subscription
    from transferd.memory.staging import StagingPool
    from transferd.node import Node
    from transferd.protocol.values import MrDesc, NetAddr, Pages, ScatterDst
    from transferd.service import Caller, Service

    from .watchers import Change as WordChange

__all__ = ["InprocClient", "is_inproc"]

SCHEME = "inproc"
# The query keys an inproc URL may carry, and the keyword each is.
QUERY_KEYS = ("config", "metrics_port", "metrics_host")
# Client keywords that name something of a connection, which an inproc client has not.
_CONNECTION_ONLY = ("tls_ca", "ssl_context", "auth", "max_minor")
_OK = {"ok": True}


def is_inproc(url: str) -> bool:
    return url.split(":", 1)[0].lower() == SCHEME


def _view(data: Any) -> memoryview:
    return memoryview(data).cast("B")


async def _done(w: Awaitable[Any] | None) -> Any:
    return None if w is None else await w


class _NoLine:
    """What the parts of a wire Client find as ``conn`` in process: no connection.

    ``lost`` is None while the node runs (a lease's exit ends it) and the error once
    it closed; anything that would send a frame is refused, typed, naming why."""

    def __init__(self) -> None:
        self.lost: TransferdError | None = None
        self.failed = False

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise UnknownCommand("an inproc client has no connection to send frames on: "
                             "call the client's methods, not its connection's")

    request = send = send_views = drain = _refuse


class InprocCompletion(Completion):
    """A Completion the node resolves in process; :meth:`cancel` ends it on the node."""

    def __init__(self, what: str, client: InprocClient, key: int) -> None:
        super().__init__(what)
        self._client = client
        self._key = key
        # Until the node ends it (end() is its on_end, called once): the client's close
        # ends what the node dropped with its caller.  Left in end(), not by a done
        # callback on the future: that would be one more loop callback per write.
        client._completions[key] = self

    def end(self, err: TransferdError | None, value: Any = _OK) -> None:
        self._client._completions.pop(self._key, None)
        if err is not None:
            self._resolve(error=err)
        elif not self._future.done():
            self._future.set_result(value)
        elif self._future.cancelled():
            abandoned_ended(self)

    def _abandoned(self) -> asyncio.Future[Any] | None:
        try:
            ended = self._client.service.cancel(self._client.caller, self._key)
        except TransferdError:
            return None  # it ended first (NotFound), or the client closed
        if isinstance(ended, Coroutine):  # (halted already: only its end is on its way)
            ended.close()
        return None  # (ended on the node, at once: no reply to wait for)

    def refused(self) -> None:
        """The node refused it (the call raises): never pending, so not in the table
        (its future is left as it is: a done callback must not see it cancelled)."""
        self._client._completions.pop(self._key, None)

    async def cancel(self) -> bool:
        if self.done():
            return False
        try:
            ended = self._client.service.cancel(self._client.caller, self._key)
        except NotFound:
            return False  # it ended first
        return ended if isinstance(ended, bool) else await ended


class InprocLeases(Leases):
    """The lease operations, on the node's table (the same one a daemon's clients use)."""

    client: InprocClient

    async def renew_lease(self, name: str, ttl: float, *, join: bool = False) -> bool:
        c = self.client
        _, created, _ = c.service.renew_lease(c.caller, name, _seconds(ttl, "a lease's ttl"),
                                              join=join)
        return created

    async def end_lease(self, name: str, *, join: bool = False) -> int:
        c = self.client
        await c.flush()
        n, drained = c.service.end_lease(c.caller, name, join=join)
        await _done(drained)
        return n


def _seconds(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
        raise BadRequest(f"{what} must be a positive number of seconds, not {v!r}")
    return float(v)


class LocalBuffer(RemoteBuffer):
    """A buffer of the node in this process.  ``view()``: its bytes, where they lie
    (host memory only); registered caller memory is the caller's own object."""

    def __init__(self, buffer_id: int, size: int, device: str, client: InprocClient) -> None:
        super().__init__(buffer_id, size, device)
        object.__setattr__(self, "_client", client)

    def view(self, offset: int = 0, size: int | None = None) -> memoryview:
        client: InprocClient = object.__getattribute__(self, "_client")
        t = self.tensor(offset, size)
        return client.service.buffers.get(self.id).view(t.offset, t.size)


class InprocShared(SharedBuffer):
    """A shared buffer of an inproc node: the same type as a daemon's client returns
    (``view``, ``array``, ``local``, ``unmap``), over the node's own pages, which are
    this process's memory already: nothing is mapped, so ``unmap`` has nothing to do."""

    def __init__(self, buffer_id: int, size: int, device: str, client: InprocClient) -> None:
        super().__init__(buffer_id, size, device)
        object.__setattr__(self, "_client", client)

    @property
    def view(self) -> memoryview:
        """The buffer's bytes, writable, in place (NotFound once it was freed)."""
        client: InprocClient = object.__getattribute__(self, "_client")
        return client.service.buffers.get(self.id).view(0, self.size)

    def unmap(self) -> None:
        """Nothing to let go of: the node's pages stay until the buffer is freed."""


class InprocWatch(Watch):
    """Changes of names under a prefix, from the node's directory: :class:`client.Watch`
    (its iteration, its one-change-per-name backlog), subscribed in process."""

    def __init__(self, client: InprocClient, prefix: str, initial: bool) -> None:
        super().__init__(cast(Any, None), prefix, initial)  # no wire Names in process
        self.client = client
        self._sub: Subscription | None = None

    async def start(self) -> InprocWatch:
        if self._started or self._closed:
            return self
        self._started = True
        self._wake = asyncio.Event()
        c = self.client
        self._sub, now = c.service.names.watch(c.caller, self.prefix, self._push,
                                               initial=self.initial)
        for change in now:
            self._pending.add(change, True)
        self.count = len(now)
        c._watches.add(self)
        if now:
            self._wake.set()
        return self

    def _end(self, error: TransferdError) -> None:
        if self._error is None:
            self._error = error
        if self._wake is not None:
            self._wake.set()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        if self._wake is not None:
            self._wake.set()
        sub, self._sub = self._sub, None
        if sub is not None and self.client._caller is not None \
                and not self.client._caller.closed:
            self.client.service.names.unwatch(sub)
        self.client._watches.discard(self)

    aclose = close

    async def __aenter__(self) -> InprocWatch:
        return await self.start()


class _Forward:
    """The node's series, collected into the caller's own Prometheus registry."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def collect(self) -> Any:
        return self._registry.collect()


class InprocClient(Client):
    """:class:`client.Client`'s API on a node in this process (see the module doc)."""

    in_process = True

    def __init__(self, url: str = "inproc://", *, token: str | None = None,
                 timeout: float | None = None, config: str | os.PathLike[str] | None = None,
                 overrides: Mapping[str, Any] | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 registry: Any = None, name: str | None = None,
                 connect_timeout: float = 10.0, **connection: Any) -> None:
        if not is_inproc(url):
            raise BadRequest(f"{url!r} is not an inproc:// URL")
        parts = urlsplit(url)
        if parts.netloc or parts.path not in ("", "/"):
            raise BadRequest(f"an inproc URL names no host or path ({url!r}): "
                             "inproc:// or inproc://?config=PATH")
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(query) - set(QUERY_KEYS))
        if unknown:
            raise BadRequest(f"unknown inproc URL key(s) {', '.join(unknown)} (known: "
                             f"{', '.join(QUERY_KEYS)})")
        if token is not None:
            raise BadRequest("an inproc client has no connection to authenticate: token= has "
                             "no meaning in process (peers are proved engine.secret_file)")
        given = sorted(k for k in connection if k in _CONNECTION_ONLY)
        if given:
            raise BadRequest(f"{', '.join(given)}: no meaning for an inproc client (it has no "
                             "connection)")
        if connection:
            raise BadRequest(f"unknown keyword(s) {', '.join(sorted(connection))}")
        super().__init__(url, timeout=timeout, connect_timeout=connect_timeout,
                         name=name or f"transferd-inproc/{__version__}")
        self.config_path: str | None = os.fspath(config) if config is not None \
            else query.get("config") or None
        self.overrides = dict(overrides or {})
        port = query.get("metrics_port")
        if port is not None:
            if not port.isdigit() or int(port) > 65535:
                raise BadRequest(f"metrics_port {port!r} is not a port (0: the system picks)")
            metrics_port = int(port)
        self.metrics_port = metrics_port
        self.metrics_host = query.get("metrics_host", metrics_host)
        self.registry = registry
        # Where its series are served (metrics_port), once started.
        self.metrics_url: str | None = None
        self.node: Node | None = None
        self._service: Service | None = None
        self._caller: Caller | None = None
        # Holds a share of the process's spans (tracing.acquire) while open.
        self._spans = False
        # Bound at open() (daemon modules load only then): what a submit admitted at once
        # returns (else an awaitable of it), and an open caller's state.
        self._op_type: type[Any] = type(None)
        self._open_state: Any = None
        self._line = _NoLine()
        self._keys = itertools.count(1)
        # Reads and writes queued (set_tensor_async, get_tensor_async), run at the flush.
        self._ops: collections.deque[Callable[[], Awaitable[None] | None]] = \
            collections.deque()
        self._watches: set[InprocWatch] = set()
        # Completions not ended yet, by key (bounded as the node's tables of them are:
        # engine.max_inflight_per_client submits, engine.max_expectations expectations).
        self._completions: dict[int, InprocCompletion] = {}
        self._counts: collections.Counter[str] = collections.Counter()
        self._bytes_out = self._bytes_in = 0
        self._forwarded: _Forward | None = None
        # While the node closes, and after: a close asked meanwhile (another task's)
        # returns once the node is closed, not at once.
        self._closing: asyncio.Future[None] | None = None
        self.leases = InprocLeases(self, self.alloc_buffer)

    # -- lifecycle ------------------------------------------------------------------------

    @classmethod
    async def connect(cls, url: str = "inproc://", token: str | None = None, **kw: Any
                      ) -> InprocClient:
        c = cls(url, token=token, **kw)
        await c.open()
        return c

    def load_config(self) -> Config:
        """The daemon's configuration: the file, TRANSFERD_* variables, the overrides."""
        from transferd import config as configuration
        from transferd import preflight

        cfg = configuration.load(self.config_path, overrides=self.overrides)
        # What serve refuses of it at its start (preflight) is refused here: a node in
        # process has no other start.
        unfit = preflight.limit_problems(cfg)
        if unfit:
            raise configuration.ConfigError([str(p) for p in unfit])
        return cfg

    async def open(self) -> None:
        if self.node is not None:
            return
        self._loop = asyncio.get_running_loop()
        from transferd.node import Node
        from transferd.service import Caller, CallerState, Op

        cfg = self.load_config()
        from transferd import tracing

        try:  # log.otel, as the daemon reads it: spans of this process's traced transfers
            tracing.acquire(cfg.log.otel, cfg.log.otel_file)
        except (tracing.TracingUnavailable, OSError) as exc:
            raise BadRequest(f"log.otel = {cfg.log.otel!r}: {exc}") from exc
        self._spans = True
        try:
            node = Node(cfg, name=self.name)
        except BaseException:
            self._release_spans()  # (a secret file others may read: refused here)
            raise
        try:
            try:
                await asyncio.wait_for(node.start_engine(), self.connect_timeout)
            except OSError as exc:  # a rail cannot listen: say which, as the daemon does
                e = cfg.engine
                raise BadRequest(
                    f"the engine's rails cannot listen (engine.host_rails "
                    f"{','.join(e.host_rails) or cfg.server.host}, engine.peer_port "
                    f"{e.peer_port}): {exc.strerror or exc}") from exc
            disc = node.make_discovery()
            service = node.start_service()
            addr = node.engine.main_address() if node.engine is not None else None
            urls = [f"inproc://{os.uname().nodename}/{os.getpid()}"]
            caps: dict[str, Any] = {"devices": sorted(node.buffers.devices), "inproc": True}
            if node.engine is not None:
                caps.update(domain=cfg.engine.domain, host_groups=cfg.engine.host_groups,
                            authenticated=node.engine.secret is not None)
            await disc.start(urls=urls, server=self.name, minor=cfg.server.protocol_minor,
                             features=["names"], addr=addr, capabilities=caps)
            if self.metrics_port is not None:
                try:
                    port = node.metrics.serve(self.metrics_host, self.metrics_port)
                except OSError as exc:
                    raise BadRequest(
                        f"metrics_port {self.metrics_port} on {self.metrics_host} cannot "
                        f"listen: {exc.strerror or exc} (0: the system picks a free "
                        "port)") from exc
                self.metrics_url = f"http://{self.metrics_host}:{port}/metrics"
            if self.registry is not None:
                self._forwarded = _Forward(node.metrics.registry)
                self.registry.register(self._forwarded)
        except BaseException:
            try:
                await node.close()
            finally:
                self._release_spans()
            raise
        self.node, self._service = node, service
        self._closing = None
        self._op_type, self._open_state = Op, CallerState.OPEN
        self._caller = Caller(peer=f"inproc:{os.getpid()}", source="inproc")
        self.version = (PROTO_MAJOR, min(PROTO_MINOR, cfg.server.protocol_minor), PROTO_PATCH)
        self.server = self.name
        self.features = ["inproc", "names"]

    async def close(self, *, linger: float | None = None) -> None:
        """What this client owned goes (buffers freed, their rkeys revoked, names and
        expectations ended), then the node: its links to peers close, so every peer
        forgets it as it forgets a daemon that went. (``linger``: no server to wait
        for here.)"""
        if self._closing is not None:
            await asyncio.shield(self._closing)
            return
        node, self.node = self.node, None
        if node is None:
            return
        closing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._closing = closing
        try:
            await self._close(node)
        finally:
            closing.set_result(None)

    async def _close(self, node: Node) -> None:
        try:
            if self._ops:
                with contextlib.suppress(TransferdError):
                    await self.flush()
        finally:
            self._line.lost = ConnectionLost("the inproc node closed")
            for w in list(self._watches):
                w._end(ConnectionLost("the inproc node closed"))
            service, caller = self._service, self._caller
            if service is not None and caller is not None:
                service.closed(caller)
                background = list(service.background)
                if background:  # writes admitted into its buffers land first (bounded)
                    await asyncio.wait(background, timeout=service.patience)
            if self._forwarded is not None and self.registry is not None:
                with contextlib.suppress(Exception):
                    self.registry.unregister(self._forwarded)
            await node.close()
            self._release_spans()
            # What ended with the caller without a word (an expectation: over the wire
            # the connection's loss ends it), or that the node's close left: ended now.
            for c in list(self._completions.values()):
                c.end(ConnectionLost(f"{c.what}: the inproc node closed before it ended"))
            self._detach_parts()

    def _release_spans(self) -> None:
        if self._spans:
            from transferd import tracing

            self._spans = False
            tracing.release()

    @property
    def service(self) -> Service:
        if self._service is None or self.node is None:
            raise ConnectionLost("the inproc node is not running (closed, or not started: "
                                 "Client.connect('inproc://'))")
        return self._service

    @property
    def caller(self) -> Caller:
        if self._caller is None or self._caller.closed:
            raise ConnectionLost("the inproc node is not running (closed, or not started)")
        return self._caller

    def _running(self) -> tuple[Service, Caller]:
        """(:attr:`service`, :attr:`caller`) in one call, with the same checks (a submit's)."""
        service, caller = self._service, self._caller
        if service is None or self.node is None:
            raise ConnectionLost("the inproc node is not running (closed, or not started: "
                                 "Client.connect('inproc://'))")
        if caller is None or caller.state is not self._open_state:
            raise ConnectionLost("the inproc node is not running (closed, or not started)")
        return service, caller

    @property
    def conn(self) -> Any:
        return self._line

    @property
    def minor(self) -> int:
        return self.version[1]

    def _counted(self, what: str, out: int = 0, into: int = 0) -> None:
        self._counts[what] += 1
        self._bytes_out += out
        self._bytes_in += into

    def stats(self) -> dict[str, Any]:
        """Calls per method and bytes each way, as a wire client's (no frames: no wire)."""
        return {"commands": dict(self._counts), "bytes_out": self._bytes_out,
                "bytes_in": self._bytes_in}

    async def server_stats(self) -> dict[str, Any]:
        service = self.service
        body: dict[str, Any] = dict(service.metrics.summary())
        body.update(service.buffer_listing(self.caller))
        return body

    # -- devices and buffers ----------------------------------------------------------------

    def _local(self, buf: Any) -> LocalBuffer:
        return LocalBuffer(buf.id, buf.size, buf.device, self)

    async def get_devices(self) -> list[dict[str, Any]]:
        return self.service.devices()

    async def alloc_buffer(self, size: int, device: str = "cpu", *, owner: str | None = None,
                           lease: str | None = None) -> LocalBuffer:
        """A buffer of the node (this process's memory; ``shm`` is as ``cpu`` here: the
        memory is already this process's).  Owners as for a daemon's client: by default
        memory.default_owner, ``"connection"`` meaning this client."""
        await self.flush()
        self._counted("ALLOC_BUFFER")
        buf = self.service.alloc_buffer(self.caller, device, size, owner=owner, lease=lease)
        return self._local(buf)

    async def alloc_shared(self, size: int, device: str = "shm") -> SharedBuffer:
        """Shared memory of the node, as a daemon's client has it (a :class:`SharedBuffer`:
        ``view``, ``array``, ``local``): in process every buffer is this process's memory
        already, so nothing is mapped (``device`` other than host memory: BadRequest, as
        a daemon refuses a buffer that is not shared)."""
        buf = await self.alloc_buffer(size, device)
        if buf.device not in ("shm", "cpu"):
            await self.free_buffer(buf)
            raise BadRequest(f"{device!r} buffers are not shared memory on this node")
        return InprocShared(buf.id, buf.size, buf.device, self)

    async def register_memory(self, obj: Any, *, device: str | None = None) -> LocalBuffer:
        """The caller's own memory as a buffer of the node, not copied: a numpy array, a
        ``bytearray``, an ``mmap``, any writable C-contiguous buffer (device ``cpu``), or a
        CuPy array on a GPU of gpu.devices (``cuda:N``).  Owned by this client: freeing
        it (or this client's end) lets go of the memory, never frees it.  Keep the object
        alive and unresized while registered."""
        from transferd.service import caller_memory as cm

        self._counted("REGISTER_MEMORY")
        service, caller = self.service, self.caller
        gpu = cm.cuda_device_of(obj)
        if gpu is not None:
            dev = device or f"cuda:{gpu}"
            if dev != f"cuda:{gpu}":
                raise BadRequest(f"the CuPy array is on cuda:{gpu}, not {dev}")
            source = service.buffers.pool(dev).spec.source  # NotFound: not in gpu.devices
            if not isinstance(source, cm.CudaGroup):
                raise BadRequest(f"{dev} is not a GPU this node serves (gpu.devices)")
            nbytes = int(obj.nbytes)
            buf = service.adopt_memory(caller, dev, nbytes,
                                       lambda: cm.CallerCudaMemory(dev, obj, source), charge=0)
            return self._local(buf)
        if device not in (None, "cpu"):
            raise BadRequest(f"host memory is registered on device 'cpu', not {device!r}")
        view = cm.host_view_of(obj)
        try:
            buf = service.adopt_memory(caller, "cpu", view.nbytes,
                                       lambda: cm.CallerHostMemory("cpu", view), charge=0)
        except BaseException:
            view.release()
            raise
        return self._local(buf)

    async def register_cuda_memory(self, mem: Any, *, device: str | None = None
                                   ) -> RemoteBuffer:
        """In process a CuPy array is registered where it lies (no CUDA IPC)."""
        return await self.register_memory(mem, device=device)

    async def free_buffer(self, buf: RemoteBuffer | int) -> None:
        await self.flush()
        self._counted("FREE_BUFFER")
        await _done(self.service.free_buffer(self.caller, buf if isinstance(buf, int)
                                             else buf.id))

    async def buffer_clear(self, buf: RemoteBuffer | int, value: int = 0) -> None:
        await self.flush()
        self._counted("BUFFER_CLEAR")
        await _done(self.service.buffer_clear(self.caller, buf if isinstance(buf, int)
                                              else buf.id, value))

    # -- tensors ---------------------------------------------------------------------------

    async def set_tensor(self, t: Tensor | Sequence[int], data: Any) -> None:
        t = as_tensor(t)
        view = _view(data)
        await self.flush()
        self._counted("SET_TENSOR", out=view.nbytes)
        await _done(self.service.set_tensor(self.caller, t, view))

    async def get_tensor(self, t: Tensor | Sequence[int], out: Any = None) -> Any:
        t = as_tensor(t)
        await self.flush()
        dest = bytearray(t.size) if out is None else out
        self._counted("GET_TENSOR", into=t.size)
        await _done(self.service.get_tensor(self.caller, t, _view(dest)))
        return dest

    async def copy_tensor(self, src: Tensor | Sequence[int], dst: Tensor | Sequence[int]
                          ) -> None:
        await self.flush()
        self._counted("COPY_TENSOR")
        await _done(self.service.copy_tensor(self.caller, as_tensor(src), as_tensor(dst)))

    def set_tensor_async(self, t: Tensor | Sequence[int], data: Any, *, copy: bool = True
                         ) -> None:
        """Queue a write, done at the next flush point (in order with the queue).  Data
        in a mutable buffer is copied now unless ``copy=False``."""
        t = as_tensor(t)
        view = _view(data)
        if view.nbytes != t.size:
            raise BadRequest(f"{view.nbytes} bytes of data for a tensor of {t.size}")
        if copy and not view.readonly:
            view = memoryview(bytes(view))
            if COUNTING:
                count("client.queue_copy", t.size)
        caller = self.caller

        def run() -> Awaitable[None] | None:
            self._counted("SET_TENSOR", out=t.size)
            return self.service.set_tensor(caller, t, view)

        self._ops.append(run)

    def get_tensor_async(self, t: Tensor | Sequence[int], out: Any = None
                         ) -> asyncio.Future[Any]:
        """Queue a read; the future resolves at the next flush point (to ``out`` if
        given, else a bytearray)."""
        t = as_tensor(t)
        fut: asyncio.Future[Any] = (self._loop or asyncio.get_running_loop()).create_future()
        dest = bytearray(t.size) if out is None else out
        dview = _view(dest)
        if dview.nbytes != t.size:
            raise BadRequest(f"out= holds {dview.nbytes} bytes for a tensor of {t.size}")
        caller = self.caller

        def run() -> Awaitable[None] | None:
            self._counted("GET_TENSOR", into=t.size)
            try:
                w = self.service.get_tensor(caller, t, dview)
            except TransferdError as exc:
                fut.set_exception(exc)
                raise
            if w is None:
                fut.set_result(dest)
                return None

            async def wait() -> None:
                try:
                    await w
                except TransferdError as exc:
                    fut.set_exception(exc)
                    raise
                fut.set_result(dest)

            return wait()

        self._ops.append(run)
        return fut

    def _queued(self) -> bool:
        return bool(self._ops)

    async def flush(self) -> None:
        """Run what is queued, in order; the first failure is raised (after the rest ran,
        as a wire flush reports one-way failures), later reads still resolve."""
        first: TransferdError | None = None
        while self._ops:
            run = self._ops.popleft()
            try:
                await _done(run())
            except TransferdError as exc:
                first = first or exc
        if first is not None:
            raise first

    async def synchronize(self) -> None:
        await self.flush()
        self._counted("SYNCHRONIZE")
        await _done(self.service.synchronize(self.caller))

    # -- the engine ----------------------------------------------------------------------

    async def main_address(self) -> NetAddr:
        return self.service.main_address()

    async def reg_mr(self, buf: RemoteBuffer, access: str = "w") -> tuple[MrHandle, MrDesc]:
        await self.flush()
        self._counted("REG_MR")
        region, desc = self.service.reg_mr(self.caller, buf.id, access)
        return MrHandle(region.id, buf), desc

    async def dereg_mr(self, mr: MrHandle) -> None:
        await self.flush()
        self._counted("DEREG_MR")
        await _done(self.service.dereg_mr(self.caller, mr.id))

    async def _submit(self, what: str, method: str, *args: Any, **kw: Any) -> Completion:
        """Start ``Service.<method>(caller, key, *args, on_end=..., **kw)``; its
        Completion.  (The method by name, so that a client closed meanwhile fails the
        Completion, as the node's own refusals do, and no closure is made per submit.)"""
        if self._ops:
            await self.flush()  # writes queued before a submit are in place before it reads
        key = next(self._keys)
        c = InprocCompletion(what, self, key)
        self._counts[what] += 1
        try:
            service, caller = self._running()
            admitted = getattr(service, method)(caller, key, *args, on_end=c.end, **kw)
            if not isinstance(admitted, self._op_type):  # the engine was full: wait for a slot
                await admitted
        except TransferdError as exc:
            # As over the wire, where a submit is one-way: the Service's refusal (checked
            # before anything was queued) is the Completion's error, not the call's.
            c.end(exc)
        except BaseException:  # given up while it waited for a slot: never started
            c.refused()
            raise
        return c

    async def submit_single_write(
        self, length: int, imm: int | None, src: tuple[MrHandle, int],
        dst: tuple[MrDesc, int], *, timeout: float | None = None, wid: int | None = None,
        verify: bool | None = None, traceparent: str | None = None,
    ) -> Completion:
        return await self._submit(
            "SINGLE_WRITE", "submit_single_write", length, imm, (src[0].id, src[1]), dst,
            wid=wid, timeout=timeout, verify=verify,
            traceparent=traceparent if traceparent is not None else current_traceparent())

    async def submit_paged_writes(
        self, page_len: int, imm: int | None, src: tuple[MrHandle, Pages],
        dst: tuple[MrDesc, Pages], *, timeout: float | None = None, wid: int | None = None,
        verify: bool | None = None, traceparent: str | None = None,
    ) -> Completion:
        return await self._submit(
            "PAGED_WRITES", "submit_paged_writes", page_len, imm, (src[0].id, src[1]), dst,
            wid=wid, timeout=timeout, verify=verify,
            traceparent=traceparent if traceparent is not None else current_traceparent())

    async def submit_single_read(
        self, length: int, dst: tuple[MrHandle, int], src: tuple[MrDesc, int],
        *, timeout: float | None = None, verify: bool | None = None,
        traceparent: str | None = None,
    ) -> Completion:
        return await self._submit(
            "SINGLE_READ", "submit_single_read", length, (dst[0].id, dst[1]), src,
            timeout=timeout, verify=verify,
            traceparent=traceparent if traceparent is not None else current_traceparent())

    async def submit_paged_reads(
        self, page_len: int, dst: tuple[MrHandle, Pages], src: tuple[MrDesc, Pages],
        *, timeout: float | None = None, verify: bool | None = None,
        traceparent: str | None = None,
    ) -> Completion:
        return await self._submit(
            "PAGED_READS", "submit_paged_reads", page_len, (dst[0].id, dst[1]), src,
            timeout=timeout, verify=verify,
            traceparent=traceparent if traceparent is not None else current_traceparent())

    async def submit_gather(
        self, dst: MrHandle, srcs: Sequence[tuple[int, int, MrDesc, int]],
        *, timeout: float | None = None, verify: bool | None = None,
        traceparent: str | None = None,
    ) -> Completion:
        return await self._submit(
            "GATHER", "submit_gather", dst.id, list(srcs), timeout=timeout, verify=verify,
            traceparent=traceparent if traceparent is not None else current_traceparent())

    async def add_peer_group(self, addrs: Sequence[NetAddr]) -> PeerGroup:
        self._counted("ADD_PEER_GROUP")
        return PeerGroup(self.service.add_peer_group(self.caller, list(addrs)), tuple(addrs))

    async def submit_scatter(
        self, group: PeerGroup | None, imm: int | None, src: MrHandle,
        dsts: Sequence[ScatterDst], *, timeout: float | None = None,
        verify: bool | None = None, traceparent: str | None = None,
    ) -> Completion:
        return await self._submit(
            "SCATTER", "submit_scatter", group.id if group else None, imm, src.id, list(dsts),
            timeout=timeout, verify=verify,
            traceparent=traceparent if traceparent is not None else current_traceparent())

    async def submit_barrier(
        self, group: PeerGroup | None, imm: int, dsts: Sequence[MrDesc],
        *, timeout: float | None = None, traceparent: str | None = None,
    ) -> Completion:
        return await self._submit(
            "BARRIER", "submit_barrier", group.id if group else None, imm, list(dsts),
            timeout=timeout,
            traceparent=traceparent if traceparent is not None else current_traceparent())

    async def submit_send(self, addr: NetAddr, msg: Any, *, timeout: float | None = None,
                          traceparent: str | None = None) -> Completion:
        data = bytes(_view(msg))  # the caller may reuse its buffer at once
        if COUNTING:
            count("client.send_message", len(data))
        return await self._submit(
            "SEND", "submit_send", addr, data, timeout=timeout,
            traceparent=traceparent if traceparent is not None else current_traceparent())

    def submit_recvs(self, length: int, count: int,
                     callback: MessageHandler | TracedMessageHandler, *,
                     traced: bool = False) -> None:
        """Post ``count`` receives of up to ``length`` bytes; ``callback(msg)`` per message,
        on the loop (the sender's ACK goes once it returned); ``traced``: ``callback(msg,
        traceparent)``, as :meth:`client.Client.submit_recvs`."""
        self._counted("SUBMIT_RECVS")
        cb: Any = callback

        def arrived(_sender: tuple[int, int], msg: bytes, *tp: str | None) -> bool:
            try:
                cb(bytes(msg), *tp)
            except Exception:  # the user's callback: it must not break the engine
                import logging

                logging.getLogger("transferd.client").exception("receive callback failed")
            return True

        self.service.submit_recvs(self.caller, length, count, arrived, traced=traced)

    async def expect_imm_count(
        self, imm: int, count: int, callback: Callable[[], None] | None = None,
        *, wait: bool | None = None, timeout: float | None = None,
    ) -> Completion:
        """As :meth:`client.Client.expect_imm_count`: waits unless given a callback (or
        ``wait=False``); past ``timeout`` (engine.expect_timeout_s when None) it fails
        with Timeout, nothing consumed."""
        key = next(self._keys)
        c = InprocCompletion(f"imm {imm} x{count}", self, key)
        self._counted("EXPECT_IMM_COUNT")
        body = {"imm": imm, "count": count}
        if callback is not None:
            c.add_done_callback(if_reached(callback))
        try:
            self.service.expect_imm_count(self.caller, key, imm, count, timeout=timeout,
                                          on_end=lambda err: c.end(err, body))
        except BaseException:
            c.refused()
            raise
        if wait if wait is not None else callback is None:
            await c
        return c

    async def imm_count(self, imm: int) -> int:
        return self.service.imm_count(imm)

    # -- what needs a connection's staging -----------------------------------------------

    def use_copy_staging(self, pool: StagingPool) -> None:
        raise UnknownCommand("an inproc client copies no device memory through client "
                             "staging: register the CuPy array (register_memory) and use "
                             "copy_tensor or the engine's writes from it")

    async def copy_from_device(self, t: Tensor | tuple[int, int, int], src: Any, *,
                               stream: Any = None) -> None:
        self.use_copy_staging(None)  # type: ignore[arg-type]

    async def copy_to_device(self, dst: Any, t: Tensor | tuple[int, int, int], *,
                             stream: Any = None) -> None:
        self.use_copy_staging(None)  # type: ignore[arg-type]

    # -- watchers ------------------------------------------------------------------------

    async def alloc_uvm_watcher(
        self, callback: WordChange, *, buffer: RemoteBuffer | int | None = None,
        offset: int = 0,
    ) -> UvmWatcher:
        """A word the node's watcher thread watches; ``callback(old, new)`` on the loop."""
        self._counted("ALLOC_UVM_WATCHER")
        box: list[UvmWatcher] = []

        def changed(w: Any, old: int, new: int) -> None:
            if box:
                uw = box[0]
                uw.value = new
                uw.changes += 1
                try:
                    callback(old, new)
                except Exception:
                    import logging

                    logging.getLogger("transferd.client").exception("watcher callback failed")
            w.delivered()

        buffer_id = buffer.id if isinstance(buffer, RemoteBuffer) else buffer
        w, where = self.service.alloc_uvm_watcher(self.caller, changed, buffer_id, offset)
        uw = UvmWatcher({**where, "watcher": w.id, "value": w.last}, 0, callback)
        box.append(uw)
        return uw

    async def arm_paged_writes(
        self, watcher: UvmWatcher | int, value: int, page_len: int, imm: int | None,
        src: tuple[MrHandle, Pages], dst: tuple[MrDesc, Pages], *,
        timeout: float | None = None, verify: bool | None = None,
        traceparent: str | None = None,
    ) -> Completion:
        """As :meth:`client.Client.arm_paged_writes`: the node's watcher delivery submits
        it; a bad one raises here."""
        from transferd.service.armed import PagedWrite

        if self._ops:
            await self.flush()
        key = next(self._keys)
        c = InprocCompletion("ARM_PAGED_WRITES", self, key)
        self._counted("ARM_PAGED_WRITES")
        tp = traceparent if traceparent is not None else current_traceparent()
        write = PagedWrite(page_len, imm, (src[0].id, src[1]), dst, verify=verify,
                           traceparent=tp, timeout=timeout)
        try:
            wid = watcher.id if isinstance(watcher, UvmWatcher) else watcher
            self.service.arm_paged_writes(self.caller, key, wid, value, write, on_end=c.end)
        except BaseException:
            c.refused()
            c._future.cancel()
            raise
        return c

    # -- names ---------------------------------------------------------------------------

    async def publish(self, name: str, value: Value, ttl: float | None = None, *,
                      owner: str | None = None, lease: str | None = None) -> Published:
        await self.flush()  # writes queued before a publish are in place before the name
        kind, raw = encode_value(value)
        got = await _confirmed(self.service.names.publish(
            self.caller, name, kind.value, raw,
            None if ttl is None else _seconds(ttl, "a name's ttl"), owner=owner, lease=lease))
        return Published(str(got.get("name", name)), str(got.get("owner", "")),
                         str(got.get("node", "")), bool(got.get("synced", False)))

    async def lookup(self, name: str) -> Value:
        found = self.service.names.lookup(name)
        if not isinstance(found, tuple):
            found = await found
        _, kind, data, _ = found
        return decode_value(kind, data)

    async def unpublish(self, name: str) -> bool:
        await self.flush()
        got = await _confirmed(self.service.names.unpublish(self.caller, name))
        return bool(got.get("synced", False))

    def watch(self, prefix: str = "", *, initial: bool = True) -> InprocWatch:
        self.caller  # noqa: B018 - a closed client is refused now, not at the first change
        return InprocWatch(self, prefix, initial)

    async def peers(self) -> list[Peer]:
        return [Peer.from_body(p) for p in self.service.names.peers()]

    async def names(self, prefix: str = "", limit: int | None = None) -> list[NameInfo]:
        part = self.service.names
        out: list[NameInfo] = []
        after = ""
        while limit is None or len(out) < limit:
            entries, more = part.listing(prefix, after, None if limit is None
                                         else limit - len(out))
            out += [NameInfo(e.name, e.kind.value, e.node, len(e.data)) for e in entries]
            if not more or not entries:
                break
            after = out[-1].name
        return out

    async def discovery_status(self) -> dict[str, Any]:
        return dict(self.service.names.status())

    # -- context --------------------------------------------------------------------------

    async def __aenter__(self) -> InprocClient:
        await self.open()
        return self

    def __repr__(self) -> str:
        state = "running" if self.node is not None else "closed"
        return f"<InprocClient {state} {self.url}>"


async def _confirmed(got: dict[str, Any] | Awaitable[dict[str, Any]]) -> dict[str, Any]:
    return got if isinstance(got, dict) else await got
