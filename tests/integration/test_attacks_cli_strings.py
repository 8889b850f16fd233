"""Hostile strings on their way to an operator's terminal.

A node record and a name record are data from whoever can write to etcd (docs/
discovery.md, "Trust"): a node's name is its key's last part, any bytes. ``transferd
peers`` and ``transferd names`` print what the daemon mirrored; a terminal takes an
escape sequence in it as a command (clear the screen, move the cursor over a line to
hide a node, set the window title; some terminals did worse).  Against a real etcd and
a live daemon, as an operator would run the commands.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import pty
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.etcd_server import EtcdServer
from tests.helpers import REPO, DaemonProcess, async_test
from tests.integration.test_cli import clean_env
from tests.integration.test_discovery_etcd import disc_env
from transferd.exits import Exit

# What no line of a listing may hold: C0 controls but newline, DEL, C1 controls (ESC's
# 8-bit form among them), and the bidi overrides that reorder what follows.
HOSTILE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

EVIL_NODE = "evil\x1b[2J\x1b]0;owned\x07\x9b1A\u202e"
EVIL_RAIL = "10.0.0.1:1\x1b[1A\x1b[2K"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path) as server:
        yield server


def cli_tty(*args: str, limit_s: float = 60.0) -> tuple[int, str]:
    """``transferd ARGS`` with its stdout a terminal, as an operator runs it (click strips
    some escape sequences when stdout is a pipe, none on a terminal): (status, output)."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "transferd.cli", *args], stdout=slave,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=REPO,
                                env=clean_env())
        os.close(slave)
        slave = -1
        out = bytearray()
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        rc = proc.wait(10)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    # The terminal turns each newline into CRLF (onlcr): undo only that.
    return rc, out.decode("utf-8", "replace").replace("\r\n", "\n")


