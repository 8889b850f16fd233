"""transferd doctor and transferd devices on this machine as it is."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO
from tests.integration.test_cli import clean_env
from transferd import config as cfgmod
from transferd.commands import doctor, probes
from transferd.exits import Exit


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "transferd.cli", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env=clean_env(**env))


def test_doctor_passes_the_defaults_here() -> None:
    r = cli("doctor", "-c", str(REPO / "config" / "examples" / "service.toml"))
    assert r.returncode in (Exit.OK, Exit.FAILURE), r.stderr
    lines = r.stdout.splitlines()
    assert all(line.split()[0] in ("ok", "warn", "FAIL") for line in lines[:-1]), lines
    for check in ("start-up", "memlock", "secrets", "numa", "nics", "gpus", "rdma"):
        assert any(line.split()[1].rstrip(":") == check for line in lines[:-1]), check
    fails = [line for line in lines if line.startswith("FAIL")]
    assert (r.returncode == Exit.OK) == (not fails), r.stdout


def test_doctor_fails_on_what_the_config_needs(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        secret = tmp_path / "secret"
        secret.write_text("x" * 40)
        secret.chmod(0o644)
        cfg = tmp_path / "c.toml"
        cfg.write_text(f"[server]\nport = {port}\n[engine]\n"
                       f"host_rails = [\"127.0.0.1\", \"192.0.2.99\"]\n"
                       f"secret_file = \"{secret}\"\n")
        r = cli("doctor", "-c", str(cfg), "--json")
    assert r.returncode == Exit.FAILURE, r.stdout + r.stderr
    checks = json.loads(r.stdout)
    fails = [c["detail"] for c in checks if c["level"] == "FAIL"]
    assert any("engine.host_rails[1]: 192.0.2.99 is not an address of this machine" in f
               for f in fails), fails
    warns = [c for c in checks if c["level"] == "warn"]
    assert any(c["check"] == "permissions engine.secret_file" and "chmod 600" in c["detail"]
               for c in warns), checks
    # For another node only what is wrong anywhere counts: a readable-by-others secret warns.
    r = cli("doctor", "-c", str(cfg), "--other-node")
    assert r.returncode == Exit.OK, r.stdout


def test_doctor_on_an_invalid_config_exits_3(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[server]\nprot = 1\n")
    r = cli("doctor", "-c", str(cfg))
    assert r.returncode == Exit.CONFIG and "server.prot: unknown key" in r.stdout


def test_a_registered_probe_that_finds_something_missing_fails_doctor() -> None:
    def widgets(config: cfgmod.Config | None) -> probes.Section:
        sec = probes.Section("widgets", note="none here")
        if config is not None:
            sec.needed.append("widgets.count: needs a widget, this machine has none")
        return sec

    probes.register("widgets")(widgets)
    try:
        checks = doctor.diagnose(cfgmod.load(env={}))
        assert ("FAIL", "widgets", "widgets.count: needs a widget, this machine has none") \
            in checks
    finally:
        del probes.PROBES["widgets"]


def test_devices_lists_numa_nodes_nics_gpus_and_rdma() -> None:
    r = cli("devices", "--json")
    j = json.loads(r.stdout)
    assert {"usable", "devices", "reason"} <= set(j)  # the RDMA report, as --rdma gives it
    assert j["numa"]["items"] or j["numa"]["note"]
    names = [n["name"] for n in j["nics"]["items"] if "name" in n]
    assert "lo" in names
    lo = next(n for n in j["nics"]["items"] if n.get("name") == "lo")
    assert "127.0.0.1" in lo["addresses"] or "addresses unknown" in j["nics"]["note"]
    # What the default config would use: server.host on lo.
    assert {"config": "server.host", "address": "127.0.0.1", "nic": "lo"} in j["nics"]["items"]
    assert j["gpus"]["items"] or j["gpus"]["note"]
    assert r.returncode == (Exit.OK if j["usable"] else Exit.FAILURE)
    text = cli("devices").stdout
    for head in ("rdma:", "numa:", "nics:", "gpus:"):
        assert head in text
