"""SIGHUP with memory.shm_limit_mib turned off, or on.

``memory.shm_limit_mib = 0`` serves no shm device.  A reload setting it to 0 answered
``applied memory.shm_limit_mib 64 -> 0``, yet the daemon went on handing out shared
buffers under the old 64 MiB (an operator turning shm off, for the cgroup charging its
pages get, was told it was done); one setting it from 0 said ``applied`` too, and no
shm device came.  Now 0 at a reload is a limit of 0 (no new shared buffer; those held
work on until freed), and from 0 is "needs a restart".
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from client import SyncClient
from tests.helpers import DaemonProcess
from tests.integration.test_cli import SERVE
from transferd.exits import Exit
from transferd.protocol.errors import OutOfMemory

BASE = "[server]\nport = 0\n[metrics]\nport = 0\n[memory]\n"


def _reload(d: DaemonProcess) -> str:
    assert d.proc is not None
    r = subprocess.run([sys.executable, "-m", "transferd.cli", "reload", str(d.proc.pid)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == Exit.OK, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_shm_turned_off_at_a_reload_is_off(tmp_path: Path) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text(BASE + "shm_limit_mib = 64\n")
    with DaemonProcess(command=[*SERVE, "-c", str(cfg), "--unix",
                                str(tmp_path / "u.sock")]) as d:
        assert d.unix_url is not None
        with SyncClient(d.unix_url, timeout=10) as c:
            held = c.alloc_buffer(1 << 20, device="shm")
            cfg.write_text(BASE + "shm_limit_mib = 0\n")
            assert "applied memory.shm_limit_mib 64 -> 0" in _reload(d)
            with pytest.raises(OutOfMemory):
                c.alloc_buffer(4096, device="shm")
            shm = [x for x in c.get_devices() if x["name"] == "shm"]
            assert shm and shm[0]["total"] == 0, shm
            # The one held before works on.
            c.set_tensor(held.tensor(0, 4096), b"\x42" * 4096)
            assert bytes(c.get_tensor(held.tensor(0, 4096))) == b"\x42" * 4096
            c.free_buffer(held)
            # Back on, within what it was started with: served again.
            cfg.write_text(BASE + "shm_limit_mib = 32\n")
            assert "applied memory.shm_limit_mib 0 -> 32" in _reload(d)
            c.free_buffer(c.alloc_buffer(1 << 20, device="shm"))
    assert "Traceback" not in d.stderr, d.output()


def test_shm_turned_on_at_a_reload_needs_a_restart(tmp_path: Path) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text(BASE + "shm_limit_mib = 0\n")
    with DaemonProcess(command=[*SERVE, "-c", str(cfg), "--unix",
                                str(tmp_path / "u.sock")]) as d:
        cfg.write_text(BASE + "shm_limit_mib = 64\n")
        said = _reload(d)
        assert "not applied, needs a restart: memory.shm_limit_mib 0 -> 64" in said, said
        assert "applied memory.shm_limit_mib" not in said.replace("not applied", ""), said
    assert "Traceback" not in d.stderr, d.output()
