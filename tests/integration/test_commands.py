"""The operator's command lines against live daemons: ping, stats, buffers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from client import SyncClient
from tests.conftest import DaemonFactory
from tests.helpers import REPO
from tests.integration.test_cli import clean_env
from transferd.exits import Exit


def cli(*args: str, timeout: float = 30, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "transferd.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=clean_env(**env))


def test_ping_says_hello_and_times_round_trips(daemon_factory: DaemonFactory,
                                               tmp_path: Path) -> None:
    d = daemon_factory(env={"TRANSFERD_SERVER_TOKEN": "tok"})
    tok = tmp_path / "tok"
    tok.write_text("tok\n")
    tok.chmod(0o600)
    r = cli("ping", d.url, "-n", "7", "--token-file", str(tok))
    assert r.returncode == 0, r.stderr
    assert "protocol 1.2" in r.stdout and "engine" in r.stdout
    assert "7 round trips: min " in r.stdout
    j = json.loads(cli("ping", d.url, "-n", "3", "--json", TRANSFERD_TOKEN="tok").stdout)
    assert len(j["rtts"]) == 3 and 0 < j["min_s"] <= j["p50_s"] <= j["max_s"] < 5
    # A wrong token and an address nobody listens on: exit 1, the reason named.
    r = cli("ping", d.url, TRANSFERD_TOKEN="wrong")
    assert r.returncode == Exit.FAILURE and "UNAUTHORIZED" in r.stderr
    host, port = d.host_port
    d.stop()
    r = cli("ping", f"tcp://{host}:{port}", "--timeout", "2")
    assert r.returncode == Exit.FAILURE and f"{host}:{port}" in r.stderr


def test_stats_once_json_and_refreshes(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(["-m", "16"])
    with SyncClient(d.url) as c:
        c.alloc_buffer(1 << 20)
        r = cli("stats", d.url, "--once")
        assert r.returncode == 0, r.stderr
        assert "ALLOC_BUFFER" in r.stdout and "1.0 MiB" in r.stdout and "16.0 MiB" in r.stdout
        r = cli("stats", d.url, "--json", "--count", "3", "-i", "0.1")
        rows = [json.loads(line) for line in r.stdout.splitlines()]
        assert len(rows) == 3 and rows[0]["commands"]["ALLOC_BUFFER"] == 1
        assert rows[2]["commands"]["STATS"] == rows[0]["commands"]["STATS"] + 2
        cpu = next(x for x in rows[0]["devices"] if x["name"] == "cpu")
        assert cpu["total"] - cpu["free"] >= 1 << 20
        # Not a terminal: one table after another, each with its rates.
        r = cli("stats", d.url, "--count", "2", "-i", "0.1")
        assert r.stdout.count("transferd stats") == 2 and "/s" in r.stdout


def test_buffers_lists_device_size_owner_and_regions(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(["-m", "16"])
    with SyncClient(d.url) as a, SyncClient(d.url) as b:
        ba = a.alloc_buffer(64 << 10)
        bb = b.alloc_buffer(128 << 10)
        a.reg_mr(ba)
        j = json.loads(cli("buffers", d.url, "--json").stdout)
        assert j["truncated"] is False
        rows = {x["id"]: x for x in j["buffers"]}
        assert rows[ba.id]["size"] == 64 << 10 and rows[bb.id]["size"] == 128 << 10
        assert rows[ba.id]["device"] == "cpu"
        a_addr = rows[ba.id]["allocated_by"]
        assert a_addr.startswith("127.0.0.1:") and a_addr != rows[bb.id]["allocated_by"]
        [region] = rows[ba.id]["regions"]
        assert region["size"] == 64 << 10 and len(region["rkeys"]) == 1
        assert rows[bb.id]["regions"] == []
        text = cli("buffers", d.url).stdout
        assert a_addr in text and "2 buffer(s): 192.0 KiB on cpu" in text
