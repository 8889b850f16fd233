"""Strangers trying to lock the client port, against live daemons (issue 16, items 1 and 2).

Before: one source's failed handshakes were answered one after another, each holding its
pre-auth slot (and descriptor) for its whole back-off, far past the handshake timeout,
and a right secret from that source waited behind them all; a full per-source or global
table refused every newcomer at accept, so silent connections from 127.0.0.1 (every
local TCP client) or from the Unix socket (every local client: one source, "local")
locked out every honest local client, and 8 busy addresses locked out fresh ones.

Now (transferd/preauth.py): no slot outlives the handshake timeout, a newcomer makes the
oldest pre-auth connection give way instead of being refused, a HELLO without
credentials is not a guess (answered at once), hmac-sha256 successes are answered at once,
and a Unix-socket client's source is its uid (SO_PEERCRED).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import tempfile
import time
from pathlib import Path

import pytest

from client import SyncClient
from tests.conftest import DaemonFactory
from tests.helpers import wait_until
from tests.integration.test_attacks_handshake import _can_bind, still_works
from transferd.protocol import auth
from transferd.protocol.constants import PROTO_MAJOR, Command, ErrorCode, Flag
from transferd.protocol.frames import Frame, FrameDecoder, encode_frame

SECRET = "lockout-attacks-secret"
NOBODY = 65534


needs_loopback_aliases = pytest.mark.skipif(
    not _can_bind("127.0.0.10"), reason="needs the loopback addresses 127.0.0.2-127.0.0.14")


def _connect(addr: tuple[str, int], source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(addr)
    return s


def _frames(s: socket.socket, dec: FrameDecoder, timeout: float) -> list[Frame]:
    s.settimeout(timeout)
    data = s.recv(65536)
    if not data:
        raise ConnectionError("closed")
    return dec.feed(data)


def _hello_hmac(s: socket.socket) -> tuple[bytes, Frame, FrameDecoder]:
    nonce = auth.fresh_nonce()
    s.sendall(encode_frame(Command.HELLO, 0, 1, {"major": PROTO_MAJOR, "minor": 2,
                                                 "client": "t", "auth": auth.HMAC_SHA256,
                                                 "nonce": nonce}))
    dec = FrameDecoder()
    (f,) = _frames(s, dec, 5)
    assert f.flags == Flag.REPLY and len(f.body["challenge"]) == 32, f
    return nonce, f, dec


def honest(addr: tuple[str, int], source: str = "127.0.0.1") -> float:
    """An hmac-sha256 client from ``source``, start to a served SYNCHRONIZE: seconds."""
    t0 = time.monotonic()
    with _connect(addr, source) as s:
        nonce, f, dec = _hello_hmac(s)
        s.sendall(encode_frame(Command.AUTH, 0, 2, {
            "mac": auth.client_mac(SECRET.encode(), f.body["challenge"], nonce)}))
        (a,) = _frames(s, dec, 15)
        assert a.cmd == Command.AUTH and not a.is_error, a.body
        s.sendall(encode_frame(Command.SYNCHRONIZE, 0, 3))
        (y,) = _frames(s, dec, 5)
        assert y.seq == 3 and not y.is_error
    return time.monotonic() - t0


def _closed(s: socket.socket, timeout: float) -> bool:
    """True once the daemon closed ``s`` (an error frame before the end is fine)."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


@pytest.fixture
def secret_file(tmp_path: Path) -> str:
    tok = tmp_path / "token"
    tok.write_text(SECRET)
    tok.chmod(0o600)
    return str(tok)


@needs_loopback_aliases
def test_failures_never_hold_a_slot_past_the_timeout(daemon_factory: DaemonFactory,
                                                     secret_file: str) -> None:
    d = daemon_factory(["--token-file", secret_file], env={
        "TRANSFERD_SERVER_HANDSHAKE_TIMEOUT_S": "1",
        "TRANSFERD_SERVER_MAX_HANDSHAKES_PER_SOURCE": "64"})
    addr = d.host_port
    src = "127.0.0.2"
    # 40 wrong macs from one source: their answers queue up (0.05 s doubling to 2 s each,
    # about 70 s for all of them one after another).
    wrong = []
    for _ in range(40):
        s = _connect(addr, src)
        _hello_hmac(s)
        s.sendall(encode_frame(Command.AUTH, 0, 2, {"mac": b"\x00" * 32}))
        wrong.append(s)
    t0 = time.monotonic()
    try:
        # A right secret from the same source meanwhile is served at once.
        assert honest(addr, src) < 0.5
        # 40 HELLOs without credentials guess nothing: answered at once, not queued.
        for _ in range(40):
            with _connect(addr, src) as s:
                s.sendall(encode_frame(Command.HELLO, 0, 1, {"major": PROTO_MAJOR,
                                                             "minor": 2, "client": "nil"}))
                (f,) = _frames(s, FrameDecoder(), 0.5)
                assert f.body["code"] == ErrorCode.UNAUTHORIZED
        # Every failed connection is closed by the timeout (1 s after its accept): none
        # holds its slot or its descriptor for the rest of its back-off.
        open_after = [s for s in wrong if not _closed(s, max(0.05, t0 + 1.6 - time.monotonic()))]
        assert open_after == [], f"{len(open_after)} of 40 still open 1.6 s after"
    finally:
        for s in wrong:
            s.close()
    assert "authentication failed from 127.0.0.2" in d.stderr
    assert d.alive()


