"""The smaller things an operator trips over (issue 23, item 6), each through the real
command line: flags README promises, configuration errors that name their source, and
what ``ping`` / ``stats`` say about a port that is not an RPC port."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonFactory
from tests.helpers import REPO, DaemonProcess
from tests.integration.test_cli import RPC_SERVER, SERVE, run_cli
from transferd.exits import Exit

CLI = [sys.executable, "-m", "transferd.cli"]


def cli(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return run_cli([*CLI, *args], timeout=timeout, **env)


@pytest.mark.parametrize("command", [SERVE, RPC_SERVER], ids=["transferd serve", "rpc-server"])
def test_both_daemons_take_dash_d(command: list[str]) -> None:
    with DaemonProcess(["-d", "cpu", "-p", "0", "--metrics-port", "-1"], command=command) as d:
        assert d.url.startswith("tcp://")


def test_the_readme_check_config_lines_pass() -> None:
    readme = (REPO / "README.md").read_text()
    lines = re.findall(r"^\.venv/bin/transferd check-config (.+)$", readme, re.M)
    assert lines, "README shows no check-config line"
    for line in lines:
        r = cli("check-config", *line.split("#")[0].split())
        assert r.returncode == Exit.OK, (line, r.stderr)


def test_a_negative_metrics_port_says_how_to_turn_metrics_off(tmp_path: Path) -> None:
    cfg = tmp_path / "m.toml"
    cfg.write_text("[metrics]\nport = -1\n")
    r = cli("check-config", str(cfg))
    assert r.returncode == Exit.CONFIG
    assert r.stderr.strip() == ("metrics.port: -1 is not a TCP port (0-65535); to turn it off "
                                "set metrics.enabled = false")


def test_a_problem_from_a_variable_names_it_and_comes_alone(tmp_path: Path) -> None:
    r = cli("check-config", TRANSFERD_SERVER_PORT="abc", TRANSFERD_MEMORY_HOST_LIMIT_MIB="-5")
    assert r.returncode == Exit.CONFIG
    assert r.stderr.splitlines() == [
        "server.port: expected int, got 'abc' (from TRANSFERD_SERVER_PORT)",
        "memory.host_limit_mib: must be at least 1, got -5 (from "
        "TRANSFERD_MEMORY_HOST_LIMIT_MIB)",
    ]
    cfg = tmp_path / "n.toml"
    cfg.write_text("[memory]\nhost_limit_mib = -5\n")
    r = cli("check-config", str(cfg))
    # One error: max_buffer_mib is not "over" a limit that is itself invalid.
    assert r.stderr.splitlines() == ["memory.host_limit_mib: must be at least 1, got -5"]


@pytest.mark.parametrize("command", ["ping", "stats", "buffers"])
def test_a_malformed_url_is_a_usage_error(command: str) -> None:
    r = cli(command, "tcp//127.0.0.1:1")
    assert r.returncode == Exit.USAGE, r.stderr
    assert "not a URL" in r.stderr


# -- what answers where a daemon was expected -----------------------------------------


def test_ping_names_the_metrics_port_and_the_peer_port(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    assert d.metrics_url is not None
    metrics = d.metrics_url.removeprefix("http://").removesuffix("/metrics")
    r = cli("ping", f"tcp://{metrics}", "--timeout", "2")
    assert r.returncode == Exit.FAILURE
    assert "transferd's metrics endpoint (HTTP) answers" in r.stderr
    assert "TimeoutError" not in r.stderr
    rail = re.search(r"rails (\S+)", d.output()).group(1)  # type: ignore[union-attr]
    r = cli("ping", f"tcp://{rail}", "--timeout", "2")
    assert r.returncode == Exit.FAILURE
    assert "is a transferd peer port" in r.stderr and "NO_HELLO" not in r.stderr


@pytest.fixture
def silent() -> Iterator[int]:
    """A port that accepts and never says a word."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        s.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(s.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield s.getsockname()[1]
    stop.set()
    t.join()
    for c in held:
        c.close()
    s.close()


def test_ping_a_port_that_never_answers(silent: int) -> None:
    r = cli("ping", f"tcp://127.0.0.1:{silent}", "--timeout", "1")
    assert r.returncode == Exit.FAILURE
    assert "no HELLO reply within 1 s" in r.stderr and "TimeoutError" not in r.stderr


def test_ping_a_port_nothing_accepts_on() -> None:
    # A listener whose backlog is full: SYNs are dropped, as by a firewall.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(0)
    port = s.getsockname()[1]
    fill = []
    try:
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            fill.append(c)
        time.sleep(0.2)
        r = cli("ping", f"tcp://127.0.0.1:{port}", "--timeout", "1")
    finally:
        for c in fill:
            c.close()
        s.close()
    assert r.returncode == Exit.FAILURE
    assert "cannot connect to 127.0.0.1:" in r.stderr or "no HELLO reply" in r.stderr, r.stderr
    assert "TimeoutError" not in r.stderr


def test_the_daemons_token_variable_is_named_when_set_instead(daemon_factory: DaemonFactory,
                                                              tmp_path: Path) -> None:
    tok = tmp_path / "token"
    tok.write_text("t0ken")
    tok.chmod(0o600)
    d = daemon_factory(["--token-file", str(tok)])
    r = cli("ping", d.url, TRANSFERD_SERVER_TOKEN="t0ken")
    assert r.returncode == Exit.FAILURE
    assert "TRANSFERD_SERVER_TOKEN(_FILE) is set, but that is the daemon's own setting: " \
           "the commands read TRANSFERD_TOKEN" in r.stderr
    assert cli("ping", d.url, "-n", "1", TRANSFERD_TOKEN="t0ken").returncode == Exit.OK


# -- stats -------------------------------------------------------------------------------


def test_stats_shows_uptime_connections_errors_and_the_engine(
        daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    cli("ping", f"{d.url}", "-n", "1")
    r = cli("stats", d.url, "--once", "--json")
    assert r.returncode == Exit.OK, r.stderr
    j = json.loads(r.stdout)
    assert j["uptime_s"] > 0 and j["connections"]["accepted"] >= 2
    assert set(j["errors"]) >= {"UNAUTHORIZED", "NOT_FOUND", "INTERNAL"}
    assert set(j["engine"]) >= {"bytes_out", "bytes_landed", "transfers_ok",
                                "transfers_error", "in_flight"}
    r = cli("stats", d.url, "--once")
    for row in ("up", "connections open", "connections accepted", "errors",
                "failed handshakes", "engine bytes out", "engine transfers"):
        assert any(line.startswith(row + " ") for line in r.stdout.splitlines()), row
