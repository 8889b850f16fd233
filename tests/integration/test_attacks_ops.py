"""Operator commands against peers that lie or dribble: bounded in time, a clear error."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import served_on_thread
from tests.integration.test_doctor import cli
from transferd.exits import Exit


@contextmanager
def dribbling_http(head: bytes, every_s: float = 0.3, limit_s: float = 60.0,
                   dribble: bool = True) -> Iterator[socket.socket]:
    """A listener on loopback that answers each connection with ``head``, then one
    byte every ``every_s`` (never the whole body), for at most ``limit_s``; without
    ``dribble``, ``head`` alone and the connection stays open."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(8)
    ls.settimeout(0.2)
    stop = threading.Event()

    def serve(c: socket.socket) -> None:
        with c:
            c.settimeout(1.0)
            try:
                c.recv(65536)
                c.sendall(head)
                end = time.monotonic() + limit_s
                while not stop.is_set() and time.monotonic() < end:
                    if dribble:
                        c.sendall(b"#")
                    stop.wait(every_s)
            except OSError:
                pass

    def accept() -> None:
        end = time.monotonic() + limit_s
        while not stop.is_set() and time.monotonic() < end:
            try:
                c, _ = ls.accept()
            except OSError:
                continue
            threading.Thread(target=serve, args=(c,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield ls
    finally:
        stop.set()
        t.join(5)
        ls.close()


def test_doctor_is_bounded_in_time_by_a_metrics_port_that_dribbles(tmp_path: Path) -> None:
    """A program on metrics.port that answers a byte at a time (each within the
    socket timeout, never the end): doctor still ends within its bound, saying so."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 10000000\r\n\r\n# transferd_"
    with dribbling_http(head) as ls:
        cfg = tmp_path / "c.toml"
        cfg.write_text(f"[metrics]\nport = {ls.getsockname()[1]}\n")
        t0 = time.monotonic()
        r = cli("doctor", "-c", str(cfg))
        took = time.monotonic() - t0
    assert took < 20, took
    assert r.returncode == Exit.FAILURE, r.stdout + r.stderr
    assert "metrics.port" in r.stdout and "does not answer as transferd's metrics" \
        in r.stdout, r.stdout


def test_sighup_with_the_config_file_turned_into_a_fifo_keeps_the_daemon_serving(
        tmp_path: Path) -> None:
    """The configuration path replaced by a FIFO nobody writes (or a device): SIGHUP
    must refuse it, naming why, not block the daemon's loop on the open forever."""
    import os
    import signal

    from client import SyncClient
    from tests.helpers import DaemonProcess, wait_until
    from tests.integration.test_cli import SERVE

    cfg = tmp_path / "t.toml"
    cfg.write_text("[server]\nport = 0\n[metrics]\nport = 0\n")
    with DaemonProcess(command=[*SERVE, "-c", str(cfg)]) as d:
        assert d.proc is not None
        cfg.unlink()
        os.mkfifo(cfg)
        d.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "the running one stays" in d.stderr, 5), d.output()
        assert "not a regular file" in d.stderr, d.stderr
        with SyncClient(d.url, timeout=5) as c:
            assert c.get_devices()
        cfg.unlink()
        cfg.symlink_to("/dev/zero")
        d.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: d.stderr.count("not a regular file") >= 2, 5), d.stderr
        with SyncClient(d.url, timeout=5) as c:
            assert c.get_devices()
    assert d.returncode == 0, d.output()


