"""One transferd node in this process: its buffers, GPUs, metrics, engine, names and Service.

Built the same way wherever it runs: inside the daemon (transferd/daemon.py adds
the front ends, signals, the drain and the reload around it) and inside an
application's own process (``Client.connect("inproc://")``, client/inproc.py).
Either way it reads the same configuration (transferd.config) and the same
secrets (transferd.secret_files), and its callers reach it through its
:class:`~transferd.service.Service`.

The steps, in order: :class:`Node` (buffers, GPUs: no loop needed),
:meth:`Node.start_engine` (rails bound, peer plane up), :meth:`Node.make_discovery`,
:meth:`Node.start_service` (on the loop), and :meth:`Node.close`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING

from transferd import secret_files
from transferd.memory import BufferTable
from transferd.metrics import Metrics
from transferd.protocol.errors import NotFound
from transferd.protocol.keyring import Keyring
from transferd.service import Service

if TYPE_CHECKING:
    from transferd.config import Config
    from transferd.discovery.service import Discovery
    from transferd.engine import TransferEngine
    from transferd.memory.cuda import CudaDevices
    from transferd.protocol.values import NetAddr

log = logging.getLogger("transferd")


class Node:
    def __init__(self, config: Config, secrets: secret_files.Secrets | None = None,
                 metrics: Metrics | None = None, *, name: str | None = None) -> None:
        self.config = config
        # Every secret, read once (ConfigError: a file refused).
        self.secrets = secrets if secrets is not None else secret_files.load(config)
        self.metrics = metrics or Metrics()
        self.name = name
        # The GPUs served (their groups: workers, streams, staging), stopped at close.
        self.gpus = gpu_devices(config)
        self.buffers = BufferTable(config.devices() + (self.gpus.specs if self.gpus else []),
                                   max_buffers=config.memory.max_buffers)
        for dev, pool in self.buffers.devices.items():
            # Set once: alerts and dashboards compare the allocated bytes with it.
            self.metrics.buffer_limit.labels(dev).set(pool.limit)
            # Read when scraped: memory is returned from any thread, late.
            self.metrics.buffer_bytes.labels(dev).set_function(
                functools.partial(self.buffers.used_on, dev))
            self.metrics.buffer_lingering.labels(dev).set_function(
                functools.partial(self.buffers.lingering_on, dev))
        self.engine: TransferEngine | None = None
        self.discovery: Discovery | None = None
        self.service: Service | None = None
        self._engine_closed = False

    @property
    def wants_engine(self) -> bool:
        # A minor-1 server cannot be asked engine commands: no engine then.
        return self.config.engine.enabled and self.config.server.protocol_minor >= 2

    async def start_engine(self) -> NetAddr | None:
        """The engine, its rails bound (None: engine.enabled is off).  OSError when a rail
        cannot listen; TransferdError when the Domain cannot start (no device)."""
        if not self.wants_engine:
            return None
        from transferd.engine import TransferEngine

        self.engine = TransferEngine(
            self.config.engine, self.buffers, self.metrics, self.config.server.host,
            secret=self.secrets.cluster or Keyring())
        try:
            addr = await self.engine.start()
        except BaseException:
            self.engine = None
            raise
        self.metrics.watch_engine(self.engine)
        return addr

    def make_discovery(self) -> Discovery:
        """The node's names ([discovery]); started by whoever knows its URLs."""
        from transferd.discovery.service import Discovery

        self.discovery = Discovery(self.config.discovery, self.metrics)
        return self.discovery

    def start_service(self) -> Service:
        """The Service every caller uses (on the loop: leases' timers, watchers)."""
        kw = {"name": self.name} if self.name else {}
        self.service = Service(self.config, self.buffers, self.metrics, engine=self.engine,
                               discovery=self.discovery, **kw)
        self.service.start()
        return self.service

    async def close_engine(self) -> None:
        """The engine closes (nothing more is acknowledged); once."""
        if self.engine is not None and not self._engine_closed:
            self._engine_closed = True
            await self.engine.close()

    async def close(self) -> None:
        """Everything, in the reverse order: the service, names, engine, memory, GPUs."""
        if self.service is not None:
            self.service.close()
        if self.discovery is not None:
            with contextlib.suppress(Exception):
                await self.discovery.close()
        await self.close_engine()
        self.metrics.close()
        self.buffers.close()
        if self.gpus is not None:
            self.gpus.stop()
            self.gpus = None


def gpu_devices(config: Config) -> CudaDevices | None:
    """Start a group per GPU of gpu.devices (None without any); NotFound naming the key
    when one cannot be had."""
    if not config.gpu.devices:
        return None
    # CuPy is imported only here, for a node told to serve a GPU.
    from transferd.memory import cuda
    from transferd.protocol.errors import TransferdError

    g = config.gpu
    try:
        return cuda.CudaDevices.start(
            g.devices, memory_limit_mib=g.memory_limit_mib, staging_mib=g.staging_mib,
            staging_chunk_kib=g.staging_chunk_kib, pin=config.engine.pin_workers)
    except TransferdError as exc:
        raise NotFound(f"gpu.devices: {exc.message}") from None
