"""Start-up: defaults that never collide, and errors that name what failed (exit statuses)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from client import SyncClient
from tests.helpers import REPO, DaemonProcess
from tests.integration.test_cli import RPC_SERVER, SERVE, round_trip, run_cli
from transferd.exits import Exit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def held_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_two_rpc_servers_with_only_different_ports_both_run() -> None:
    p1, p2 = free_port(), free_port()
    ds = [DaemonProcess(command=[*RPC_SERVER, "-p", str(p), "-m", "16"]).start()
          for p in (p1, p2)]
    try:
        for d in ds:
            d.wait_ready()
        assert [d.host_port[1] for d in ds] == [p1, p2]
        assert ds[0].metrics_url and ds[1].metrics_url
        assert ds[0].metrics_url != ds[1].metrics_url
        for d in ds:
            round_trip(d.url)
    finally:
        for d in ds:
            d.stop()
    assert [d.returncode for d in ds] == [0, 0], [d.output() for d in ds]


@pytest.mark.parametrize("command", [SERVE, RPC_SERVER], ids=["serve", "rpc-server"])
def test_a_taken_metrics_port_is_an_error_naming_it(command: list[str]) -> None:
    s = held_port()
    try:
        port = s.getsockname()[1]
        r = run_cli([*command, "-p", "0", "--metrics-port", str(port)])
    finally:
        s.close()
    assert r.returncode == Exit.BIND == 4, r.stderr
    assert "metrics.port" in r.stderr and f"127.0.0.1:{port}" in r.stderr
    assert "listening" not in r.stdout and "ready" not in r.stdout


def test_a_taken_rpc_port_is_an_error_naming_it() -> None:
    s = held_port()
    try:
        port = s.getsockname()[1]
        r = run_cli([*SERVE, "-p", str(port)])
    finally:
        s.close()
    assert r.returncode == Exit.BIND, r.stderr
    assert "server.port" in r.stderr and f"127.0.0.1:{port}" in r.stderr
    assert "already in use" in r.stderr.lower()
    assert "listening" not in r.stdout


def test_a_rail_this_machine_lacks_is_named_by_its_index() -> None:
    # (insecure: a non-loopback rail without a cluster secret is refused before this check)
    r = run_cli([*SERVE, "-p", "0"], TRANSFERD_ENGINE_HOST_RAILS="127.0.0.1,192.0.2.77",
                TRANSFERD_ENGINE_INSECURE="true")
    assert r.returncode == Exit.BIND, r.stderr
    assert "engine.host_rails[1]: 192.0.2.77 is not an address of this machine" in r.stderr
    assert "listening" not in r.stdout


def test_a_host_that_does_not_resolve_is_a_config_error() -> None:
    r = run_cli([*SERVE, "-H", "no-such-host.invalid", "-p", "0"])
    assert r.returncode == Exit.CONFIG, r.stderr
    assert "server.host: 'no-such-host.invalid'" in r.stderr


def test_ports_that_clash_are_a_config_error() -> None:
    port = free_port()
    r = run_cli([*SERVE, "-p", str(port), "--metrics-port", str(port)])
    assert r.returncode == Exit.CONFIG, r.stderr
    assert "metrics.port" in r.stderr and "server.port" in r.stderr


def test_a_unix_socket_in_use_is_not_taken_over(tmp_path: Path) -> None:
    path = str(tmp_path / "d.sock")
    with DaemonProcess(command=[*SERVE, "-p", "0", "--metrics-port", "-1", "--unix", path]) as d:
        assert d.unix_path == path
        r = run_cli([*SERVE, "-p", "0", "--metrics-port", "-1", "--unix", path])
        assert r.returncode == Exit.BIND, r.stderr
        assert "server.unix_socket" in r.stderr and "in use" in r.stderr
        # The first daemon still owns its socket.
        round_trip(f"unix://{path}")


def test_a_file_at_the_unix_socket_path_is_refused_and_kept(tmp_path: Path) -> None:
    """``--unix`` naming a file that is not a socket (a path set wrong): the daemon
    refuses to start, saying so, and the file is as it was (it was deleted)."""
    f = tmp_path / "transferd.toml"
    f.write_text("[server]\n")
    r = run_cli([*SERVE, "-p", "0", "--metrics-port", "-1", "--unix", str(f)])
    assert r.returncode == Exit.CONFIG, r.stderr
    assert "server.unix_socket" in r.stderr and "is not a socket" in r.stderr, r.stderr
    assert f.read_text() == "[server]\n"


def test_serve_takes_rpc_servers_flags(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    (tmp_path / "tok").write_text("tok\n")
    (tmp_path / "tok").chmod(0o600)
    with DaemonProcess(command=[*SERVE, "-p", "0", "-m", "24", "--metrics-port", "-1",
                                "--unix", path, "--token-file", str(tmp_path / "tok"),
                                "--log-level", "WARNING",
                                "--protocol-minor", "2"]) as d:
        assert d.metrics_url is None
        assert d.unix_url == f"unix://{path}"
        with SyncClient(d.unix_url, token="tok") as c:
            assert c.get_devices()[0]["total"] == 24 << 20


@pytest.mark.parametrize("argv", [["transferd.cli", "serve"], ["rpc_server.cli"]])
def test_both_commands_have_version_and_the_same_flags(argv: list[str]) -> None:
    r = run_cli([sys.executable, "-m", argv[0], "--version"])
    assert r.returncode == 0 and "0." in r.stdout
    r = run_cli([sys.executable, "-m", *argv, "--help"])
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for flag in ("-c, --config", "-H, --host", "-p, --port", "-m, --mem", "--protocol-minor",
                 "--metrics-port", "--token", "--token-file", "--unix", "--log-level",
                 "--log-format", "--listen"):
        assert flag in text, flag
    assert "-1 turns metrics off" in text


def test_help_texts_are_not_truncated() -> None:
    env = {"COLUMNS": "80", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "transferd.cli", "--help"], capture_output=True,
                       text=True, timeout=30, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr
    commands = r.stdout.split("Commands:")[1]
    assert "..." not in commands, r.stdout  # click cuts a first line too long with "..."


@pytest.mark.parametrize(("prog", "var"), [("transferd", "_TRANSFERD_COMPLETE"),
                                           ("rpc-server", "_RPC_SERVER_COMPLETE")])
def test_shell_completion_as_documented(prog: str, var: str) -> None:
    exe = Path(sys.executable).parent / prog
    if not exe.exists():
        pytest.skip(f"{prog} is not installed next to {sys.executable}")
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30,
                       env={"PATH": "/usr/bin:/bin", var: "bash_source"})
    assert r.returncode == 0 and "complete -o nosort -F" in r.stdout, r.stdout + r.stderr
    assert var in (REPO / "docs" / "operations.md").read_text()
