#!/usr/bin/env python3
"""Check that deploy/ and the docs name only metrics and config keys that exist.

    python docs/tools/check_deploy.py

- Every ``transferd_*`` series named in deploy/prometheus/*.yml,
  deploy/grafana/transferd.json and docs/operations.md is one the daemon
  exports (taken from a fresh ``transferd.metrics.Metrics`` registry, so
  ``_total``, ``_bucket``, ``_created`` ... are as prometheus_client writes them).
- Every metric the daemon exports is documented in docs/operations.md and
  shown on the dashboard.
- The dashboard is valid JSON and every panel has a query.
- config/transferd.toml holds every key of transferd.config.Config with its
  default value, each with its TRANSFERD_* variable in a comment, and
  docs/configuration.md names every key and variable.

Exits 1 with a list of problems, 0 when all is well.  Needs only the project's
own virtual environment (no YAML library: files are scanned as text).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from transferd.config import Config, load  # noqa: E402
from transferd.domains.base import LinkStats  # noqa: E402
from transferd.domains.group import GroupStats  # noqa: E402
from transferd.engine.inflight import InFlight  # noqa: E402
from transferd.engine.watchers import Watchers  # noqa: E402
from transferd.fds import LinkBudget  # noqa: E402
from transferd.metrics import Metrics  # noqa: E402
from transferd.workers import Slots  # noqa: E402

SERIES = re.compile(r"\btransferd_[a-z_]+\b")
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def exported() -> tuple[set[str], set[str]]:
    """(every series name the daemon can export, the metric family names)."""
    names: set[str] = set()
    families: set[str] = set()
    m = Metrics()
    # The engine's series are read from a running engine: a stand-in with one rail,
    # which reports what a group and its Domains report (GroupStats, LinkStats).
    group = SimpleNamespace(stats=lambda: GroupStats(links=(LinkStats(),)),
                            link_budget=LinkBudget(64))
    receives = SimpleNamespace(waiting=0, waiting_bytes=0, expired=0, free_receives=lambda: 0)
    m.watch_engine(SimpleNamespace(  # type: ignore[arg-type]
        group=group, groups=[group], worker=None, receives=receives,
        expectations_pending=lambda: 0, inflight=InFlight(time.monotonic), slots=Slots(),
        peer_slots=None))
    m.registry.register(Watchers())  # the RPC front end registers the daemon's watcher set
    for metric in m.registry.collect():
        families.add(metric.name)
        names.add(metric.name)
        # A labelled metric has no samples until a child exists: name its series
        # by type.  _created comes with prometheus_client's own Counter only.
        if metric.type == "counter":
            names |= {metric.name + "_total", metric.name + "_created"}
        elif metric.type == "histogram":
            names |= {metric.name + s for s in ("_bucket", "_count", "_sum")}
        names |= {s.name for s in metric.samples}
    return names, families


def family_of(series: str, families: set[str]) -> str:
    for suffix in SUFFIXES:
        if series.endswith(suffix) and series[: -len(suffix)] in families:
            return series[: -len(suffix)]
    return series


def main() -> int:
    problems: list[str] = []
    names, families = exported()

    files = [
        REPO / "deploy/prometheus/alerts.yml",
        REPO / "deploy/prometheus/alerts_test.yml",
        REPO / "deploy/prometheus/scrape.yml",
        REPO / "deploy/grafana/transferd.json",
        REPO / "docs/operations.md",
    ]
    # Words of that shape that are not series: label values, file names, the job name.
    not_series = {"transferd_alerts", "transferd_alerts_test"}
    for path in files:
        text = path.read_text()
        for series in sorted(set(SERIES.findall(text)) - not_series):
            if series not in names:
                problems.append(f"{path.relative_to(REPO)}: unknown metric {series}")

    dash_path = REPO / "deploy/grafana/transferd.json"
    dash = json.loads(dash_path.read_text())
    shown: set[str] = set()
    for panel in dash["panels"]:
        if panel.get("type") == "row":
            continue
        exprs = [t.get("expr", "") for t in panel.get("targets", [])]
        if not exprs or not all(exprs):
            problems.append(f"dashboard panel {panel.get('title')!r} has no query")
        for e in exprs:
            shown |= {family_of(s, families) for s in SERIES.findall(e)}
    ops = (REPO / "docs/operations.md").read_text()
    documented = {family_of(s, families) for s in SERIES.findall(ops)}
    for fam in sorted(families):
        if fam not in documented:
            problems.append(f"docs/operations.md does not document {fam}")
        if fam not in shown:
            problems.append(f"deploy/grafana/transferd.json does not show {fam}")

    toml_path = REPO / "config/transferd.toml"
    if load(toml_path, env={}) != Config():
        problems.append("config/transferd.toml: values differ from the embedded defaults")
    toml = toml_path.read_text()
    conf_doc = (REPO / "docs/configuration.md").read_text()
    for sec in dataclasses.fields(Config):
        for key in dataclasses.fields(getattr(Config(), sec.name)):
            env = f"TRANSFERD_{sec.name.upper()}_{key.name.upper()}"
            if not re.search(rf"^{key.name} = ", toml, re.M):
                problems.append(f"config/transferd.toml lacks {sec.name}.{key.name}")
            if env not in toml:
                problems.append(f"config/transferd.toml does not name {env}")
            if f"`{sec.name}.{key.name}`" not in conf_doc or env not in conf_doc:
                problems.append(f"docs/configuration.md does not document {sec.name}.{key.name}")

    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 1
    print(f"deploy/ and docs: {len(families)} metrics and every config key check out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
