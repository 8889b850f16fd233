"""transferd bench: daemons it starts or given ones (a cluster secret, a token), a size
sweep, its clean-up on every way out, the bar, the plot."""

from __future__ import annotations

import importlib.util
import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import DaemonFactory
from tests.helpers import REPO, DaemonProcess, wait_until
from tests.integration.test_cli import clean_env
from transferd.commands.bench import parse_size
from transferd.exits import Exit

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
BENCH = [sys.executable, "-m", "transferd.cli", "bench"]
TOKEN = "bench-token"


def bench(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=clean_env(**env))


def _file(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    p.chmod(0o600)
    return str(p)


def _listing(d: DaemonProcess, token: str | None) -> int:
    """How many buffers the daemon holds (``transferd buffers --json``)."""
    env = {"TRANSFERD_TOKEN": token} if token else {}
    r = subprocess.run([sys.executable, "-m", "transferd.cli", "buffers", d.url, "--json"],
                       capture_output=True, text=True, timeout=30, cwd=REPO,
                       env=clean_env(**env))
    assert r.returncode == 0, r.stderr
    return len(json.loads(r.stdout)["buffers"])


def clean(stderr: str) -> None:
    """No traceback, and asyncio never had to report a task nobody awaited."""
    assert "Traceback" not in stderr and "never retrieved" not in stderr, stderr


def test_bench_between_two_daemons_it_starts() -> None:
    r = bench("--duration", "0.5", "--size", "256KiB", "--window", "4", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["op"] == "write" and j["window"] == 4
    (one,) = j["results"]
    assert one["size"] == 256 << 10 and one["transfers"] > 0
    assert one["bytes"] == one["transfers"] * (256 << 10)
    assert one["verified"] is True and one["gib_per_s"] > 0
    assert 0 < one["min_ms"] <= one["p50_ms"] <= one["p90_ms"] <= one["p99_ms"] \
        <= one["p999_ms"] <= one["max_ms"]
    assert "bench" in r.stderr  # the progress bar's label
    clean(r.stderr)


def test_a_sweep_prints_a_row_per_size() -> None:
    r = bench("--duration", "0.3", "--sizes", "4K,64K,1M", "--window", "2")
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines()]
    header = next(row for row in rows if row[:2] == ["size", "transfers"])
    assert "p99.9" in header and "Gbit/s" in header
    sizes = [" ".join(row[:2]) for row in rows if row and row[-1] == "match"]
    assert sizes == ["4 KiB", "64 KiB", "1 MiB"], r.stdout


@pytest.mark.parametrize("args", [["--size", "0"], ["--sizes", "4K,0"], ["--size", "17GiB"],
                                  ["--size", "4K", "--sizes", "8K"], ["--peer", "tcp//x"]])
def test_usage_errors_exit_2(args: list[str]) -> None:
    r = bench(*args)
    assert r.returncode == Exit.USAGE, (r.stdout, r.stderr)
    clean(r.stderr)


def test_the_bar_ends_at_100_percent() -> None:
    # A terminal, so that click draws the bar.
    leader, follower = pty.openpty()
    p = subprocess.Popen([*BENCH, "--duration", "0.5", "--sizes", "4K,64K"],
                         stdout=subprocess.PIPE, stderr=follower, cwd=REPO, env=clean_env(),
                         text=True)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    assert p.wait(60) == 0
    os.close(leader)
    bars = seen.decode(errors="replace")
    assert "100%" in bars and "bench write 64 KiB" in bars, bars[-400:]


def test_a_peer_with_a_cluster_secret_and_a_token(daemon_factory: DaemonFactory,
                                                  tmp_path: Path) -> None:
    secret = _file(tmp_path, "cluster", "bench-cluster-secret")
    token = _file(tmp_path, "token", TOKEN)
    d = daemon_factory(["--token-file", token], env={"TRANSFERD_ENGINE_SECRET_FILE": secret})
    r = bench("--peer", d.url, "--duration", "0.3", "--size", "64KiB",
              "--secret-file", secret, "--token-file", token)
    assert r.returncode == 0, r.stderr
    assert f"destination  {d.url}" in r.stdout and "match" in r.stdout
    # The variables do the same: the daemon's own name for the secret, the client's
    # for the token.
    r = bench("--peer", d.url, "--duration", "0.3", "--size", "64KiB", "--json",
              TRANSFERD_ENGINE_SECRET_FILE=secret, TRANSFERD_TOKEN=TOKEN)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["results"][0]["verified"] is True
    assert _listing(d, TOKEN) == 0  # it gave back what it took


def test_a_wrong_cluster_secret_is_one_line_and_nothing_left(daemon_factory: DaemonFactory,
                                                             tmp_path: Path) -> None:
    d = daemon_factory(env={"TRANSFERD_ENGINE_SECRET_FILE": _file(tmp_path, "a", "one")})
    r = bench("--peer", d.url, "--duration", "0.3", "--secret-file", _file(tmp_path, "b", "two"))
    assert r.returncode == Exit.FAILURE
    clean(r.stderr)
    assert "did not prove the cluster secret" in r.stderr
    assert _listing(d, None) == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_gives_back_what_it_holds(daemon_factory: DaemonFactory,
                                           sig: signal.Signals) -> None:
    d = daemon_factory()
    p = subprocess.Popen([*BENCH, "--peer", d.url, "--duration", "60", "--size", "1MiB"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=REPO, env=clean_env())
    try:
        # Running once its buffer is on the peer.
        assert wait_until(lambda: _listing(d, None) == 1, 30)
        time.sleep(0.3)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + sig, err
    assert f"stopped by {sig.name}" in err
    clean(err)
    assert _listing(d, None) == 0


def test_sigkill_leaves_nothing_on_the_peer(daemon_factory: DaemonFactory) -> None:
    """No clean-up runs under SIGKILL (the OOM killer, a CI timeout): what the bench
    takes on the peer is its connection's, so the peer frees it when the connection
    drops.  Before, the peer kept a buffer of --size (and its region) per killed run,
    until someone freed it by id or restarted the daemon."""
    d = daemon_factory()
    p = subprocess.Popen([*BENCH, "--peer", d.url, "--duration", "60", "--size", "1MiB"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=REPO, env=clean_env())
    try:
        assert wait_until(lambda: _listing(d, None) == 1, 30)
        p.kill()
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    assert wait_until(lambda: _listing(d, None) == 0, 10), "the killed bench's buffer stayed"


def test_op_read_times_one_sided_reads_and_checks_them() -> None:
    """Issue 19: the remote region is registered readable, the bytes read are checked."""
    r = bench("--op", "read", "--duration", "0.5", "--sizes", "4K,2MiB", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["op"] == "read"
    assert [x["size"] for x in j["results"]] == [4096, 2 << 20]
    for one in j["results"]:
        assert one["transfers"] > 0 and one["verified"] is True
    clean(r.stderr)


@pytest.mark.skipif(HAVE_MPL, reason="matplotlib is installed: the PNG test runs instead")
def test_plot_without_matplotlib_says_how_to_get_it(tmp_path: Path) -> None:
    r = bench("--duration", "0.3", "--plot", str(tmp_path / "t.png"))
    assert r.returncode == Exit.INSTALL
    assert "pip install 'transferd[plot]'" in r.stderr
    assert not (tmp_path / "t.png").exists()


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed (the plot extra)")
def test_plot_writes_a_png(tmp_path: Path) -> None:
    png = tmp_path / "t.png"
    r = bench("--duration", "0.5", "--sizes", "4K,64K", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("text", "n"), [("4096", 4096), ("64KiB", 64 << 10), ("4MiB", 4 << 20),
                                         ("1G", 1 << 30), ("2 mib", 2 << 20), ("4K", 4096)])
def test_sizes(text: str, n: int) -> None:
    assert parse_size(text) == n
