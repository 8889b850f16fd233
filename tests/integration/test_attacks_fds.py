"""File descriptors as a weapon against a live daemon, over unix and seqpacket.

No frame a client sends announces descriptors, so the daemon closes whatever a
client attaches, on arrival, before and after authentication: a flood of
SCM_RIGHTS cannot fill its fd table (before, each connection could park 64
and every message past that leaked 15 of its 16 for good).  A client that
asks for a shared buffer and vanishes before reading the reply that carries
its descriptor leaves no descriptor and no charge behind.
"""

from __future__ import annotations

import array
import os
import socket
import tempfile
import time
from collections.abc import Iterator

import pytest

from client import SyncClient
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, digest, pattern, wait_until
from transferd.protocol.constants import PROTO_MAJOR, Command
from transferd.protocol.frames import FrameDecoder, encode_frame

HELLO = encode_frame(Command.HELLO, 0, 1, {"major": PROTO_MAJOR, "minor": 2, "client": "fds"})


@pytest.fixture
def local(daemon_factory: DaemonFactory) -> Iterator[DaemonProcess]:
    where = tempfile.mkdtemp(prefix="td-", dir="/tmp")
    yield daemon_factory(["--unix", f"{where}/u.sock", "--listen", f"seqpacket://{where}/s.sock"])


def open_fds(d: DaemonProcess) -> int:
    assert d.proc is not None
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def _connect(d: DaemonProcess, scheme: str) -> socket.socket:
    kind = socket.SOCK_STREAM if scheme == "unix" else socket.SOCK_SEQPACKET
    s = socket.socket(socket.AF_UNIX, kind)
    s.settimeout(5)
    s.connect(d.url_for(scheme)[len(scheme) + 3:])
    return s


def _with_fds(s: socket.socket, data: bytes, fds: list[int]) -> None:
    s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


@pytest.mark.parametrize("scheme", ["unix", "seqpacket"])
def test_descriptors_a_client_sends_are_closed_on_arrival(
    local: DaemonProcess, scheme: str
) -> None:
    r, w = os.pipe()
    try:
        with SyncClient(local.url_for(scheme)) as good:
            base = open_fds(local)
            # Before HELLO: 40 messages of 16 descriptors each (the stream as single bytes
            # of a HELLO, seqpacket as a HELLO attached to the first).
            s = _connect(local, scheme)
            with s:
                if scheme == "unix":
                    for i in range(40):
                        _with_fds(s, HELLO[i:i + 1], [r] * 16)
                else:
                    _with_fds(s, HELLO, [r] * 16)
                assert wait_until(lambda: open_fds(local) <= base + 1, 5), (base, open_fds(local))
            # After HELLO: 100 requests, each with 16 descriptors, all served.
            s = _connect(local, scheme)
            with s:
                s.sendall(HELLO)
                dec = FrameDecoder()
                dec.feed(s.recv(65536))
                for i in range(100):
                    _with_fds(s, encode_frame(Command.SYNCHRONIZE, 0, 10 + i), [r] * 16)
                    frames = dec.feed(s.recv(65536))
                    assert [(f.seq, f.is_error) for f in frames] == [(10 + i, False)]
                assert wait_until(lambda: open_fds(local) <= base + 1, 5), (base, open_fds(local))
            data = pattern(8192, 5)
            buf = good.alloc_buffer(8192)
            good.set_tensor(buf.tensor(), data)
            assert digest(good.get_tensor(buf.tensor())) == digest(data)
            assert wait_until(lambda: open_fds(local) <= base, 5), (base, open_fds(local))
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("scheme", ["unix", "seqpacket"])
def test_a_client_that_vanishes_before_its_descriptor_leaves_nothing(
    local: DaemonProcess, scheme: str
) -> None:
    with SyncClient(local.url_for(scheme)) as good:
        base = open_fds(local)
        for i in range(60):
            s = _connect(local, scheme)
            with s:
                s.sendall(HELLO)
                s.recv(65536)
                s.sendall(encode_frame(Command.ALLOC_BUFFER, 0, 2, {"device": "shm",
                                                                    "size": 1 << 20}))
                if i % 2:
                    time.sleep(0.002)  # sometimes the reply is on its way, sometimes sent

        def settled() -> bool:
            shm = next(x for x in good.get_devices() if x["name"] == "shm")
            return open_fds(local) <= base and shm["free"] == shm["total"]

        assert wait_until(settled, 5), (base, open_fds(local), good.get_devices())
