"""Under journald and systemctl reload (issue 23, item 3).

The journal: a daemon whose stderr is the stream JOURNAL_STREAM names writes ``<N>``
syslog priorities and no timestamp of its own (a file stands in for the journal's
stream: the daemon can only tell by dev:inode, which is what the test sets).  Reloads:
RELOADING=1 with MONOTONIC_USEC then READY=1 over a real notify socket, and
``transferd reload PID`` returning once the reload is done, failing when it was refused,
deaf to answers from anyone but the daemon.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client import SyncClient
from tests.helpers import REPO, DaemonProcess, metric, scrape, wait_until
from tests.integration import test_systemd
from tests.integration.test_cli import SERVE, clean_env
from tests.integration.test_systemd import NotifySocket
from transferd.exits import Exit
from transferd.lifecycle import reload_socket
from transferd.logs import priority

STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
RELOAD = [sys.executable, "-m", "transferd.cli", "reload"]
notify = test_systemd.notify  # the fixture: a datagram socket standing in for systemd's


def _journal_env(path: Path, **extra: str) -> dict[str, str]:
    st = os.stat(path)
    return clean_env(JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}", PYTHONUNBUFFERED="1", **extra)


def _serve(cfg: Path, log: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([*SERVE, "-c", str(cfg)], stdout=subprocess.PIPE, stderr=log.open("a"),
                            text=True, env=env, cwd=REPO)


def _ready(p: subprocess.Popen[str]) -> str:
    assert p.stdout is not None
    url = ""
    for line in p.stdout:
        if line.startswith("transferd: listening on tcp://") and not url:
            url = line.split()[-1]
        if line.strip() == "transferd: ready":
            return url
    raise AssertionError("the daemon did not start")


def test_priorities() -> None:
    assert [priority(n) for n in (10, 20, 30, 40, 50, 25)] == [7, 6, 4, 3, 2, 6]


def test_under_journald_lines_carry_their_priority_and_no_timestamp(tmp_path: Path) -> None:
    log = tmp_path / "journal"
    log.touch()
    tok = tmp_path / "token"
    tok.write_text("right")
    tok.chmod(0o600)
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[server]\nport = 0\ntoken_file = "{tok}"\n[metrics]\nport = 0\n')
    p = _serve(cfg, log, _journal_env(log))
    try:
        url = _ready(p)
        with pytest.raises(Exception, match="token is wrong"):  # a WARNING
            SyncClient.connect(url, token="wrong")
        cfg.write_text("[server]\nport = \"x\"\n")  # an ERROR
        p.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "running one stays" in log.read_text(), 10)
    finally:
        p.terminate()
        assert p.wait(30) == 0
    lines = log.read_text().splitlines()
    assert lines and all(re.match(r"<[2-7]>", ln) for ln in lines), lines
    assert not any(STAMP.search(ln) for ln in lines), lines
    by = {ln[:3] for ln in lines}
    assert {"<6>", "<4>", "<3>"} <= by, lines
    assert any(ln.startswith("<4>WARNING transferd.auth: ") for ln in lines)
    assert any(ln.startswith("<3>ERROR transferd: SIGHUP: the configuration is invalid")
               for ln in lines)


def test_a_stream_that_is_not_the_journal_keeps_plain_lines(tmp_path: Path) -> None:
    log, other = tmp_path / "log", tmp_path / "other"
    log.touch()
    other.touch()
    cfg = tmp_path / "t.toml"
    cfg.write_text("[server]\nport = 0\n[metrics]\nport = 0\n")
    # JOURNAL_STREAM inherited by a process whose stderr went elsewhere: not the journal.
    p = _serve(cfg, log, _journal_env(other))
    try:
        _ready(p)
    finally:
        p.terminate()
        p.wait(30)
    lines = log.read_text().splitlines()
    assert lines and all(STAMP.match(ln) for ln in lines), lines


def test_why_it_did_not_start_is_an_error_in_the_journal(tmp_path: Path) -> None:
    log = tmp_path / "journal"
    log.touch()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = tmp_path / "t.toml"
        cfg.write_text(f"[server]\nport = {taken.getsockname()[1]}\n[metrics]\nport = 0\n")
        r = subprocess.run([*SERVE, "-c", str(cfg)], stderr=log.open("a"),
                           stdout=subprocess.DEVNULL, env=_journal_env(log), timeout=60)
    assert r.returncode == Exit.BIND
    assert log.read_text().startswith("<3>transferd: cannot start: server.port: ")


def test_every_line_of_a_fatal_message_is_an_error(tmp_path: Path) -> None:
    """A ConfigError of two problems is two lines ("transferd: configuration error: ..."):
    the second had no priority, so journald filed it at info and `journalctl -p err`
    showed half of why the daemon stopped."""
    log = tmp_path / "journal"
    log.touch()
    code = ("from transferd.config import ConfigError; from transferd.logs import fatal; "
            "fatal(f'transferd: configuration error: {ConfigError([\"a.b: one\", \"c.d: two\"])}')")
    subprocess.run([sys.executable, "-c", code], stderr=log.open("a"), env=_journal_env(log),
                   timeout=60, cwd=REPO, check=True)
    assert log.read_text().splitlines() == ["<3>transferd: configuration error: a.b: one",
                                            "<3>c.d: two"]


# -- reloads -----------------------------------------------------------------------------


def test_a_reload_says_when_it_began_and_when_it_ended(tmp_path: Path,
                                                       notify: NotifySocket) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text("[server]\nport = 0\n[metrics]\nport = 0\n")
    with DaemonProcess(command=[*SERVE, "-c", str(cfg)],
                       env={"NOTIFY_SOCKET": notify.path}) as d:
        assert d.proc is not None
        assert wait_until(lambda: notify.count("READY=1") == 1, 5)
        cfg.write_text("[server]\nport = 0\n[metrics]\nport = 0\n[log]\nlevel = \"debug\"\n")
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        d.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: notify.count("READY=1") == 2, 5), notify.messages
        after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        msgs = notify.messages
        i = next(k for k, m in enumerate(msgs) if "RELOADING=1" in m)
        j = max(k for k, m in enumerate(msgs) if "READY=1" in m)
        assert i < j, msgs
        usec = int(re.search(r"MONOTONIC_USEC=(\d+)", msgs[i]).group(1))  # type: ignore[union-attr]
        assert before <= usec <= after
        assert "STATUS=serving (reloaded)" in msgs[j]


def test_transferd_reload_waits_for_the_reload_and_reports_a_refused_one(tmp_path: Path) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text("[server]\nport = 0\n[metrics]\nport = 0\n")
    with DaemonProcess(command=[*SERVE, "-c", str(cfg)]) as d:
        assert d.proc is not None and d.metrics_url is not None
        pid = str(d.proc.pid)
        started = metric(scrape(d.metrics_url),
                         "transferd_config_last_reload_success_timestamp_seconds")
        cfg.write_text("[server]\nport = 0\n[metrics]\nport = 0\n[memory]\n"
                       "host_limit_mib = 64\n")
        r = subprocess.run([*RELOAD, pid], capture_output=True, text=True, timeout=60,
                           env=clean_env())
        assert r.returncode == 0, r.stderr
        assert "reloaded: applied memory.host_limit_mib 4096 -> 64" in r.stdout
        # Done when it returned: the new limit is served at once.
        with SyncClient.connect(d.url) as c:
            assert c.get_devices()[0]["total"] == 64 << 20
        m = scrape(d.metrics_url)
        assert metric(m, "transferd_config_last_reload_successful") == 1
        assert metric(m, "transferd_config_last_reload_success_timestamp_seconds") > started
        cfg.write_text("[memory]\nhost_limit_mib = -5\n")
        r = subprocess.run([*RELOAD, pid], capture_output=True, text=True, timeout=60,
                           env=clean_env())
        assert r.returncode == Exit.FAILURE
        assert "refused: the configuration is invalid, the running one stays: " \
               "memory.host_limit_mib" in r.stderr
        assert metric(scrape(d.metrics_url), "transferd_config_last_reload_successful") == 0
        with SyncClient.connect(d.url) as c:  # still the one it ran
            assert c.get_devices()[0]["total"] == 64 << 20
    assert d.returncode == 0


def test_transferd_reload_takes_no_answer_but_the_daemons(tmp_path: Path) -> None:
    # Looks like a daemon (its name, a SIGHUP handler) but never answers.
    fake = tmp_path / "transferd-fake.py"
    fake.write_text("import signal, time\nsignal.signal(signal.SIGHUP, lambda *a: None)\n"
                    "print('up', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([sys.executable, str(fake)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "up\n"
        waiter = subprocess.Popen([*RELOAD, str(p.pid), "--timeout", "2"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=clean_env())
        # Someone else claims to be it: ignored (the kernel says who sent it).
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            assert wait_until(lambda: _sent(s, reload_socket(p.pid)), 5)
        out, err = waiter.communicate(timeout=30)
        assert waiter.returncode == Exit.FAILURE, out
        assert "did not say within 2 s" in err
        r = subprocess.run([*RELOAD, "999999"], capture_output=True, text=True, timeout=30,
                           env=clean_env())
        assert r.returncode == Exit.FAILURE and "No such process" in r.stderr
    finally:
        p.kill()
        p.wait()


def _sent(s: socket.socket, addr: bytes) -> bool:
    try:
        s.sendto(b"ok forged", addr)
    except OSError:
        return False  # the waiter has not bound it yet
    return True


def test_transferd_reload_never_signals_a_process_that_is_not_a_daemon(tmp_path: Path) -> None:
    """A mistyped PID: SIGHUP's default action ends a process, so `transferd reload` of a
    shell, a `sleep`, or a daemon still starting (its handler not yet installed) used to
    kill it and then wait 30 s.  Now it checks first: the process must catch SIGHUP and be
    transferd's (its command line), else exit 1 naming why, and nothing is sent."""
    # SIGHUP's default action, whatever this test inherited (under nohup it is ignored).
    sleeper = subprocess.Popen(["sleep", "60"],
                               preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    # Catches SIGHUP (sshd, nginx do) but is not transferd: it must not be told to reload.
    other = tmp_path / "other-service.py"
    other.write_text("import signal, time\nsignal.signal(signal.SIGHUP, lambda *a: "
                     "print('reloaded', flush=True))\nprint('up', flush=True)\ntime.sleep(60)\n")
    service = subprocess.Popen([sys.executable, str(other)], stdout=subprocess.PIPE, text=True)
    try:
        assert service.stdout is not None and service.stdout.readline() == "up\n"
        for p, why in ((sleeper, "does not handle SIGHUP"), (service, "not transferd")):
            r = subprocess.run([*RELOAD, str(p.pid), "--timeout", "2"], capture_output=True,
                               text=True, timeout=30, env=clean_env())
            assert r.returncode == Exit.FAILURE, r
            assert why in r.stderr and "nothing sent" in r.stderr, r.stderr
            time.sleep(0.2)
            assert p.poll() is None, f"transferd reload killed {p.args}"
        service.kill()
        out, _ = service.communicate(timeout=5)
        assert "reloaded" not in out
    finally:
        for p in (sleeper, service):
            p.kill()
            p.wait()
