"""systemd's watchdog, and SIGHUP: what a running daemon changes without a restart.

A reload tells systemd it begins (``RELOADING=1`` with ``MONOTONIC_USEC``, the
``Type=notify-reload`` protocol) and that it ended (``READY=1``), and tells whoever
waits for it (``transferd reload PID``, the unit's ``ExecReload=``) how it went, over
a datagram to the abstract socket ``transferd-reload-PID``: so ``systemctl reload``
returns once the reload is done, and fails when the configuration was refused.

:class:`Watchdog` sends ``WATCHDOG=1`` every half ``WATCHDOG_USEC`` from the
daemon's event loop (the loop that would hang), and only while every worker
thread has answered its last heartbeat: a hung engine worker stops the pings as
surely as a hung loop, and systemd restarts the daemon.

:func:`diff` compares the running configuration with a re-read one; keys whose
schema entry has ``reload=True`` are applied by :meth:`Daemon.reload`, the
others are logged as needing a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from transferd.config import Config

log = logging.getLogger("transferd")


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) about our state; a no-op outside systemd."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    if path.startswith("@"):
        path = "\0" + path[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(path)
        s.sendall(message.encode())


def watchdog_interval(environ: Any = None) -> float | None:
    """Seconds between pings (half of WATCHDOG_USEC), or None when systemd wants none."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid.strip() != str(os.getpid())):
        return None
    try:
        us = int(usec)
    except ValueError:
        return None
    return us / 2e6 if us > 0 else None


class Beating(Protocol):
    """A worker the watchdog watches (transferd.workers.Worker)."""

    name: str

    def beat(self) -> None: ...

    @property
    def last_beat(self) -> float: ...


class Watchdog:
    def __init__(self, interval: float, workers: Callable[[], Sequence[Beating]],
                 notify: Callable[[str], None] = sd_notify) -> None:
        self.interval = interval
        self.workers = workers
        self.notify = notify
        self.pings = 0
        self._task: asyncio.Task[None] | None = None
        self._stalled: set[str] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def healthy(self) -> bool:
        """Every worker answered a heartbeat within two intervals (asked one just now)."""
        now = time.monotonic()
        ok = True
        for w in self.workers():
            late = now - w.last_beat > 2 * self.interval
            if late and w.name not in self._stalled:
                log.error("worker %s has not answered for %.1f s: watchdog pings stop",
                          w.name, now - w.last_beat)
                self._stalled.add(w.name)
            elif not late:
                self._stalled.discard(w.name)
            ok = ok and not late
            w.beat()
        return ok

    async def _run(self) -> None:
        while True:
            if self.healthy():
                self.notify("WATCHDOG=1")
                self.pings += 1
            await asyncio.sleep(self.interval)


# -- reloads ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReloadOutcome:
    """How a SIGHUP's reload went: applied (or nothing to apply), or refused."""

    ok: bool
    text: str


def reload_socket(pid: int) -> bytes:
    """The abstract socket a waiter for ``pid``'s next reload binds."""
    return f"\0transferd-reload-{pid}".encode()


def reload_began(notify: Callable[[str], None] = sd_notify) -> None:
    """Before the configuration is read again (systemd: the reload has begun)."""
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notify(f"RELOADING=1\nMONOTONIC_USEC={usec}\nSTATUS=reloading the configuration")


def reload_ended(outcome: ReloadOutcome, notify: Callable[[str], None] = sd_notify) -> None:
    """After it: systemd hears READY=1 (serving, whatever the outcome: a refused file
    leaves the running configuration), the waiter hears the outcome."""
    status = "serving (reloaded)" if outcome.ok else "serving (the last reload was refused)"
    notify(f"READY=1\nSTATUS={status}")
    word = b"ok " if outcome.ok else b"failed "
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        # Nobody waiting (ECONNREFUSED): a plain `kill -HUP` or systemd's own signal.
        # Never blocking (EAGAIN: dropped): an abstract name has no permissions, and a
        # process that binds it and never reads must not hold the daemon's loop.
        s.setblocking(False)
        s.sendto(word + outcome.text.encode()[:60000], reload_socket(os.getpid()))


def diff(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """(changes SIGHUP applies, changes that need a restart), as ``key: old -> new``."""
    applied: list[str] = []
    restart: list[str] = []
    for (name, f, a), (_, _, b) in zip(old.items(), new.items(), strict=True):
        if a == b:
            continue
        shown = "(changed)" if f.metadata.get("secret") else f"{a!r} -> {b!r}"
        (applied if f.metadata.get("reload") else restart).append(f"{name} {shown}")
    return applied, restart
