"""Daemon lifecycle: build the shared state, start front ends, serve until a signal.

Front ends (the RPC server) plug in from above through the ``Frontend``
protocol, so this module never imports them: ``transferd serve`` finds them
by entry point (group ``transferd.frontends``) and ``rpc-server`` passes its
own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

from transferd import preflight, secret_files
from transferd.config import Config, ConfigError
from transferd.exits import Exit
from transferd.lifecycle import (
    ReloadOutcome,
    Watchdog,
    diff,
    reload_began,
    reload_ended,
    sd_notify,
    watchdog_interval,
)
from transferd.logs import fatal, hostport
from transferd.node import Node
from transferd.protocol.errors import TransferdError

if TYPE_CHECKING:
    from transferd.discovery.service import Discovery
    from transferd.engine import TransferEngine
    from transferd.service import Service

log = logging.getLogger("transferd")


class Frontend(Protocol):
    async def start(self, daemon: Daemon) -> list[str]:
        """Start serving; return the addresses listened on, as URLs.

        A front end may also have ``reload(config)``, called on SIGHUP with the
        new configuration (after the daemon applied its own reloadable keys).
        """

    async def close(self) -> None: ...


def discover_frontends() -> list[Frontend]:
    found: list[Frontend] = []
    for ep in entry_points(group="transferd.frontends"):
        found.append(ep.load()())
    return found


class StartError(Exception):
    """A listener or the engine could not start; the message names the key and address."""

    def __init__(self, message: str, status: Exit = Exit.BIND) -> None:
        super().__init__(message)
        self.status = status


@contextlib.contextmanager
def _starting(what: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise StartError(f"{what}: {exc.strerror or exc}") from exc


class Daemon:
    def __init__(self, config: Config, loader: Callable[[], Config] | None = None) -> None:
        self.config = config
        # Re-reads the configuration (same file, variables and flags) on SIGHUP.
        self.loader = loader
        self.frontends: list[Frontend] = []
        self.watchdog: Watchdog | None = None
        # The node: buffers, GPUs, metrics, engine, names and the Service its front ends
        # call (transferd/node.py; an inproc client builds the same).  Every secret is
        # read here (ConfigError: a file refused) and again, and compared, on SIGHUP.
        try:
            self.node = Node(config)
        except TransferdError as exc:  # gpu.devices: no such GPU here
            raise StartError(exc.message, Exit.CONFIG) from None
        self.secrets = self.node.secrets
        self.metrics = self.node.metrics
        self.gpus = self.node.gpus
        self.buffers = self.node.buffers
        self.metrics_url: str | None = None
        self._stop: asyncio.Event | None = None
        # A second SIGTERM/SIGINT during the drain ends it early.
        self._hurry: asyncio.Event | None = None

    @property
    def engine(self) -> TransferEngine | None:
        return self.node.engine

    @property
    def discovery(self) -> Discovery | None:
        """The cluster's names and nodes ([discovery]); made before the front ends start."""
        return self.node.discovery

    @property
    def service(self) -> Service | None:
        """What the front ends call (transferd/service/); made before they start."""
        return self.node.service

    async def run(self, frontends: Sequence[Frontend]) -> None:
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_stop_signal)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        started = self.frontends
        try:
            addr = None
            if self.node.wants_engine:
                e = self.config.engine
                rails = ", ".join(e.host_rails) or self.config.server.host
                with _starting(f"engine.host_rails / engine.peer_port: cannot listen on "
                               f"{rails} port {e.peer_port}"):
                    try:
                        addr = await self.node.start_engine()
                    except TransferdError as exc:  # e.g. engine.domain verbs, no device
                        raise StartError(f"engine.domain = {e.domain!r}: {exc.message}",
                                         Exit.CONFIG) from exc
            self.node.make_discovery()
            self.node.start_service()
            urls: list[str] = []
            s = self.config.server
            for fe in frontends:
                with _starting(f"server.host / server.port: the RPC server cannot listen on "
                               f"{hostport((s.host, s.port))}"):
                    try:
                        urls += await fe.start(self)
                    except TransferdError as exc:  # e.g. an rdma:// listener, no device
                        raise StartError(f"server.listen: {exc.message}", Exit.CONFIG) \
                            from exc
                started.append(fe)
            m = self.config.metrics
            if m.enabled:
                with _starting(f"metrics.port: the metrics endpoint cannot listen on "
                               f"{hostport((m.host, m.port))}"):
                    port = self.metrics.serve(m.host, m.port, m.timeout_s, m.max_connections)
                self.metrics_url = f"http://{m.host}:{port}/metrics"
            for url in urls:
                print(f"transferd: listening on {url}", flush=True)
            if self.metrics_url:
                print(f"transferd: metrics on {self.metrics_url}", flush=True)
            if addr is not None:
                rails = " ".join(r.decode(errors="backslashreplace") for r in addr.rails)
                print(f"transferd: engine {addr.node:016x} rails {rails} "
                      f"address {addr.to_bytes().hex()}", flush=True)
            await self._start_discovery(urls)
            # Everything built at start-up lives as long as the daemon: move it
            # out of the collector's sight so its passes stay short on the data path.
            gc.collect()
            gc.freeze()
            print("transferd: ready", flush=True)
            sd_notify("READY=1\nSTATUS=serving")
            interval = watchdog_interval()
            if interval is not None:
                self.watchdog = Watchdog(interval, self.workers)
                self.watchdog.start()
            await self._stop.wait()
            sd_notify("STOPPING=1")
            await self.drain(self.config.server.drain_s)
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            await self._close_discovery()
            for fe in reversed(started):
                with contextlib.suppress(Exception):
                    await fe.close()
            await self.node.close()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def _on_stop_signal(self) -> None:
        assert self._stop is not None and self._hurry is not None
        if self._stop.is_set():
            log.warning("second stop signal: ending the drain now")
            self._hurry.set()
        self._stop.set()

    async def drain(self, drain_s: float) -> None:
        """Stop accepting; let running work finish for up to ``drain_s``; fail the rest.

        Front ends that can drain (the RPC server: ``drain_begin``, ``in_flight``,
        ``fail_in_flight``, ``close_connections``) stop accepting and refuse new
        requests; running requests and engine transfers get until the deadline (a
        second signal ends it early).  Then what is still pending fails with TIMEOUT, the
        engine closes (nothing more is acknowledged), and connections close
        once those replies are out (1 s at most for one that does not read).  The
        worst case is ``drain_s`` plus the engine's close (5 s) plus 1 s.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + drain_s
        drainers: list[Any] = [fe for fe in self.frontends if hasattr(fe, "drain_begin")]
        # Out of peers() and lookup at once: nobody should pick a daemon that is leaving.
        await self._close_discovery()
        for fe in drainers:
            with contextlib.suppress(Exception):
                await fe.drain_begin()
        busy = sum(fe.in_flight() for fe in drainers)
        log.info("stopping: no new connections or requests; %d requests and transfers "
                 "running, draining for up to %g s", busy, drain_s)
        hurry = self._hurry
        while busy and loop.time() < deadline and not (hurry and hurry.is_set()):
            await asyncio.sleep(min(0.02, max(0.0, deadline - loop.time())))
            busy = sum(fe.in_flight() for fe in drainers)
        # What still runs fails first, with TIMEOUT (the peer may have placed it: outcome
        # unknown), not with the engine's "shutting down", which would read as not done.
        failed = sum(fe.fail_in_flight(drain_s) for fe in drainers)
        await self.node.close_engine()
        aborted = 0
        for fe in drainers:
            with contextlib.suppress(Exception):
                aborted += await fe.close_connections(1.0)
        took = loop.time() - started
        if failed or busy:
            log.warning("drain time ran out after %.2f s with %d still running: %d transfers "
                        "failed with TIMEOUT, waiting requests cancelled", took, busy, failed)
        else:
            log.info("drained in %.2f s", took)
        if aborted:
            log.warning("%d connections did not read their last replies: aborted", aborted)

    async def _start_discovery(self, urls: list[str]) -> None:
        from transferd import __version__

        disc = self.discovery
        assert disc is not None
        features: list[str] = []
        for fe in self.frontends:
            ctx = getattr(fe, "ctx", None)
            features += ctx.features() if ctx is not None else []
        caps: dict[str, Any] = {"devices": sorted(self.buffers.devices)}
        addr = None
        if self.engine is not None:
            e = self.config.engine
            addr = self.engine.main_address()
            caps.update(domain=e.domain, host_groups=e.host_groups,
                        authenticated=self.engine.secret is not None)
        await disc.start(urls=urls, server=f"transferd/{__version__}",
                         minor=self.config.server.protocol_minor, features=features,
                         addr=addr, capabilities=caps)
        d = disc.directory
        where = self.config.discovery.url or "this daemon (embedded)"
        print(f"transferd: names in {where} as node {d.node_name}", flush=True)

    async def _close_discovery(self) -> None:
        if self.discovery is not None:
            with contextlib.suppress(Exception):
                await self.discovery.close()

    def workers(self) -> list[Any]:
        """The workers the watchdog watches (the engine's: every host group's)."""
        return list(getattr(self.engine, "workers", None) or [])

    def _on_sighup(self) -> None:
        """systemd and a waiting ``transferd reload`` hear when the reload began and
        how it ended; the metrics keep the last outcome."""
        reload_began()
        try:
            outcome = self.reload()
        except Exception as exc:  # a bug in a reload hook: the daemon goes on
            log.exception("SIGHUP: the reload failed")
            outcome = ReloadOutcome(False, f"the reload failed: {exc}")
        self.metrics.reload_ok.set(1 if outcome.ok else 0)
        if outcome.ok:
            self.metrics.reload_time.set_to_current_time()
        reload_ended(outcome)

    def reload(self) -> ReloadOutcome:
        """SIGHUP: re-read the configuration; apply what can change, log the rest."""
        if self.loader is None:
            log.warning("SIGHUP: nothing to reload from (no configuration loader)")
            return ReloadOutcome(False, "nothing to reload from (no configuration loader)")
        try:
            new = self.loader()
        except ConfigError as exc:
            log.error("SIGHUP: the configuration is invalid, the running one stays: %s",
                      "; ".join(exc.errors))
            return ReloadOutcome(False, "the configuration is invalid, the running one "
                                 "stays: " + "; ".join(exc.errors))
        unfit = preflight.limit_problems(new)
        if unfit:
            shown = "; ".join(map(str, unfit))
            log.error("SIGHUP: the configuration does not fit this machine, the running one "
                      "stays: %s", shown)
            return ReloadOutcome(False, "the configuration does not fit this machine, the "
                                 "running one stays: " + shown)
        try:
            secrets = secret_files.load(new)
        except ConfigError as exc:
            log.error("SIGHUP: a secret file is refused, the running configuration and "
                      "secrets stay: %s", "; ".join(exc.errors))
            return ReloadOutcome(False, "a secret file is refused, the running "
                                 "configuration and secrets stay: " + "; ".join(exc.errors))
        kept: list[str] = []
        if self.secrets.client and not secrets.client:
            # Every client that reaches a port would then be served unauthenticated.
            kept.append("removing the client secret (the running one stays)")
            secrets = secret_files.Secrets(self.secrets.client, secrets.cluster)
            new.server.token_file, new.server.token = (self.config.server.token_file,
                                                       self.config.server.token)
        if self.secrets.cluster and not secrets.cluster and self.engine is not None:
            # Rails past loopback would then take links nobody authenticated.
            kept.append("removing the cluster secret (the running one stays)")
            secrets = secret_files.Secrets(secrets.client, self.secrets.cluster)
            new.engine.secret_file, new.engine.secret = (self.config.engine.secret_file,
                                                         self.config.engine.secret)
        applied, restart = diff(self.config, new)
        restart += kept
        # A device the new configuration serves that this daemon does not (memory.
        # shm_limit_mib from 0) is made only at a start: said so, not "applied".
        served = {spec.name for spec in new.devices()}
        if "shm" in served and "shm" not in self.buffers.devices:
            for a in [a for a in applied if a.startswith("memory.shm_limit_mib ")]:
                applied.remove(a)
                restart.append(f"{a} (the shm device is made at a start)")
        swapped = secret_files.changes(self.secrets, secrets, new)
        if not applied and not restart and not swapped:
            log.info("SIGHUP: configuration unchanged")
            return ReloadOutcome(True, "configuration unchanged")
        applied += swapped
        old = self.config
        if self.engine is not None and secrets.cluster != self.secrets.cluster:
            assert secrets.cluster is not None  # a removal was refused above
            self.engine.set_secret(secrets.cluster)
        self.secrets = secrets
        if new.log.level != old.log.level:
            from transferd import logs

            logs.set_level(new.log.level)
        for spec in new.devices():
            if spec.name in self.buffers.devices:
                self.buffers.set_limit(spec.name, spec.limit, spec.max_size)
                self.metrics.buffer_limit.labels(spec.name).set(spec.limit)
        if "shm" in self.buffers.devices and "shm" not in served:
            # memory.shm_limit_mib = 0, no longer served: a limit of 0, so no new shared
            # buffer; those held keep their memory until freed.  (GPUs are not in the
            # configuration's devices: they keep theirs.)
            self.buffers.set_limit("shm", 0, None)
            self.metrics.buffer_limit.labels("shm").set(0)
        # Reloadable keys take their new values; the others keep the running ones.
        for name, f, value in new.items():
            if f.metadata.get("reload"):
                section, _, key = name.partition(".")
                setattr(getattr(self.config, section), key, value)
        for fe in self.frontends:
            hook = getattr(fe, "reload", None)
            if hook is not None:
                hook(self.config)
        if applied:
            log.info("SIGHUP: applied %s", "; ".join(applied))
        if restart:
            log.warning("SIGHUP: not applied, needs a restart: %s", "; ".join(restart))
        return ReloadOutcome(True, "; ".join(
            ([f"applied {'; '.join(applied)}"] if applied else [])
            + ([f"not applied, needs a restart: {'; '.join(restart)}"] if restart else [])))


def configure_logging(level: str, fmt: str = "text") -> None:
    from transferd import logs

    logs.configure(level, fmt)


def run_daemon(config: Config, frontends: Sequence[Frontend],
               loader: Callable[[], Config] | None = None) -> None:
    """Check what the config needs of this machine, then run until SIGTERM/SIGINT, on uvloop.

    Exits with :class:`~transferd.exits.Exit`: CONFIG or BIND when it cannot
    start (each problem on stderr, naming its key and address), FAILURE when it
    fails later.
    """
    import uvloop

    problems = preflight.check(config)
    if problems:
        for p in problems:
            fatal(f"transferd: cannot start: {p}")
        sys.exit(max(p.kind.exit for p in problems))
    configure_logging(config.log.level, config.log.format)
    from transferd import tracing

    try:
        tracing.configure(config.log.otel, config.log.otel_file)
    except (tracing.TracingUnavailable, OSError) as exc:
        fatal(f"transferd: configuration error: log.otel = {config.log.otel!r}: {exc}")
        sys.exit(Exit.CONFIG)
    try:
        daemon = Daemon(config, loader)
        uvloop.run(daemon.run(frontends))
    except StartError as exc:
        # A race with the checks above (a port taken since): say which, no traceback.
        fatal(f"transferd: cannot start: {exc}")
        sys.exit(exc.status)
    except ConfigError as exc:
        # Found only once the engine starts: a secret file that cannot be read.
        fatal(f"transferd: configuration error: {exc}")
        sys.exit(Exit.CONFIG)
    except OSError as exc:
        fatal(f"transferd: failed: {exc}")
        sys.exit(Exit.FAILURE)
    finally:
        tracing.shutdown()  # the spans the batch still holds are exported

