"""The command lines: ``transferd serve``, ``rpc-server``, and how they fail."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from client import SyncClient
from tests.helpers import REPO, DaemonProcess, digest, pattern, scrape
from transferd import __version__
from transferd.exits import Exit

SERVE = [sys.executable, "-m", "transferd.cli", "serve"]
RPC_SERVER = [sys.executable, "-m", "rpc_server.cli"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    env.update(extra)
    return env


def run_cli(argv: list[str], timeout: float = 30, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=clean_env(**env), cwd=REPO
    )


def round_trip(url: str, token: str | None = None) -> None:
    with SyncClient(url, token=token) as c:
        buf = c.alloc_buffer(256 * 1024)
        data = pattern(256 * 1024, 42)
        c.set_tensor(buf.tensor(), data)
        assert digest(c.get_tensor(buf.tensor())) == digest(data)
        c.free_buffer(buf)


def test_serve_from_a_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "transferd.toml"
    cfg.write_text(
        """
[server]
host = "127.0.0.1"
port = 0
token = "from-file"
protocol_minor = 1
[memory]
host_limit_mib = 32
[metrics]
port = 0
"""
    )
    with DaemonProcess(command=[*SERVE, "-c", str(cfg)]) as d:
        assert d.url.startswith("tcp://127.0.0.1:")
        assert d.metrics_url is not None
        round_trip(d.url, token="from-file")
        with SyncClient(d.url, token="from-file") as c:
            assert c.version[:2] == (1, 1)  # protocol_minor from the file
            assert c.get_devices()[0]["total"] == 32 << 20
        assert "transferd_commands_total" in "".join(scrape(d.metrics_url))
    assert d.returncode == 0, d.output()


def test_serve_flags_override_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text("[server]\nport = 1\n[metrics]\nport = 2\n")  # ports we could not bind
    with DaemonProcess(
        command=[*SERVE, "-c", str(cfg), "-p", "0", "--metrics-port", "0"],
        env={"TRANSFERD_MEMORY_HOST_LIMIT_MIB": "48"},
    ) as d:
        assert d.host_port[1] != 1 and d.metrics_url is not None
        assert not d.metrics_url.startswith("http://127.0.0.1:2/")
        round_trip(d.url)
        with SyncClient(d.url) as c:
            assert c.get_devices()[0]["total"] == 48 << 20  # env is read too


def test_serve_with_the_embedded_default() -> None:
    with DaemonProcess(command=[*SERVE, "-p", "0", "--metrics-port", "0"]) as d:
        assert d.url.startswith("tcp://127.0.0.1:")
        assert d.metrics_url is not None and d.metrics_url.startswith("http://127.0.0.1:")
        round_trip(d.url)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[server]\nport = 0\nmax_bodie = 1\n", "server.max_bodie"),
        ("[server]\nport = \"zero\"\n", "server.port"),
        ("[memory]\nhost_limit_mib = 0\n", "memory.host_limit_mib"),
    ],
)
def test_serve_with_a_bad_config_exits_3_before_listening(
    tmp_path: Path, text: str, key: str
) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    r = run_cli([*SERVE, "-c", str(cfg)])
    assert r.returncode == Exit.CONFIG == 3
    assert key in r.stderr
    assert "listening" not in r.stdout and "ready" not in r.stdout


def test_serve_with_a_bad_environment_exits_3() -> None:
    r = run_cli([*SERVE, "-p", "0"], TRANSFERD_SERVER_PROTOCOL_MINOR="9")
    assert r.returncode == Exit.CONFIG and "server.protocol_minor" in r.stderr
    assert "listening" not in r.stdout


def test_serve_with_a_missing_config_file(tmp_path: Path) -> None:
    r = run_cli([*SERVE, "-c", str(tmp_path / "nope.toml")])
    assert r.returncode == Exit.CONFIG and "nope.toml" in r.stderr


def test_rpc_server_help_lists_the_flags() -> None:
    r = run_cli([*RPC_SERVER, "--help"])
    assert r.returncode == 0
    for flag in ("-H", "--host", "-p", "--port", "-m", "--mem", "-d", "--device",
                 "--protocol-minor", "--metrics-port", "--token"):
        assert f"{flag}," in r.stdout or f"{flag} " in r.stdout, flag


def test_console_scripts_are_installed() -> None:
    bindir = Path(sys.executable).parent
    for name in ("rpc-server", "transferd"):
        exe = bindir / name
        if not exe.exists():
            pytest.skip(f"{name} is not installed next to {sys.executable}")
    r = run_cli([str(bindir / "transferd"), "--version"])
    assert r.returncode == 0 and __version__ in r.stdout
    r = run_cli([str(bindir / "rpc-server"), "-h"])
    assert r.returncode == 0 and "--protocol-minor" in r.stdout


def test_rpc_server_console_script_serves() -> None:
    exe = Path(sys.executable).parent / "rpc-server"
    if not exe.exists():
        pytest.skip("rpc-server is not installed")
    with DaemonProcess(command=[str(exe), "-H", "127.0.0.1", "-p", "0", "--metrics-port", "0",
                                "-m", "16"]) as d:
        round_trip(d.url)


@pytest.mark.parametrize(
    ("args", "needle", "status"),
    [
        (["--protocol-minor", "3"], "--protocol-minor", Exit.USAGE),
        # No machine has a hundred GPUs (nor does CuPy import everywhere): not started.
        (["-d", "cuda:99"], "gpu.devices: ", Exit.CONFIG),
        (["-d", "tpu:0"], "gpu.devices: 'tpu:0' is not a CUDA device name", Exit.CONFIG),
        (["-p", "70000"], "server.port", Exit.CONFIG),
        (["-m", "0"], "memory.host_limit_mib", Exit.CONFIG),
        (["--bogus"], "--bogus", Exit.USAGE),
    ],
)
def test_rpc_server_bad_flags(args: list[str], needle: str, status: Exit) -> None:
    r = run_cli([*RPC_SERVER, "-p", "0", "--metrics-port", "0", *args])
    assert r.returncode == status, r.stderr
    assert needle in r.stderr
    assert "ready" not in r.stdout


def test_rpc_server_bad_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[log]\nlevel = 3\n")
    r = run_cli([*RPC_SERVER, "-c", str(cfg), "-p", "0"])
    assert r.returncode == Exit.CONFIG and "log.level" in r.stderr


def test_port_in_use_fails_instead_of_hanging() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        port = s.getsockname()[1]
        r = run_cli([*RPC_SERVER, "-H", "127.0.0.1", "-p", str(port), "--metrics-port", "0"])
    finally:
        s.close()
    assert r.returncode != 0
    assert "address already in use" in r.stderr.lower()
    assert "ready" not in r.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_signals_stop_the_daemon(sig: signal.Signals) -> None:
    d = DaemonProcess(["-m", "16"]).start().wait_ready()
    try:
        round_trip(d.url)
        assert d.proc is not None
        d.proc.send_signal(sig)
        assert d.proc.wait(15) == 0, d.output()
    finally:
        d.stop()


def test_several_daemons_at_once() -> None:
    ds = [DaemonProcess(["-m", "16"]).start() for _ in range(3)]
    try:
        for d in ds:
            d.wait_ready()
        assert len({d.url for d in ds}) == 3
        assert len({d.metrics_url for d in ds}) == 3
        for d in ds:
            round_trip(d.url)
    finally:
        for d in ds:
            d.stop()
    assert all(d.returncode == 0 for d in ds)


def test_daemon_helper_reports_a_failed_start() -> None:
    from tests.helpers import DaemonError

    d = DaemonProcess(["--protocol-minor", "7"]).start()
    with pytest.raises(DaemonError) as info:
        d.wait_ready()
    assert "--protocol-minor" in str(info.value)  # its stderr is in the message
    d.stop()
