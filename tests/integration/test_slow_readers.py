"""A slow reader on each port, against a live daemon: memory stays bounded, others are served.

On the RPC listeners (tcp, unix, seqpacket, tls) the reader pipelines GET_TENSOR and
GET_TENSORS requests for 16 MiB each (320 MiB asked) and never reads a byte, with a
small receive buffer.  The daemon must stop reading that connection once a reply is
queued (it runs one of the requests, not twenty), its RSS must grow by less than the
bound docs/security.md states ("Slow readers"), and another client over the same
transport must be served meanwhile, every byte checked.  On the metrics port, hundreds
of connections that send nothing, half a request, or a request whose answer they never
read: the daemon's threads and memory stay bounded, a scrape is answered meanwhile,
and every such connection is closed at the timeout.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client import SyncClient
from tests.helpers import (
    DaemonProcess,
    digest,
    metric,
    pattern,
    rss,
    scrape,
    start_daemon,
    wait_until,
)
from tests.integration.test_transports import make_cert
from transferd.protocol.constants import PROTO_MAJOR, Command
from transferd.protocol.frames import FrameDecoder, encode_frame

MiB = 1 << 20
SIZE = 16 * MiB
REQUESTS = 20
# What a slow reader may cost the daemon (docs/security.md, "Slow readers"): no reply
# memory on tcp/unix/seqpacket (replies are sent from the buffer), one 1 MiB chunk in
# flight on tls; the rest is the decoder, the kernel's accounting and noise.
BOUND = 8 * MiB
SCHEMES = ("tcp", "unix", "seqpacket", "tls")

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, str]]:
    where = tmp_path_factory.mktemp("slow")
    cert, key = make_cert(where)
    short = Path("/tmp") / f"td-slow-{time.monotonic_ns()}"
    short.mkdir()
    d = start_daemon(["--listen", f"unix://{short}/u.sock",
                      "--listen", f"seqpacket://{short}/s.sock",
                      "--listen", "tls://127.0.0.1:0"],
                     env={"TRANSFERD_SERVER_TLS_CERT": cert, "TRANSFERD_SERVER_TLS_KEY": key,
                          "TRANSFERD_METRICS_TIMEOUT_S": "2"})
    try:
        yield d, cert
    finally:
        d.stop()
        shutil.rmtree(short, ignore_errors=True)


class Raw:
    """A raw connection on any of the four transports that sends frames and reads only
    when told (a small receive buffer, so the daemon's writes back up quickly)."""

    def __init__(self, url: str, cert: str) -> None:
        scheme, _, rest = url.partition("://")
        self.message = scheme == "seqpacket"
        if scheme in ("unix", "seqpacket"):
            kind = socket.SOCK_SEQPACKET if self.message else socket.SOCK_STREAM
            s = socket.socket(socket.AF_UNIX, kind)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            s.settimeout(10)
            s.connect(rest)
        else:
            host, _, port = rest.rpartition(":")
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            s.settimeout(10)
            s.connect((host, int(port)))
            if scheme == "tls":
                ctx = ssl.create_default_context(cafile=cert)
                s = ctx.wrap_socket(s, server_hostname="127.0.0.1")
        self.sock: Any = s
        self.seq = 0

    def send(self, cmd: int, body: dict[str, Any]) -> None:
        self.seq += 1
        data = encode_frame(cmd, 0, self.seq, body, 0)
        if self.message:
            self.sock.send(data)
        else:
            self.sock.sendall(data)

    def hello(self) -> None:
        self.send(Command.HELLO, {"major": PROTO_MAJOR, "minor": 2, "client": "slow-reader"})
        dec = FrameDecoder()
        for _ in range(100):
            frames = dec.feed(self.sock.recv(1 << 16))
            if frames:
                assert not frames[0].is_error, frames[0].body
                return
        raise AssertionError("no HELLO reply")

    def close(self) -> None:
        self.sock.close()


def _threads(d: DaemonProcess) -> int:
    assert d.proc is not None
    with open(f"/proc/{d.proc.pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_reader_that_never_reads_costs_a_bounded_amount(
    served: tuple[DaemonProcess, str], scheme: str
) -> None:
    d, cert = served
    url = d.url_for(scheme)
    kw = {"tls_ca": cert} if scheme == "tls" else {}
    with SyncClient(url, **kw) as ctl:
        big = ctl.alloc_buffer(SIZE)
        ctl.buffer_clear(big, 7)  # every page touched: in the RSS before the reader comes
        small = ctl.alloc_buffer(64 * 1024)
        gets = ctl.server_stats()["commands"]
        before = rss(d)
        slow = Raw(url, cert)
        try:
            slow.hello()
            for k in range(REQUESTS):  # 320 MiB of replies asked for, none read
                if k % 2:
                    half = SIZE // 2
                    slow.send(Command.GET_TENSORS, {"tensors": [[big.id, 0, half],
                                                                [big.id, half, half]]})
                else:
                    slow.send(Command.GET_TENSOR, {"tensor": [big.id, 0, SIZE]})
            peak = before
            worst = 0.0
            # Another client is served meanwhile, every byte checked.
            for k in range(20):
                data = pattern(64 * 1024, k)
                t0 = time.monotonic()
                ctl.set_tensor(small.tensor(), data)
                assert digest(ctl.get_tensor(small.tensor())) == digest(data)
                worst = max(worst, time.monotonic() - t0)
                peak = max(peak, rss(d))
                time.sleep(0.05)
            now = ctl.server_stats()["commands"]
            ran = (now["GET_TENSOR"] - gets["GET_TENSOR"] - 20  # the other client's 20
                   + now["GET_TENSORS"] - gets["GET_TENSORS"])
            # The daemon stopped reading the slow connection after its first reply.
            assert 1 <= ran <= 2, f"{ran} of {REQUESTS} pipelined requests were run"
            print(f"{scheme}: RSS +{(peak - before) / MiB:.2f} MiB, {ran} run, "
                  f"other client worst {worst * 1e3:.1f} ms")
            assert peak - before < BOUND, f"{scheme}: RSS grew {(peak - before) / MiB:.1f} MiB"
            assert worst < 2.0, f"the other client waited {worst:.2f} s"
            # Freed while the reply still refers to it: held, and counted as held.
            ctl.free_buffer(big)
            assert _lingering(d) >= SIZE
        finally:
            slow.close()
        # The reader gone (mid-reply), what its reply held goes too.
        assert wait_until(lambda: _lingering(d) == 0, 5), _lingering(d)
        assert wait_until(lambda: rss(d) - before < BOUND, 5)
        ctl.free_buffer(small)
    assert d.alive()


def _lingering(d: DaemonProcess) -> float:
    assert d.metrics_url is not None
    return metric(scrape(d.metrics_url), "transferd_buffer_lingering_bytes", device="cpu")


def test_the_metrics_endpoint_refuses_what_is_not_a_scrape(
    served: tuple[DaemonProcess, str],
) -> None:
    d, _ = served
    assert d.metrics_url is not None
    host, _, rest = d.metrics_url.removeprefix("http://").partition(":")
    port = int(rest.partition("/")[0])

    def ask(raw: bytes) -> bytes:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(raw)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out

    assert ask(b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405")
    assert ask(b"GET /secrets HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")
    assert ask(b"NONSENSE\r\n\r\n").startswith(b"HTTP/1.1 400")
    # Headers one byte over 8 KiB: refused, never buffered further.
    assert ask(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 8192 + b"\r\n\r\n").startswith(
        b"HTTP/1.1 431")
    page = ask(b"GET /metrics?name[]=transferd_open_connections HTTP/1.0\r\n\r\n")
    assert page.startswith(b"HTTP/1.1 200") and b"transferd_open_connections" in page
    assert b"transferd_buffer_allocated_bytes" not in page  # only the names asked for
    head = ask(b"HEAD /metrics HTTP/1.0\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")


def test_slow_and_silent_metrics_clients_are_bounded(served: tuple[DaemonProcess, str]) -> None:
    d, _ = served
    assert d.metrics_url is not None
    host, _, rest = d.metrics_url.removeprefix("http://").partition(":")
    port = int(rest.partition("/")[0])
    before_threads, before = _threads(d), rss(d)
    socks = []
    try:
        for k in range(300):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(5)
            s.connect((host, port))
            if k % 3 == 1:
                s.sendall(b"GET /metr")  # half a request, never finished
            elif k % 3 == 2:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 50)  # never read
            socks.append(s)
        time.sleep(0.3)
        # A scrape is answered meanwhile.
        with urllib.request.urlopen(d.metrics_url, timeout=5) as r:
            assert b"transferd_open_connections" in r.read()
        assert _threads(d) - before_threads <= 2, (before_threads, _threads(d))
        assert rss(d) - before < BOUND, (rss(d) - before) / MiB
        # Every one of them is closed at the timeout (metrics.timeout_s = 2 here).
        t0 = time.monotonic()
        for s in socks:
            s.settimeout(max(0.1, 6 - (time.monotonic() - t0)))
            try:
                while s.recv(65536):
                    pass
            except (ConnectionResetError, BrokenPipeError):
                pass
        assert time.monotonic() - t0 < 6
    finally:
        for s in socks:
            s.close()
    assert d.alive()
