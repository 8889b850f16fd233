"""The example frames in docs/protocol.md are what today's daemons send.

``docs/tools/capture_frames.py --check`` starts fresh daemons (the engine
examples two of them, on 127.0.0.1 and 127.0.0.2), replays every example and
compares it with the block in the doc.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO


def _can_bind(host: str) -> bool:
    with contextlib.suppress(OSError), socket.socket() as s:
        s.bind((host, 0))
        return True
    return False


@pytest.mark.skipif(not _can_bind("127.0.0.2"),
                    reason="the engine examples need a second loopback address, 127.0.0.2")
def test_captured_frames_are_current() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    started = time.monotonic()
    r = subprocess.run([sys.executable, "docs/tools/capture_frames.py", "--check"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=90)
    took = time.monotonic() - started
    assert r.returncode == 0, r.stdout + r.stderr
    assert "captured frames are current" in r.stdout
    assert took < 60, f"capture_frames.py --check took {took:.1f} s"