def test_silent_connections_do_not_lock_out_local_clients(daemon_factory: DaemonFactory,
                                                          secret_file: str) -> None:
    where = tempfile.mkdtemp(prefix="td-", dir="/tmp")
    d = daemon_factory(["--token-file", secret_file, "--unix", f"{where}/u.sock"], env={
        "TRANSFERD_SERVER_HANDSHAKE_TIMEOUT_S": "30",
        "TRANSFERD_SERVER_MAX_HANDSHAKES_PER_SOURCE": "16"})
    assert d.unix_path is not None
    silent: list[socket.socket] = []
    try:
        # Fill 127.0.0.1's table and the Unix socket's (the same uid as the clients below)
        # with connections that never say a word, and hold them past any accept burst.
        for _ in range(16):
            silent.append(socket.create_connection(d.host_port, timeout=5))
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            u.connect(d.unix_path)
            silent.append(u)
        time.sleep(0.3)
        for url in (d.url, d.unix_url or ""):
            t0 = time.monotonic()
            with SyncClient(url, token=SECRET, connect_timeout=5) as c:
                still_works(c, 1)
            assert time.monotonic() - t0 < 2, url
        # Each honest client took the slot of the oldest silent one of its source.
        # (by now: one deadline for all, so the 30 left open cost 0.5 s, not 0.5 s each)
        deadline = time.monotonic() + 0.5
        assert sum(_closed(s, max(0.01, deadline - time.monotonic())) for s in silent) >= 2
    finally:
        for s in silent:
            s.close()
    assert d.alive()


@needs_loopback_aliases
def test_a_full_table_leaves_fresh_sources_in(daemon_factory: DaemonFactory,
                                              secret_file: str) -> None:
    d = daemon_factory(["--token-file", secret_file], env={
        "TRANSFERD_SERVER_HANDSHAKE_TIMEOUT_S": "30",
        "TRANSFERD_SERVER_MAX_HANDSHAKES": "32",
        "TRANSFERD_SERVER_MAX_HANDSHAKES_PER_SOURCE": "4"})
    addr = d.host_port
    busy: list[socket.socket] = []
    try:
        # 8 sources at their cap of 4 fill the 32 slots in all; credential-less HELLOs
        # from them keep coming in while the fresh clients connect.
        for i in range(8):
            for _ in range(4):
                busy.append(_connect(addr, f"127.0.0.{2 + i}"))
        time.sleep(0.3)
        served = 0
        for k in range(5):
            for i in range(8):
                s = _connect(addr, f"127.0.0.{2 + i}")
                s.sendall(encode_frame(Command.HELLO, 0, 1, {"major": PROTO_MAJOR,
                                                             "minor": 2, "client": "nil"}))
                busy.append(s)
            served += honest(addr, f"127.0.0.{10 + k}") < 2
        assert served == 5
    finally:
        for s in busy:
            s.close()
    assert d.alive()


def _guess_as(uid: int, path: str, frames: list[bytes], hold_s: float) -> int:
    """A child process that, as ``uid``, opens one Unix connection per frame, sends it and
    waits ``hold_s``; returns its pid once everything is sent."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plain system calls only, then _exit
        try:
            os.close(r)
            os.setgid(uid)
            os.setuid(uid)
            socks = []
            for f in frames:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                s.sendall(f)
                socks.append(s)
            os.write(w, b"sent")
            time.sleep(hold_s)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as rf:
        assert rf.read(4) == b"sent"
    return pid


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a guesser as another uid")
def test_unix_clients_are_sources_by_uid(daemon_factory: DaemonFactory,
                                         secret_file: str) -> None:
    where = tempfile.mkdtemp(prefix="td-", dir="/tmp")
    os.chmod(where, 0o755)
    d = daemon_factory(["--token-file", secret_file, "--unix", f"{where}/u.sock"], env={
        "TRANSFERD_SERVER_HANDSHAKE_TIMEOUT_S": "8"})
    assert d.unix_path is not None and d.unix_url is not None
    os.chmod(d.unix_path, stat.S_IMODE(os.stat(d.unix_path).st_mode) | 0o777)
    # Another local user guesses the token 8 times at once: its answers queue up (0.05 s,
    # doubling, to 6.35 s for the last).
    guesses = [encode_frame(Command.HELLO, 0, 1, {"major": PROTO_MAJOR, "minor": 2,
                                                  "client": "g", "token": f"wrong-{i}"})
               for i in range(8)]
    pid = _guess_as(NOBODY, d.unix_path, guesses, 4.0)
    try:
        # The daemon has taken them (one log line per source per window says so).
        assert wait_until(lambda: "authentication failed from local (pid" in d.stderr, 5)
        time.sleep(0.2)
        # This uid's token client is another source: answered at once, not behind them.
        t0 = time.monotonic()
        with SyncClient(d.unix_url, token=SECRET, auth="token", connect_timeout=5) as c:
            still_works(c, 2)
        assert time.monotonic() - t0 < 0.5
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert f"uid {NOBODY}" in d.stderr
    assert d.alive()
