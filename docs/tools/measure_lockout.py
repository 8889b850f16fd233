"""Numbers for docs/security.md (issue 16, items 1 and 2): the lockout attacks, printed, not
asserted (the assertions are tests/integration/test_attacks_lockout.py).

    ulimit -n 8192; .venv/bin/python docs/tools/measure_lockout.py

Run it at another commit (git stash, git checkout) for the "before" column: the daemons it
starts run the code of the working tree.
"""

import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from client import SyncClient
from tests.helpers import DaemonProcess
from tests.integration.test_attacks_lockout import (
    SECRET,
    _closed,
    _connect,
    _frames,
    _hello_hmac,
    honest,
)
from transferd.protocol.constants import PROTO_MAJOR, Command
from transferd.protocol.frames import FrameDecoder, encode_frame

tok = tempfile.mktemp()
with open(tok, "w") as fh:
    fh.write(SECRET)
os.chmod(tok, 0o600)


def timed(f):
    t0 = time.monotonic()
    try:
        f()
        return f"{time.monotonic() - t0:.2f} s"
    except Exception as e:
        return f"failed after {time.monotonic() - t0:.2f} s ({type(e).__name__})"


# 1. 128 wrong macs from one source, default timeout 5 s; open after 7 s; a right secret.
with DaemonProcess(["--token-file", tok]) as d:
    wrong = []
    for _ in range(128):
        s = _connect(d.host_port, "127.0.0.2")
        _hello_hmac(s)
        s.sendall(encode_frame(Command.AUTH, 0, 2, {"mac": b"\0" * 32}))
        wrong.append(s)
    t0 = time.monotonic()
    print(
        "right secret, same source, during 128 failures:",
        timed(lambda: honest(d.host_port, "127.0.0.2")),
    )
    nil = []
    for _ in range(20):
        s = _connect(d.host_port, "127.0.0.3")
        s.sendall(
            encode_frame(Command.HELLO, 0, 1, {"major": PROTO_MAJOR, "minor": 2, "client": "nil"})
        )
        nil.append(s)
    t1 = time.monotonic()
    answered = 0
    for s in nil:
        try:
            _frames(s, FrameDecoder(), max(0.01, t1 + 1 - time.monotonic()))
            answered += 1
        except Exception:
            pass
    print("credential-less HELLOs answered within 1 s:", answered, "of 20")
    time.sleep(max(0, t0 + 7 - time.monotonic()))
    print(
        "failed connections still open 7 s after:",
        sum(not _closed(s, 0.01) for s in wrong),
        "of 128",
    )
    for s in wrong + nil:
        s.close()

# 2. 128 silent from 127.0.0.1 and 128 silent on the unix socket.
where = tempfile.mkdtemp(prefix="td-", dir="/tmp")
with DaemonProcess(["--token-file", tok, "--unix", f"{where}/u.sock"]) as d:
    silent = [socket.create_connection(d.host_port) for _ in range(128)]
    for _ in range(128):
        u = socket.socket(socket.AF_UNIX)
        u.connect(d.unix_path)
        silent.append(u)
    time.sleep(0.5)
    for url in (d.url, d.unix_url):
        print(
            "honest client on",
            url.split(":")[0],
            "with 128 silent:",
            timed(lambda url=url: SyncClient(url, token=SECRET, connect_timeout=5).close()),
        )
    for s in silent:
        s.close()

# 3. 1024 silent from 8 sources (128 each) + new ones; 5 right-secret clients from fresh sources.
with DaemonProcess(["--token-file", tok]) as d:
    busy = [_connect(d.host_port, f"127.0.0.{2 + i}") for i in range(8) for _ in range(128)]
    time.sleep(0.5)
    ok = 0
    for k in range(5):
        for i in range(8):
            busy.append(_connect(d.host_port, f"127.0.0.{2 + i}"))
        r = timed(lambda k=k: honest(d.host_port, f"127.0.0.{10 + k}"))
        ok += not r.startswith("failed")
    print("fresh-source right-secret clients served with 1024 silent from 8 sources:", ok, "of 5")
    for s in busy:
        s.close()
