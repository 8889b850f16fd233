"""systemd: READY/STATUS/STOPPING and WATCHDOG=1 over a real notify socket, a hung worker
stopping the pings, SIGHUP reloading what it can, and the unit file as systemd reads it."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import SyncClient
from tests.helpers import REPO, DaemonProcess, run, wait_until
from tests.integration.test_cli import SERVE
from transferd.lifecycle import Watchdog, watchdog_interval
from transferd.protocol.errors import Unauthorized
from transferd.workers.worker import ThreadWorker


class NotifySocket:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.messages: list[str] = []

    def drain(self) -> list[str]:
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                return self.messages

    def count(self, line: str) -> int:
        return sum(m.splitlines().count(line) for m in self.drain())


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    n = NotifySocket(tmp_path / "notify.sock")
    yield n
    n.sock.close()


def test_ready_watchdog_and_stopping(notify: NotifySocket) -> None:
    d = DaemonProcess(["-m", "16"], env={"NOTIFY_SOCKET": notify.path,
                                         "WATCHDOG_USEC": "200000"}).start()
    try:
        d.wait_ready()
        assert wait_until(lambda: notify.count("READY=1") == 1, 5), notify.messages
        assert "STATUS=serving" in "\n".join(notify.messages)
        # A ping every 0.1 s: several within a second.
        assert wait_until(lambda: notify.count("WATCHDOG=1") >= 4, 5), notify.messages
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(15) == 0
        assert wait_until(lambda: notify.count("STOPPING=1") == 1, 5), notify.messages
    finally:
        d.stop()


def test_no_pings_for_another_process(notify: NotifySocket) -> None:
    with DaemonProcess(["-m", "16"], env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "100000",
                                          "WATCHDOG_PID": "1"}):
        assert wait_until(lambda: notify.count("READY=1") == 1, 5)
        time.sleep(0.4)
        assert notify.count("WATCHDOG=1") == 0, notify.messages


def test_watchdog_interval_from_the_environment() -> None:
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())})
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "x"}) is None


def test_a_hung_worker_stops_the_pings() -> None:
    w = ThreadWorker("test-worker")
    w.start()
    pings: list[float] = []

    async def main() -> None:
        dog = Watchdog(0.05, lambda: [w], notify=lambda m: pings.append(time.monotonic()))
        dog.start()
        await asyncio.sleep(0.3)
        healthy = len(pings)
        assert healthy >= 4, pings
        w.call(time.sleep, 0.6)  # the worker's loop hangs for 0.6 s
        hung_at = time.monotonic()
        await asyncio.sleep(0.5)
        during = [t for t in pings if hung_at + 0.15 < t < hung_at + 0.5]
        assert during == [], "pinged while the worker hung"
        await asyncio.sleep(0.4)
        assert [t for t in pings if t > hung_at + 0.65], "no pings after the worker recovered"
        dog.stop()

    try:
        run(main(), timeout=10)
    finally:
        w.stop()


def test_sighup_applies_what_it_can_and_names_the_rest(tmp_path: Path) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text("[server]\nport = 0\n[memory]\nhost_limit_mib = 32\n[metrics]\nport = 0\n")
    with DaemonProcess(command=[*SERVE, "-c", str(cfg)]) as d:
        assert d.proc is not None
        cfg.write_text("[server]\nport = 0\nmax_body = 8192\ntoken = \"new-secret\"\n"
                       "[memory]\nhost_limit_mib = 64\n[metrics]\nport = 0\n"
                       "[log]\nlevel = \"DEBUG\"\n")
        d.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "SIGHUP: applied" in d.stderr, 5), d.output()
        err = d.stderr
        assert "log.level 'info' -> 'debug'" in err
        assert "memory.host_limit_mib 32 -> 64" in err
        assert "server.token (changed)" in err and "new-secret" not in err
        assert "SIGHUP: not applied, needs a restart: server.max_body 4194304 -> 8192" in err
        assert d.alive()
        with pytest.raises(Unauthorized):
            SyncClient(d.url).close()
        with SyncClient(d.url, token="new-secret") as c:
            assert c.get_devices()[0]["total"] == 64 << 20
        # A broken file is refused: the daemon keeps the running configuration.
        cfg.write_text("[server]\nport = \"no\"\n")
        d.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "the running one stays: server.port" in d.stderr, 5), d.stderr
        with SyncClient(d.url, token="new-secret") as c:
            assert c.get_devices()[0]["total"] == 64 << 20
    assert d.returncode == 0, d.output()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed")
def test_the_unit_file_verifies(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "transferd"
    if not exe.exists():
        pytest.skip(f"transferd is not installed next to {sys.executable}")
    text = (REPO / "deploy" / "transferd.service").read_text()
    assert "WatchdogSec=" in text and "ExecReload=" in text
    unit = tmp_path / "transferd.service"
    unit.write_text(text.replace("/opt/transferd/bin/transferd", str(exe)))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                       text=True, timeout=60)
    # It exits 0 even for keys it ignores: anything it says is a problem.
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stderr
