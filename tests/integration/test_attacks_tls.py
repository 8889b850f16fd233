"""A stranger on a tls:// listener that never finishes the TLS handshake, against a live daemon.

The loop's own TLS server gives the protocol its connection only after the TLS
handshake and waits 60 s for it, so such connections escaped the per-source cap
and the handshake timeout (300 silent ones from one source, cap 20, timeout
1.5 s: none refused, none closed 3.5 s later).  Now the TCP connection counts
against the caps from its accept and the TLS handshake has the handshake
timeout; an honest TLS client is served throughout.
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import SyncClient
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, digest, pattern, rss, wait_until
from tests.integration.test_transports import make_cert

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
MiB = 1 << 20


@pytest.fixture
def tls_daemon(daemon_factory: DaemonFactory, tmp_path: Path) -> Iterator[tuple[DaemonProcess,
                                                                                 str]]:
    cert, key = make_cert(tmp_path)
    d = daemon_factory(["--listen", "tls://127.0.0.1:0"], env={
        "TRANSFERD_SERVER_TLS_CERT": cert, "TRANSFERD_SERVER_TLS_KEY": key,
        "TRANSFERD_SERVER_HANDSHAKE_TIMEOUT_S": "1",
        "TRANSFERD_SERVER_MAX_HANDSHAKES_PER_SOURCE": "20",
    })
    yield d, cert


def _closed(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(100) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_silent_tls_connections_are_capped_and_timed_out(
    tls_daemon: tuple[DaemonProcess, str],
) -> None:
    d, cert = tls_daemon
    url = d.url_for("tls")
    host, _, port = url[len("tls://"):].rpartition(":")
    with SyncClient(url, tls_ca=cert) as good:
        before = rss(d)
        t0 = time.monotonic()
        socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(60)]
        try:
            time.sleep(0.3)
            # 20 are held (the cap per source), the other 40 were closed when accepted.
            held = [s for s in socks if not _closed(s, 0.01)]
            assert len(held) == 20, len(held)
            assert rss(d) - before < 4 * MiB
            data = pattern(8192, 3)
            buf = good.alloc_buffer(8192)  # an authenticated client is not held up
            good.set_tensor(buf.tensor(), data)
            assert digest(good.get_tensor(buf.tensor())) == digest(data)
            # ...and the 20 are closed once the 1 s handshake timeout has passed.
            assert all(_closed(s, 5) for s in held)
            assert 0.9 <= time.monotonic() - t0 < 5
        finally:
            for s in socks:
                s.close()
        # Room again for new TLS clients.
        assert wait_until(lambda: SyncClient(url, tls_ca=cert).close() is None, 5)
        good.free_buffer(buf)
    assert d.alive()