def test_a_config_file_that_is_not_utf8_is_a_config_error_not_a_traceback(
        tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_bytes(b"[server]\nport = 0\n# caf\xe9 (latin-1)\n")
    for args in (("check-config", str(cfg)), ("serve", "-c", str(cfg))):
        r = cli(*args)
        assert r.returncode == Exit.CONFIG, r.stdout + r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        assert f"{cfg}: not valid TOML: not UTF-8" in r.stdout + r.stderr, r.stdout + r.stderr


def test_an_integer_of_5000_digits_in_the_file_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "big.toml"
    cfg.write_text(f"[server]\nport = {'9' * 5000}\n")
    r = cli("check-config", str(cfg))
    assert r.returncode == Exit.CONFIG, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"{cfg}: not valid TOML" in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_secret_file_path_with_a_nul_byte_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "nul.toml"
    cfg.write_text('[server]\ntoken_file = "/tmp/x\\u0000y"\n')
    r = cli("check-config", str(cfg))
    assert r.returncode == Exit.CONFIG, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "server.token_file" in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_nul_byte_in_any_path_key_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """server.unix_socket with a NUL: serve crashed in the preflight's lstat
    (ValueError); every text key is refused at load instead, by its name."""
    cfg = tmp_path / "nul.toml"
    for section, key in (("server", "unix_socket"), ("log", "otel_file"),
                         ("server", "listen")):
        value = '["unix:///tmp/a\\u0000b"]' if key == "listen" else '"/tmp/a\\u0000b"'
        cfg.write_text(f"[{section}]\n{key} = {value}\n")
        for args in (("check-config", str(cfg)), ("serve", "-c", str(cfg), "--port", "0")):
            r = cli(*args)
            assert r.returncode == Exit.CONFIG, (key, args, r.stdout + r.stderr)
            assert "Traceback" not in r.stderr, r.stderr
            assert f"{section}.{key}: has a NUL byte" in r.stdout + r.stderr, \
                r.stdout + r.stderr



@contextmanager
def lying_daemon(stats: dict[str, Any], hello: dict[str, Any] | None = None
                 ) -> Iterator[str]:
    """A server on loopback that speaks the wire format: HELLO answered with
    ``hello``, STATS with ``stats``, anything else with {} (on a thread of its own)."""
    import asyncio

    from transferd.protocol.constants import Command, Flag
    from transferd.protocol.frames import FrameDecoder, encode_frame

    hello = hello or {"major": 1, "minor": 2, "patch": 0, "server": "liar",
                      "features": ["engine"], "max_body": 1 << 22, "max_payload": 1 << 30}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = FrameDecoder()
        while data := await reader.read(65536):
            for f in dec.feed(data):
                body = hello if f.cmd == int(Command.HELLO) else \
                    stats if f.cmd == int(Command.STATS) else {}
                if not f.no_reply:
                    writer.write(encode_frame(f.cmd, int(Flag.REPLY), f.seq, body))
            await writer.drain()
        writer.close()

    with served_on_thread(serve) as url:
        yield url


LIES: list[Any] = [
    {"inflight": {}},                                    # no entries
    {"inflight": {"entries": "x"}},                      # not a list
    {"inflight": {"entries": [1, 2]}},                   # rows not objects
    {"inflight": {"entries": [{"kind": "write"}]}},      # fields missing
    {"inflight": {"entries": [{"kind": "write", "op": 1, "stage": "sent", "in_stage_s": "x",
                               "age_s": None, "peer": 7, "rails": 3, "done": "?",
                               "total": [], "trace_id": {}, "owner": 1}]}},
    {"inflight": {"entries": [], "stall_warn_s": "soon", "stalls": []}},
]


@pytest.mark.parametrize("lie", range(len(LIES)))
def test_inflight_against_a_daemon_that_lies_says_so_without_a_traceback(lie: int) -> None:
    with lying_daemon(LIES[lie]) as url:
        r = cli("inflight", url)
    assert r.returncode == Exit.FAILURE, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"transferd: {url}: " in r.stderr, r.stderr


@pytest.mark.parametrize("command,lie", [
    ("stats", {}),
    ("stats", {"uptime_s": "x", "connections": 5, "bytes_in": 1, "bytes_out": 1}),
    ("stats", {"bytes_in": 1, "bytes_out": 1, "commands": [], "engine": 3}),
    ("buffers", {"buffers": [{"id": 1}], "truncated": False}),
    ("buffers", {"buffers": 7}),
])
def test_stats_and_buffers_against_a_daemon_that_lies_say_so_without_a_traceback(
        command: str, lie: dict[str, Any]) -> None:
    with lying_daemon(lie) as url:
        r = cli(command, url, *(["--once"] if command == "stats" else []))
    assert r.returncode == Exit.FAILURE, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"transferd: {url}: " in r.stderr and "cannot read" in r.stderr, r.stderr


def test_a_process_that_binds_the_reload_socket_and_never_reads_cannot_hang_the_daemon(
        tmp_path: Path) -> None:
    """Abstract sockets have no permissions: any local user can bind
    transferd-reload-PID and never read it.  Once its queue is full, the daemon's
    blocking sendto of a reload's outcome held its event loop for good."""
    import signal

    from client import SyncClient
    from tests.helpers import DaemonProcess
    from tests.integration.test_cli import SERVE
    from transferd.lifecycle import reload_socket

    cfg = tmp_path / "t.toml"
    cfg.write_text("[server]\nport = 0\n[metrics]\nport = 0\n")
    with DaemonProcess(command=[*SERVE, "-c", str(cfg)]) as d:
        assert d.proc is not None
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as squatter:
            squatter.bind(reload_socket(d.proc.pid))
            for _ in range(40):  # past net.unix.max_dgram_qlen (10 by default)
                d.proc.send_signal(signal.SIGHUP)
                time.sleep(0.05)
            time.sleep(0.5)
            with SyncClient(d.url, timeout=5, connect_timeout=5) as c:
                assert c.get_devices()
    assert d.returncode == 0, d.output()


@pytest.mark.parametrize("body", [b"[1]", b'"etcd"', b"7", b'{"version": {"x": 1}}'])
def test_doctor_against_an_etcd_that_answers_no_object_says_so(tmp_path: Path,
                                                              body: bytes) -> None:
    pytest.importorskip("h11")
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)
    with dribbling_http(head, dribble=False) as ls:
        cfg = tmp_path / "c.toml"
        cfg.write_text(f'[discovery]\nurl = "etcd://127.0.0.1:{ls.getsockname()[1]}"\n')
        r = cli("doctor", "-c", str(cfg))
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == Exit.FAILURE, r.stdout + r.stderr
    assert "discovery" in r.stdout and "does not answer as etcd" in r.stdout, r.stdout


