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


def test_doctor_passes_the_defaults_here(tmp_path: Path) -> None:
    token = tmp_path / "token"  # the example's /etc/transferd/token, here
    token.write_text("a-token")
    token.chmod(0o600)
    r = cli("doctor", "-c", str(REPO / "config" / "examples" / "service.toml"),
            TRANSFERD_SERVER_TOKEN_FILE=str(token))
    assert r.returncode in (Exit.OK, Exit.FAILURE), r.stderr
    lines = r.stdout.splitlines()
    assert all(line.split()[0] in ("ok", "warn", "FAIL") for line in lines[:-1]), lines
    for check in ("start-up", "memlock", "secrets", "checksums", "numa", "nics", "gpus",
                  "rdma"):
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


# -- on a live node ------------------------------------------------------------------


def _live_config(tmp_path: Path, token: str) -> Path:
    from tests.integration.test_startup import free_port

    tok = tmp_path / "token"
    tok.write_text(token)
    tok.chmod(0o600)
    cfg = tmp_path / "live.toml"
    cfg.write_text(f'[server]\nport = {free_port()}\ntoken_file = "{tok}"\n'
                   f"[metrics]\nport = {free_port()}\n[engine]\npeer_port = {free_port()}\n")
    return cfg


def test_doctor_right_after_the_start_finds_the_daemon_not_a_problem(tmp_path: Path) -> None:
    """The getting-started order: restart, then doctor. Its ports are taken by it."""
    from tests.helpers import DaemonProcess, scrape
    from tests.integration.test_cli import SERVE

    cfg = _live_config(tmp_path, "live-token")
    with DaemonProcess(command=[*SERVE, "-c", str(cfg)]) as d:
        r = cli("doctor", "-c", str(cfg), "--json")
        assert r.returncode == Exit.OK, r.stdout + r.stderr
        checks = {(c["level"], c["check"], c["detail"]) for c in json.loads(r.stdout)}
        running = [d for lv, c, d in checks if c == "running" and lv == "ok"]
        assert any(x.startswith("server.port: transferd/") and "accepts this configuration's "
                   "token" in x for x in running), checks
        assert any(x.startswith("metrics.port: ") for x in running), checks
        assert any(x.startswith("engine.peer_port: the running daemon's rails are")
                   for x in running), checks
        assert ("ok", "secrets", "clients prove the token of server.token_file") in checks
        # Asking cost the daemon no failed authentication, and no log line.
        assert d.metrics_url is not None
        m = scrape(d.metrics_url)
        assert sum(v for k, v in m.items() if k.startswith("transferd_auth_failures")) == 0
        assert "transferd.auth" not in d.stderr


def test_doctor_says_when_the_running_daemon_has_another_token(tmp_path: Path) -> None:
    from tests.helpers import DaemonProcess
    from tests.integration.test_cli import SERVE

    cfg = _live_config(tmp_path, "the-old-token")
    with DaemonProcess(command=[*SERVE, "-c", str(cfg)]):
        (tmp_path / "token").write_text("a-new-token")  # rotated, not yet reloaded
        r = cli("doctor", "-c", str(cfg))
    assert r.returncode == Exit.FAILURE
    assert "refuses this configuration's token" in r.stdout and "systemctl reload" in r.stdout


def test_a_port_held_by_another_program_stays_a_failure(tmp_path: Path) -> None:
    from tests.integration.test_startup import held_port

    with held_port() as s:
        cfg = tmp_path / "c.toml"
        cfg.write_text(f"[server]\nport = {s.getsockname()[1]}\n")
        r = cli("doctor", "-c", str(cfg))
    assert r.returncode == Exit.FAILURE
    assert "FAIL  start-up: server.port: cannot listen on" in r.stdout
    assert "does not answer as transferd" in r.stdout


def test_an_address_the_start_up_check_takes_is_on_an_interface(tmp_path: Path) -> None:
    # 127.0.0.2: no interface lists it (lo has 127.0.0.1/8), every check must agree.
    cfg = tmp_path / "c.toml"
    cfg.write_text('[engine]\nhost_rails = ["127.0.0.2"]\n')
    assert cli("check-config", str(cfg)).returncode == Exit.OK
    r = cli("doctor", "-c", str(cfg), "--json")
    checks = json.loads(r.stdout)
    assert not [c for c in checks if c["level"] == "FAIL"], checks
    r = cli("devices", "-c", str(cfg), "--json")
    nics = json.loads(r.stdout)["nics"]
    assert {"config": "engine.host_rails[0]", "address": "127.0.0.2", "nic": "lo"} \
        in nics["items"], nics


def test_no_example_carries_a_secret() -> None:
    """A TOML file is world-readable (0644 as installed): secrets go in files of their own."""
    import tomllib

    for path in sorted((REPO / "config").rglob("*.toml")):
        cfg = tomllib.loads(path.read_text())
        for section in cfg.values():
            for key in ("token", "secret"):
                assert not section.get(key), f"{path.name}: {key} in the file"
