"""benchmarks/attacks.py (issue 11's attacks replayed, ``python -m benchmarks.attacks``)
runs: one cheap attack, quick, end to end through its command line.  The replay itself
(every attack, minutes) is not part of the suite; docs/security.md has its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO


def test_the_replay_runs_one_cheap_attack(tmp_path: Path) -> None:
    out = tmp_path / "attacks.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.attacks", "--quick", "--only",
                        "expectations", "--json", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    (o,) = json.loads(out.read_text())
    assert o["name"] == "expectations" and o["before"].startswith("stalled the daemon 6.4 s")
    assert "the replay failed" not in o["now"], o
    assert o["bystander_max_ms"] is not None and o["numbers"]["bystander_rounds"] > 0
    assert "== expectations" in r.stdout and "now:" in r.stdout