def test_a_hello_whose_major_is_text_is_named_as_text() -> None:
    """HELLO's major "1" (text): the refusal said 'server speaks major 1, this client
    1', which reads as a contradiction; it names the value as it came, cut short."""
    hello = {"major": "1", "minor": 2, "patch": 0, "server": "liar", "features": []}
    with lying_daemon({}, hello) as url:
        r = cli("ping", url)
    assert r.returncode == Exit.FAILURE, r.stdout + r.stderr
    assert "server speaks major '1', this client 1" in r.stderr, r.stderr
    with lying_daemon({}, {**hello, "major": "9" * 100_000}) as url:
        r = cli("ping", url)
    assert r.returncode == Exit.FAILURE and len(r.stderr) < 2000, r.stderr[:300]


def test_a_config_file_nested_past_the_stack_is_a_config_error(tmp_path: Path) -> None:
    """tomllib descends once per nested array or inline table: 100,000 of them (200 KB)
    were a RecursionError traceback of thousands of lines from check-config and serve,
    and a reload that 'failed: maximum recursion depth exceeded', the same traceback in
    the daemon's journal.  Now a ConfigError naming the file, exit 3; a reload keeps the
    running configuration and says why."""
    import signal
    import subprocess
    import sys

    from client import SyncClient
    from tests.helpers import DaemonProcess, wait_until
    from tests.integration.test_cli import SERVE

    for name, text in (("arrays", "a = " + "[" * 100_000 + "]" * 100_000 + "\n"),
                       ("tables", "a = " + "{b = " * 50_000 + "1" + "}" * 50_000 + "\n")):
        deep = tmp_path / f"{name}.toml"
        deep.write_text(text)
        for args in (("check-config", str(deep)), ("serve", "-c", str(deep))):
            r = cli(*args)
            assert r.returncode == Exit.CONFIG, r.stdout + r.stderr
            assert "Traceback" not in r.stderr, r.stderr[-2000:]
            assert f"{deep}: not valid TOML: arrays or inline tables nested too deep" in \
                r.stdout + r.stderr, r.stdout + r.stderr
    cfg = tmp_path / "t.toml"
    cfg.write_text("[server]\nport = 0\n[metrics]\nport = 0\n")
    with DaemonProcess(command=[*SERVE, "-c", str(cfg)]) as d:
        assert d.proc is not None
        cfg.write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
        r = subprocess.run([sys.executable, "-m", "transferd.cli", "reload", str(d.proc.pid),
                            "--timeout", "10"], capture_output=True, text=True, timeout=30)
        assert r.returncode == Exit.FAILURE, r.stdout + r.stderr
        assert "refused: the configuration is invalid, the running one stays" in r.stderr, \
            r.stderr
        assert "nested too deep" in r.stderr, r.stderr
        assert wait_until(lambda: "nested too deep" in d.stderr, 5), d.output()
        assert "Traceback" not in d.stderr, d.stderr[-2000:]
        with SyncClient(d.url, timeout=5) as c:
            assert c.get_devices()
        d.proc.send_signal(signal.SIGTERM)
