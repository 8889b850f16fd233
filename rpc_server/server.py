"""Listeners: TCP and Unix stream sockets, one Session per connection."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import TYPE_CHECKING

from . import (
    engine_handlers,  # noqa: F401 - registers the engine commands
    watcher_handlers,  # noqa: F401 - registers ALLOC_UVM_WATCHER
)
from .context import ServerContext
from .session import Session

if TYPE_CHECKING:
    from transferd.config import Config
    from transferd.daemon import Daemon


class RpcFrontend:
    """The RPC server as a daemon front end (entry point ``transferd.frontends``)."""

    def __init__(self) -> None:
        self.ctx: ServerContext | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._unix_path = ""

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
            engine=getattr(daemon, "engine", None),
        )
        loop = asyncio.get_running_loop()
        ctx = self.ctx
        urls = []
        tcp = await loop.create_server(
            lambda: Session(ctx), s.host, s.port, reuse_address=True, backlog=1024
        )
        self._servers.append(tcp)
        for sock in tcp.sockets:
            host, port = sock.getsockname()[:2]
            urls.append(f"tcp://{host}:{port}")
        if s.unix_socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(s.unix_socket)
            unix = await loop.create_unix_server(lambda: Session(ctx), s.unix_socket)
            self._servers.append(unix)
            self._unix_path = s.unix_socket
            urls.append(f"unix://{s.unix_socket}")
        return urls

    def reload(self, config: Config) -> None:
        """SIGHUP: a new token applies to the next HELLO (open connections stay)."""
        if self.ctx is not None:
            self.ctx.token = config.server.token

    async def close(self) -> None:
        for srv in self._servers:
            srv.close()
        for srv in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(srv.wait_closed(), 2)
        if self._unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._unix_path)