def _until(check: object, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_a_forged_record_with_escapes_is_not_served_and_nothing_hostile_is_printed(
        etcd: EtcdServer) -> None:
    """Stop 36: ``transferd peers`` printed the forged node's name, rails and server, and
    ``transferd names`` the name record's node, byte for byte (ESC [2J cleared the
    operator's screen, ESC [1A ESC [2K wiped the line above, U+202E reversed the rest of
    the line); the CLI then escaped them, but PEERS and NAMES still served them raw to
    every client program. Now a node record whose strings hold a control, format or
    separator character (as a name may not), or a name record whose node does, is
    malformed: not mirrored, counted as ignored, while an honest record beside it is
    served; and nothing hostile reaches the terminal."""
    node = {"v": 1, "name": "ignored", "node": "00000000000000ab",
            "version": [1, 2, 0], "rails": ["10.0.0.1:1"], "server": "srv",
            "urls": ["tcp://10.0.0.1:1"]}
    etcd.put(f"/transferd/nodes/{EVIL_NODE}", json.dumps(node).encode())
    for field, evil in (("rails", [EVIL_RAIL]), ("server", "srv\x1b[31m"),
                        ("urls", ["tcp://10.0.0.1:1\x1b[0m"])):
        etcd.put(f"/transferd/nodes/bad-{field}", json.dumps({**node, field: evil}).encode())
    etcd.put("/transferd/nodes/honest", json.dumps({**node, "node": "00000000000000ac"}).encode())
    value = base64.b64encode(b"x").decode()
    etcd.put("/transferd/names/kv/one", json.dumps(
        {"v": 1, "kind": "bytes", "value": value, "node": "other\x1b[8m"}).encode())
    etcd.put("/transferd/names/kv/two", json.dumps(
        {"v": 1, "kind": "bytes", "value": value, "node": "honest"}).encode())
    with DaemonProcess(env=disc_env(etcd)) as d:
        def listed() -> bool:
            rc, out = cli_tty("names", d.url)
            return rc == Exit.OK and "kv/two" in out

        _until(listed, 15, "the honest name in transferd names")
        (prc, peers), (nrc, names) = cli_tty("peers", d.url), cli_tty("names", d.url)
        jrc, out = cli_tty("peers", d.url, "--json")
        status = json.loads(out)["discovery"]
    assert prc == Exit.OK and nrc == Exit.OK and jrc == Exit.OK, peers + names
    for out in (peers, names):
        assert not HOSTILE.search(out), repr(out)
        assert "\\x1b" not in out, out  # not even escaped: never served
    assert "honest" in peers and "evil" not in peers and "bad-" not in peers, peers
    assert "kv/two" in names and "kv/one" not in names, names
    assert status["ignored"] >= 5, status


def test_the_cli_escapes_what_a_daemon_answers() -> None:
    """Defence in depth for a daemon of another version, or any other field a client
    wrote: every listing goes through ``shown``."""
    from transferd.commands.remote import shown

    assert shown(EVIL_NODE) == "evil\\x1b[2J\\x1b]0;owned\\x07\\x9b1A\\u202e"
    assert shown("a\nb\u2028c\U000e0001") == "a\nb\\u2028c\\U000e0001"
    assert shown("plain café") == "plain café"


def test_a_forged_record_under_this_daemons_node_name_cannot_write_log_lines(
        etcd: EtcdServer) -> None:
    """A record at this daemon's own node key under another lease is logged once as a
    duplicate daemon; its ``node`` field (any text, from whoever can write to etcd) was
    put in the log line as it came: a newline in it forged a line of the journal of the
    writer's choosing. Now it is quoted (repr)."""
    with DaemonProcess(env=disc_env(etcd, NODE_NAME="victim")) as d:
        def registered() -> bool:
            return "/transferd/nodes/victim" in etcd.stored()

        _until(registered, 15, "the daemon's node record in etcd")
        forged = {"v": 1, "name": "victim", "node": "ab\nERROR transferd: FORGED line",
                  "version": [1, 2, 0]}

        def seen() -> bool:
            # Put again until the daemon's watch (started after its own record, under
            # load seconds after) has seen one: a put before it began is not an event.
            etcd.put("/transferd/nodes/victim", json.dumps(forged).encode())
            end = time.monotonic() + 2
            while time.monotonic() < end:
                if "writes as node 'victim'" in d.stderr:
                    return True
                time.sleep(0.2)
            return False

        _until(seen, 30, "the duplicate logged")
    lines = d.stderr.splitlines()
    assert not any(line.startswith("ERROR transferd: FORGED") for line in lines), d.stderr
    assert any("'ab\\nERROR transferd: FORGED line'" in line for line in lines), d.stderr


@async_test(timeout=60)
async def test_a_record_forged_between_our_put_and_our_snapshot_is_a_duplicate(
        etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The race the test above retries around: another daemon writes this node's key
    after this daemon's put and before its snapshot (its watch starts after the
    snapshot, so no event tells). The snapshot judges its own key's lease as the watch
    does: the duplicate is logged (it was skipped as our own record). The engine is
    inproc, so the write lands exactly in that window (after the real put)."""
    from client import Client
    from transferd.discovery.etcd import EtcdBackend

    forged = {"v": 1, "name": "victim", "node": "other", "version": [1, 2, 0]}
    real_put = EtcdBackend._put_record

    async def put_then_forged(self: EtcdBackend) -> None:
        await real_put(self)
        await asyncio.to_thread(etcd.put, "/transferd/nodes/victim",
                                json.dumps(forged).encode())

    monkeypatch.setattr(EtcdBackend, "_put_record", put_then_forged)
    caplog.set_level(logging.ERROR, logger="transferd.discovery")
    c = await Client.connect("inproc://", overrides={
        "discovery.url": etcd.url, "discovery.node_name": "victim",
        "engine.enabled": False}, timeout=20)
    try:
        for _ in range(100):
            if any("writes as node 'victim'" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        (rec,) = [r for r in caplog.records if "writes as node 'victim'" in r.getMessage()]
        assert "'other'" in rec.getMessage(), rec.getMessage()
    finally:
        await c.close()
