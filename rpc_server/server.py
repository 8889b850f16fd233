"""Listeners: every URL of the config through the transport registry, one Session each."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from transferd import transports
from transferd.config import ServerConfig

from . import (
    engine_handlers,  # noqa: F401 - registers the engine commands
    watcher_handlers,  # noqa: F401 - registers ALLOC_UVM_WATCHER
)
from .context import ServerContext
from .session import Session

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
        self._listeners: list[transports.Listener] = []

    async def start(self, daemon: Daemon) -> list[str]:
        cfg = daemon.config
        s = cfg.server
        self.ctx = ServerContext(
            buffers=daemon.buffers,
            metrics=daemon.metrics,
            minor=s.protocol_minor,
            token=s.token,
            max_body=s.max_body,
            max_payload=s.max_payload,
            max_message=s.max_message,
            engine=getattr(daemon, "engine", None),
        )
        ctx = self.ctx
        opts = transports.TransportOptions(
            tls_cert=s.tls_cert, tls_key=s.tls_key, max_message=s.max_message
        )
        urls = []
        try:
            for url in listen_urls(s):
                listener = await transports.listen(url, lambda: Session(ctx), opts)
                self._listeners.append(listener)
                urls.append(listener.url)
        except BaseException:
            await self.close()
            raise
        return urls

    def reload(self, config: Config) -> None:
        """SIGHUP: a new token applies to the next HELLO (open connections stay)."""
        if self.ctx is not None:
            self.ctx.token = config.server.token

    async def close(self) -> None:
        listeners, self._listeners = self._listeners, []
        for lst in listeners:
            with contextlib.suppress(Exception):
                await lst.close()
