"""transferd bench: two daemons it starts, or a given peer; the summary and the plot."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DaemonFactory
from tests.helpers import REPO
from tests.integration.test_cli import clean_env
from transferd.commands.bench import parse_size
from transferd.exits import Exit

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "transferd.cli", "bench", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=clean_env())


def test_bench_between_two_daemons_it_starts() -> None:
    r = bench("--duration", "0.5", "--size", "256KiB", "--window", "4", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["writes"] > 0 and j["bytes"] == j["writes"] * (256 << 10)
    assert j["verified"] is True and j["gib_per_s"] > 0
    assert 0 < j["p50_ms"] <= j["p99_ms"] <= j["max_ms"]
    assert "bench" in r.stderr  # the progress bar's label


def test_bench_to_a_given_peer_prints_a_table(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(["-m", "64"])
    r = bench("--peer", d.url, "--duration", "0.3", "--size", "64KiB")
    assert r.returncode == 0, r.stderr
    assert f"destination   {d.url}" in r.stdout
    assert "throughput" in r.stdout and "bytes landed  match the source" in r.stdout


@pytest.mark.skipif(HAVE_MPL, reason="matplotlib is installed: the PNG test runs instead")
def test_plot_without_matplotlib_says_how_to_get_it(tmp_path: Path) -> None:
    r = bench("--duration", "0.3", "--plot", str(tmp_path / "t.png"))
    assert r.returncode == Exit.INSTALL
    assert "pip install 'transferd[plot]'" in r.stderr
    assert not (tmp_path / "t.png").exists()


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed (the plot extra)")
def test_plot_writes_a_png(tmp_path: Path) -> None:
    png = tmp_path / "t.png"
    r = bench("--duration", "0.5", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("text", "n"), [("4096", 4096), ("64KiB", 64 << 10), ("4MiB", 4 << 20),
                                         ("1G", 1 << 30), ("2 mib", 2 << 20)])
def test_sizes(text: str, n: int) -> None:
    assert parse_size(text) == n
