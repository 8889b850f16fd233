"""SIGHUP with a configuration the daemon must refuse whole (docs/security.md, stop 39).

``serve`` refuses a memory.host_limit_mib over the machine's memory (preflight), but
the key is reloadable and the reload never asked: a SIGHUP with 100000000 MiB answered
``applied memory.host_limit_mib 64 -> 100000000`` and GET_DEVICES promised 95 TiB.
Now the reload asks what the start asks of its keys and keeps the running
configuration, every key of it (the file's other changes are not applied either).
The rest are regressions of what held: a file gone, a value of the wrong type, one
past its bound, a file over the size cap, a key that needs a restart.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from client import SyncClient
from tests.helpers import DaemonProcess
from tests.integration.test_cli import SERVE
from transferd.config import MAX_CONFIG_FILE
from transferd.exits import Exit
from transferd.preflight import machine_memory

BASE = "[metrics]\nport = 0\n[server]\nport = 0\n"  # (more [server] keys may follow)


def _reload(d: DaemonProcess, ok: bool) -> str:
    assert d.proc is not None
    r = subprocess.run([sys.executable, "-m", "transferd.cli", "reload", str(d.proc.pid),
                        "--timeout", "10"], capture_output=True, text=True, timeout=30)
    out = r.stdout + r.stderr
    assert r.returncode == (Exit.OK if ok else Exit.FAILURE), out
    return out


def _total(c: SyncClient) -> int:
    return int(c.get_devices()[0]["total"])


def test_a_reload_past_what_this_machine_has_or_holds_keeps_the_running_config(
        tmp_path: Path) -> None:
    total = machine_memory()
    assert total is not None
    huge = (total >> 20) * 2
    cfg = tmp_path / "t.toml"
    cfg.write_text(BASE + "[memory]\nhost_limit_mib = 64\n")
    with DaemonProcess(command=[*SERVE, "-c", str(cfg)]) as d, \
            SyncClient(d.url, timeout=10) as c:
        # Over the machine's memory, beside a change that alone would apply: neither is.
        cfg.write_text(BASE + f"[memory]\nhost_limit_mib = {huge}\n[log]\nlevel = 'debug'\n")
        out = _reload(d, ok=False)
        assert f"memory.host_limit_mib: {huge} MiB is more than this machine's memory" \
            in out, out
        assert "does not fit this machine, the running one stays" in d.stderr, d.stderr
        assert _total(c) == 64 << 20
        assert "log.level" not in d.stderr
        for text, why in (
            (BASE + "[memory]\nhost_limit_mib = 'lots'\n", "memory.host_limit_mib"),
            (BASE + "[memory]\nhost_limit_mib = 0\n", "memory.host_limit_mib"),
            (BASE + "drain_s = 3601\n", "server.drain_s"),
            (BASE + "[memory]\nhost_limit_mib = 64\nmax_buffer_mib = 65\n", "max_buffer_mib"),
            ("# " + "x" * MAX_CONFIG_FILE + "\n", f"over {MAX_CONFIG_FILE} bytes"),
        ):
            cfg.write_text(text)
            out = _reload(d, ok=False)
            assert why in out and "the running one stays" in out, out
            assert _total(c) == 64 << 20
        cfg.unlink()
        out = _reload(d, ok=False)
        assert "cannot read" in out, out
        # A key that needs a restart keeps its value, and the reloadable one beside it
        # applies; then back within the machine: applied.
        cfg.write_text(BASE + "max_body = 8192\n[memory]\nhost_limit_mib = 32\n")
        out = _reload(d, ok=True)
        assert "needs a restart: server.max_body" in out, out
        assert _total(c) == 32 << 20
        c.free_buffer(c.alloc_buffer(1 << 20))
    assert "Traceback" not in d.stderr, d.output()
