"""Start daemons of this checkout on loopback, for the examples.

``with local_daemons(2, rails=2) as urls:`` runs two ``rpc-server`` processes on free
ports, each with ``rails`` engine rails on loopback addresses (127.0.0.1, 127.0.0.2, ...:
every address of 127.0.0.0/8 is loopback on Linux), and yields their ``tcp://`` URLs.
A real deployment runs one daemon per node (docs/operations.md); on one machine two
ports are all two daemons need.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
READY_S = 30.0


def rail_hosts(rails: int) -> list[str]:
    """The loopback address of each of ``rails`` rails (one per NIC on a real node)."""
    if not 1 <= rails <= 4:
        raise ValueError(f"a domain group has 1 to 4 rails, not {rails}")
    return [f"127.0.0.{i + 1}" for i in range(rails)]


def _start(rails: int, engine: Mapping[str, str]) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    env.update({f"TRANSFERD_ENGINE_{k.upper()}": v for k, v in engine.items()})
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["TRANSFERD_ENGINE_HOST_RAILS"] = ",".join(rail_hosts(rails))
    return subprocess.Popen(
        [sys.executable, "-m", "rpc_server.cli", "-H", "127.0.0.1", "-p", "0",
         "--metrics-port", "-1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        env=env, cwd=REPO)


def _wait_ready(p: subprocess.Popen[bytes]) -> str:
    """The URL the daemon printed, once it printed ``transferd: ready``."""
    assert p.stdout is not None
    fd = p.stdout.fileno()
    url, pending = None, b""
    deadline = time.monotonic() + READY_S
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit(f"a daemon was not ready after {READY_S:g} s")
            if not sel.select(left):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise SystemExit("a daemon exited before it was ready")
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace").strip()
                if m := re.match(r"transferd: listening on (tcp://\S+)", line):
                    url = m.group(1)
                if line == "transferd: ready":
                    if url is None:
                        raise SystemExit("the daemon printed no tcp address")
                    return url


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    if p.stdout is not None:
        p.stdout.close()


@contextlib.contextmanager
def local_daemons(n: int, rails: int = 1, engine: Mapping[str, str] | None = None
                  ) -> Iterator[list[str]]:
    """``n`` daemons with ``rails`` rails each, started side by side; their tcp:// URLs.
    ``engine``: ``[engine]`` settings of every daemon (``{"watcher_idle_poll_ms": "0.05"}``,
    docs/configuration.md)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(_start(rails, engine or {}))
        urls = [_wait_ready(p) for p in procs]
        yield urls
    finally:
        for p in procs:
            _stop(p)
