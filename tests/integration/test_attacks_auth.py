"""Guessing the secret against a live daemon: the per-source slowdown cannot be sidestepped.

Each failed authentication from a source waits longer before its UNAUTHORIZED
(0.05 s, doubling).  Two ways around that were open before: hanging up after a
few milliseconds and reading the silence as "wrong" (a good secret was
answered at once), and guessing over many connections in parallel (each wait
ran on its own).  Now one source's verdicts are answered one after another and
a good secret waits its turn behind the failures before it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import SyncClient
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess
from transferd.protocol.constants import Command, ErrorCode, Flag
from transferd.protocol.frames import Frame, FrameDecoder, encode_frame

SECRET = "guess-me-if-you-can"


@pytest.fixture
def secured(daemon_factory: DaemonFactory, tmp_path: Path) -> Iterator[DaemonProcess]:
    tok = tmp_path / "token"
    tok.write_text(SECRET)
    tok.chmod(0o600)
    yield daemon_factory(["--token-file", str(tok), "--unix", f"{tmp_path}/u.sock"])


def _guess(path: str, token: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(encode_frame(Command.HELLO, 0, 1, {"major": 1, "minor": 2, "client": "guesser",
                                                 "token": token}))
    return s


def _answer(s: socket.socket, timeout: float) -> Frame | None:
    s.settimeout(timeout)
    try:
        data = s.recv(65536)
    except TimeoutError:
        return None
    (f,) = FrameDecoder().feed(data)
    return f


def test_hanging_up_early_learns_nothing(secured: DaemonProcess) -> None:
    assert secured.unix_path is not None
    # Three wrong guesses, each abandoned after 20 ms without its answer...
    for i in range(3):
        with _guess(secured.unix_path, f"wrong-{i}") as s:
            assert _answer(s, 0.02) is None
    # ...and the right one is silent for as long: silence no longer means "wrong".
    t0 = time.monotonic()
    with _guess(secured.unix_path, SECRET) as s:
        assert _answer(s, 0.02) is None
        f = _answer(s, 5)
        took = time.monotonic() - t0
        assert f is not None and f.flags == Flag.REPLY and f.body["auth"], f
        # Answered behind the waits of the three failures (0.05 + 0.1 + 0.2 s).
        assert took >= 0.25, took
        # The connection works once answered.
        s.sendall(encode_frame(Command.SYNCHRONIZE, 0, 2))
        sync = _answer(s, 5)
        assert sync is not None and sync.seq == 2 and not sync.is_error
    assert "authentication failed from local" in secured.stderr
    # With the waits answered, a client with the secret is not held back.
    t0 = time.monotonic()
    with SyncClient(f"unix://{secured.unix_path}", token=SECRET) as c:
        assert c.minor == 2
    assert time.monotonic() - t0 < 0.5


def test_parallel_guesses_are_answered_one_after_another(secured: DaemonProcess) -> None:
    assert secured.unix_path is not None
    t0 = time.monotonic()
    socks = [_guess(secured.unix_path, f"wrong-{i}") for i in range(5)]
    try:
        done = []
        for s in socks:
            f = _answer(s, 10)
            assert f is not None and f.body["code"] == ErrorCode.UNAUTHORIZED
            done.append(time.monotonic() - t0)
    finally:
        for s in socks:
            s.close()
    # 0.05 + 0.1 + 0.2 + 0.4 + 0.8 s one after another (each on its own: 0.8 s for all).
    assert done[-1] >= 1.4, done
    assert secured.alive()
