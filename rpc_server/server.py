"""Listeners: every URL of the config through the transport registry, one Session each."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING

from transferd import transports
from transferd.config import ServerConfig
from transferd.preauth import Admission

from . import (
    drain,
    engine_handlers,  # noqa: F401 - registers the engine commands
    lease_handlers,  # noqa: F401 - registers LEASE and END_LEASE
    name_handlers,  # noqa: F401 - registers PUBLISH ... NAMES
    read_handlers,  # noqa: F401 - registers SINGLE_READ, PAGED_READS, GATHER
    watcher_handlers,  # noqa: F401 - registers ALLOC_UVM_WATCHER
)
from .context import ServerContext
from .handlers import HANDLERS
from .session import Session

log = logging.getLogger("transferd.server")

if TYPE_CHECKING:
    from transferd.config import Config
    from transferd.daemon import Daemon


def listen_urls(s: ServerConfig) -> list[str]:
    """What the server listens on: tcp://host:port, server.listen, server.unix_socket."""
    urls: list[str] = []
    if s.tcp_listener:
        host = f"[{s.host}]" if ":" in s.host else s.host
        urls.append(f"tcp://{host}:{s.port}")
    urls += s.listen
    if s.unix_socket:
        urls.append(f"unix://{s.unix_socket}")
    return urls


class RpcFrontend:
    """The RPC server as a daemon front end (entry point ``transferd.frontends``)."""

    def __init__(self) -> None:
        self.ctx: ServerContext | None = None
        self._daemon: Daemon | None = None
        self._listeners: list[transports.Listener] = []

    async def start(self, daemon: Daemon) -> list[str]:
        cfg = daemon.config
        s = cfg.server
        self._daemon = daemon
        # Read by the daemon (transferd.secret_files), once, and swapped by its reload.
        keys = daemon.secrets.client
        service = daemon.service
        assert service is not None, "the daemon makes its Service before the front ends"
        self.ctx = ServerContext(
            service=service,
            minor=s.protocol_minor,
            secret=keys.current,
            previous_secret=keys.previous,
            token_transports=tuple(s.token_transports),
            handshake_timeout=s.handshake_timeout_s,
            admission=Admission(s.max_handshakes, s.max_handshakes_per_source,
                                timeout=s.handshake_timeout_s),
            max_body=s.max_body,
            max_payload=s.max_payload,
            max_tensors=s.max_tensors,
            max_reply=s.max_reply,
            max_message=s.max_message,
            name=service.name,
            served=frozenset(HANDLERS),
        )
        ctx = self.ctx
        if ctx.secret:
            log.info("clients must authenticate: hmac-sha256 on every listener, token on %s",
                     ", ".join(ctx.token_transports) or "none")
        opts = transports.TransportOptions(
            tls_cert=s.tls_cert, tls_key=s.tls_key, max_message=s.max_message,
            handshake_timeout=s.handshake_timeout_s, admission=ctx.admission,
        )
        urls = []
        try:
            for url in listen_urls(s):
                kind = transports.get(url)
                settings = ctx.settings_for(kind.scheme, kind.kind == "message")
                listener = await transports.listen(
                    url, functools.partial(Session, ctx, settings, kind), opts
                )
                self._listeners.append(listener)
                urls.append(listener.url)
        except BaseException:
            await self.close()
            raise
        return urls

    def reload(self, config: Config) -> None:
        """SIGHUP: the secrets the daemon read apply to the next handshake (open
        connections stay)."""
        if self.ctx is not None and self._daemon is not None:
            keys = self._daemon.secrets.client
            self.ctx.set_secret(keys.current, keys.previous)

    # -- the drain at SIGTERM (rpc_server/drain.py; Daemon.drain runs the steps) --

    async def drain_begin(self) -> None:
        """Stop accepting (listeners closed) and refuse new requests on open connections."""
        await self.close()
        if self.ctx is not None:
            drain.begin(self.ctx)

    def in_flight(self) -> int:
        return drain.in_flight(self.ctx) if self.ctx is not None else 0

    def fail_in_flight(self, drain_s: float) -> int:
        return drain.fail_in_flight(self.ctx, drain_s) if self.ctx is not None else 0

    async def close_connections(self, timeout: float) -> int:
        return await drain.close_all(self.ctx, timeout) if self.ctx is not None else 0

    async def close(self) -> None:
        listeners, self._listeners = self._listeners, []
        for lst in listeners:
            with contextlib.suppress(Exception):
                await lst.close()
