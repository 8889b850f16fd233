"""A configuration file's key names are any text: shown escaped wherever they are said.

A TOML key may be any quoted string: ``"evil\\u001b[2J\\u001b]0;owned\\u0007" = 1``
under ``[server]`` (or a section so named) was named as it came in the unknown-key
error that check-config and serve print, that a SIGHUP logs and answers, and that
``transferd reload`` printed: ESC [2J cleared the operator's terminal, OSC 0 set its
title (click strips some sequences only where stdout is not a terminal, and never
OSC).  Now the name is written escaped (``\\x1b``), in every one of those.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import DaemonProcess, wait_until
from tests.integration.test_cli import SERVE
from tests.integration.test_doctor import cli
from transferd.exits import Exit

EVIL = '"evil\\u001b[2J\\u001b]0;owned\\u0007\\u202e"'
SHOWN = "evil\\x1b[2J\\x1b]0;owned\\x07\\u202e"
HOSTILE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e]")
GOOD = "[server]\nport = 0\n[metrics]\nport = 0\n"


def test_a_key_name_with_escapes_is_shown_escaped(tmp_path: Path) -> None:
    cfg = tmp_path / "t.toml"
    for text, said in ((f"[server]\nport = 0\n{EVIL} = 1\n[metrics]\nport = 0\n",
                        f"server.{SHOWN}: unknown key"),
                       (GOOD + f"[{EVIL}]\na = 1\n", f"{SHOWN}: unknown section [{SHOWN}]")):
        cfg.write_text(text)
        for args in (("check-config", str(cfg)), ("serve", "-c", str(cfg))):
            r = cli(*args)
            out = r.stdout + r.stderr
            assert r.returncode == Exit.CONFIG, out
            assert said in out, out
            assert not HOSTILE.search(out), repr(out)
    cfg.write_text(GOOD)
    with DaemonProcess(command=[*SERVE, "-c", str(cfg)]) as d:
        assert d.proc is not None
        cfg.write_text(f"[server]\nport = 0\n{EVIL} = 1\n[metrics]\nport = 0\n")
        r = subprocess.run([sys.executable, "-m", "transferd.cli", "reload", str(d.proc.pid)],
                           capture_output=True, text=True, timeout=30)
        out = r.stdout + r.stderr
        assert r.returncode == Exit.FAILURE, out
        assert f"server.{SHOWN}: unknown key" in out and not HOSTILE.search(out), repr(out)
        assert wait_until(lambda: "unknown key" in d.stderr, 5), d.output()
        assert not HOSTILE.search(d.stderr.replace("\n", "")), repr(d.stderr[-500:])
