"""``make gpu-check`` must work the first time it meets a GPU: its plumbing runs here.

The dry run (forced, so a machine with a GPU takes the same path) drives the
sections that can run on host memory (round trips, engine writes, watcher
latency) through the same code, issue 24's sections (cancel, fault,
sync_copies, copy_host) against the tests' stand-in device, and writes the
report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO


def test_gpu_check_dry_run_writes_its_report(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    env.update(PYTHON=sys.executable, OUT=str(tmp_path))
    r = subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nothing ran on a GPU" in r.stdout
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    assert report["dry_run"] is True and report["reason"]
    status = {s["section"]: s["status"] for s in report["sections"]}
    assert set(status) == {"env", "tests", "roundtrip", "engine", "ipc", "copies", "watcher",
                           "bandwidth", "cancel", "fault", "sync_copies", "ipc_offset",
                           "copy_host"}
    assert "failed" not in status.values(), report
    res = {s["section"]: s.get("results", {}) for s in report["sections"]}
    assert res["roundtrip"]["1048576"]["ok"] and res["engine"]["ok"]
    assert res["watcher"]["seen"] >= 180
    # Issue 24's sections ran their scenarios on the stand-in device.
    assert res["cancel"]["set_checksum_mismatches"] == 0 and res["cancel"]["rounds"] >= 4
    assert "ok" not in res["fault"]["after_the_fault"].values()
    assert res["fault"]["host_served_after"] is True
    assert res["sync_copies"]["device_to_remote_wrong"] == 0
    assert res["sync_copies"]["remote_to_device_wrong"] == 0
    assert res["copy_host"]["checksums_ok"] is True
    md = (tmp_path / "gpu-report.md").read_text()
    assert "Dry run: no CUDA device" in md
