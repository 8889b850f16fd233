"""A real Prometheus scrapes a live daemon with deploy/prometheus/ as shipped: every series
arrives, every alert rule and every dashboard query evaluates against them, and promtool
accepts the live exposition, the rules (with their unit tests) and the scrape config.

Prometheus is Debian's ``prometheus`` package: installed here when missing (as root, with
apt-get), skipped with the reason only where it cannot be.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client import Client
from tests.helpers import REPO, DaemonProcess, run, start_daemon
from transferd.protocol.errors import OutOfBounds
from transferd.protocol.messages import Tensor

PROMETHEUS = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "transferd.json"


def _install() -> str | None:
    """Install Debian's prometheus when missing; None when it is there, else why not."""
    if shutil.which("prometheus") and shutil.which("promtool"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "prometheus is not installed and this is not root with apt-get to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "prometheus"]):
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
        except subprocess.TimeoutExpired:
            return f"{' '.join(argv)} timed out"
        if r.returncode != 0:
            return f"{' '.join(argv)} failed: {r.stderr.strip()[-300:]}"
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        return "apt-get installed prometheus but prometheus/promtool are not on PATH"
    return None


@pytest.fixture(scope="module")
def promtool() -> str:
    why = _install()
    if why:
        pytest.skip(why)
    return str(shutil.which("promtool"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


class Prom:
    def __init__(self, base: str) -> None:
        self.base = base

    def api(self, path: str, **params: str) -> Any:
        q = urllib.parse.urlencode(params)
        return _get(f"{self.base}/api/v1/{path}?{q}")

    def query(self, expr: str) -> Any:
        out = self.api("query", query=expr)
        assert out["status"] == "success", (expr, out)
        return out["data"]["result"]


def _traffic(d: DaemonProcess) -> None:
    """Commands, an error, buffers and an engine transfer: every family gets its series."""

    async def go() -> None:
        c = await Client.connect(d.url)
        try:
            a, b = await c.alloc_buffer(1 << 20), await c.alloc_buffer(1 << 20)
            await c.set_tensor(a.tensor(0, 4096), bytes(4096))
            (ma, _), (_, db) = await c.reg_mr(a), await c.reg_mr(b)
            w = await c.submit_single_write(4096, 7, (ma, 0), (db, 0))
            await w.wait(10)
            await c.get_tensor(b.tensor(0, 4096))
            with pytest.raises(OutOfBounds):  # from the daemon: an error series
                await c.get_tensor(Tensor(b.id, (1 << 20) - 8, 16))
        finally:
            await c.close()

    run(go(), timeout=30)


@pytest.fixture(scope="module")
def live(promtool: str) -> Iterator[tuple[DaemonProcess, Prom]]:
    d = start_daemon(["-m", "64"])
    assert d.metrics_url is not None
    target = d.metrics_url.split("//")[1].split("/")[0]
    tmp = Path(tempfile.mkdtemp(prefix="transferd-prom-"))
    # The shipped scrape config, pointed at the live daemon and scraped every second.
    text = (PROMETHEUS / "scrape.yml").read_text()
    text = text.replace('          - "node-a.example:18516"\n          - "node-b.example:18516"',
                        f'          - "{target}"')
    text = text.replace("scrape_interval: 15s", "scrape_interval: 1s")
    text = text.replace("scrape_timeout: 5s", "scrape_timeout: 1s")
    text = text.replace("  - alerts.yml", f"  - {PROMETHEUS / 'alerts.yml'}")
    assert target in text and str(PROMETHEUS / "alerts.yml") in text, "scrape.yml changed shape"
    cfg = tmp / "prometheus.yml"
    cfg.write_text("global:\n  evaluation_interval: 1s\n" + text)
    port = _free_port()
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    prom = Prom(f"http://127.0.0.1:{port}")
    try:
        _traffic(d)
        deadline = time.monotonic() + 30
        while True:
            try:
                up = prom.query('up{job="transferd"}')
                # Two scrapes after the traffic, so rate() has two points.
                if up and up[0]["value"][1] == "1" and prom.query(
                        'count_over_time(up{job="transferd"}[1m]) >= 3'):
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()
            assert time.monotonic() < deadline, (tmp / "prometheus.log").read_text()
            time.sleep(0.2)
        yield d, prom
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _exported_names(d: DaemonProcess) -> set[str]:
    assert d.metrics_url is not None
    with urllib.request.urlopen(d.metrics_url, timeout=5) as r:
        text = r.read().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_prometheus_has_every_series_the_daemon_exports(live: tuple[DaemonProcess, Prom]
                                                        ) -> None:
    d, prom = live
    names = set(prom.api("label/__name__/values", **{"match[]": '{job="transferd"}'})["data"])
    missing = _exported_names(d) - names
    assert not missing, missing
    # The shipped relabelling gives each series its node.
    [series] = prom.query('transferd_open_connections{job="transferd"}')
    assert series["metric"]["node"] == "127.0.0.1"


def test_every_alert_rule_evaluates(live: tuple[DaemonProcess, Prom]) -> None:
    _, prom = live
    groups = prom.api("rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 11
    deadline = time.monotonic() + 10
    while any(r.get("lastEvaluation", "").startswith("0001") for r in rules):
        assert time.monotonic() < deadline, "rules not evaluated"
        time.sleep(0.2)
        rules = [r for g in prom.api("rules")["data"]["groups"] for r in g["rules"]]
    for r in rules:
        assert r["health"] == "ok", (r["name"], r.get("lastError"))
        prom.query(r["query"])
    # A healthy daemon fires nothing (TransferdDown would mean the scrape failed).
    firing = [r["name"] for r in rules if r.get("state") == "firing"]
    assert "TransferdDown" not in firing, firing


def test_every_dashboard_query_finds_real_series(live: tuple[DaemonProcess, Prom]) -> None:
    d, prom = live
    known = _exported_names(d) | {"up"}
    dash = json.loads(DASHBOARD.read_text())
    checked = 0
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            expr = (t["expr"].replace("$job", "transferd").replace("$instance", ".*")
                    .replace("$__rate_interval", "1m"))
            for name in re.findall(r"\b(transferd_[a-z_]+|up)\b(?=\s*[{(\[]|\s*$|\s*\))",
                                   expr):
                assert name in known, f"panel {panel['title']!r}: {name} is not exported"
            prom.query(expr)
            # The series a panel draws exist (the query's filters aside).
            base = re.sub(r"\s*>\s*0\s*$", "", expr)
            if "histogram_quantile" not in base and "/" not in base:
                assert prom.query(base), f"panel {panel['title']!r}: no data for {expr}"
            checked += 1
    assert checked >= 20


def test_promtool_checks_the_live_exposition(live: tuple[DaemonProcess, Prom],
                                             promtool: str) -> None:
    d, _ = live
    assert d.metrics_url is not None
    with urllib.request.urlopen(d.metrics_url, timeout=5) as r:
        text = r.read()
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         timeout=30)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def test_promtool_checks_rules_and_the_scrape_config_as_shipped(promtool: str) -> None:
    for argv in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"],
                 ["check", "config", "scrape.yml"]):
        r = subprocess.run([promtool, *argv], cwd=PROMETHEUS, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, (argv, r.stdout + r.stderr)
