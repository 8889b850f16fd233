"""Listening and connecting by URL: tcp, tls, unix, seqpacket, on one daemon at once."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import Client
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, async_test, digest, pattern, start_daemon
from transferd.exits import Exit
from transferd.protocol.errors import PeerUnreachable, TransferdError

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def make_cert(where: Path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (the test's own CA, too)."""
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )
    return str(cert), str(key)


@pytest.fixture(scope="module")
def certs() -> Iterator[tuple[str, str]]:
    d = Path(tempfile.mkdtemp(prefix="td-tls-"))
    try:
        yield make_cert(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def everywhere(certs: tuple[str, str]) -> Iterator[DaemonProcess]:
    """One daemon on all four transports."""
    d = Path(tempfile.mkdtemp(prefix="td-sock-", dir="/tmp"))
    cert, key = certs
    daemon = start_daemon(
        ["--listen", "tls://127.0.0.1:0", "--listen", f"seqpacket://{d}/s.sock",
         "--unix", f"{d}/u.sock"],
        env={"TRANSFERD_SERVER_TLS_CERT": cert, "TRANSFERD_SERVER_TLS_KEY": key},
    )
    try:
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(d, ignore_errors=True)


def _url(d: DaemonProcess, scheme: str) -> str:
    (url,) = [u for u in d.urls if u.startswith(scheme + "://")]
    return url


@pytest.mark.parametrize("scheme", ["tcp", "tls", "unix", "seqpacket"])
@async_test()
async def test_round_trip_over_each_transport(
    everywhere: DaemonProcess, certs: tuple[str, str], scheme: str
) -> None:
    url = _url(everywhere, scheme)
    async with await Client.connect(url, tls_ca=certs[0]) as c:
        assert c.minor == 2
        b = await c.alloc_buffer(8 << 20)
        # Sizes around the message transport's 256 KiB continuation size.
        for i, size in enumerate((1, 4096, 262143, 262144, 262145, 5 << 20)):
            data = pattern(size, i)
            await c.set_tensor(b.tensor(0, size), data)
            out = bytearray(size)
            await c.get_tensor(b.tensor(0, size), out=out)
            assert digest(out) == digest(data), (scheme, size)
        # A batch in both directions too.
        datas = [pattern(1000 + i, i) for i in range(50)]
        offs = [i * 4096 for i in range(50)]
        for o, data in zip(offs, datas, strict=True):
            c.set_tensor_async(b.tensor(o, len(data)), data)
        futs = [c.get_tensor_async(b.tensor(o, len(data)))
                for o, data in zip(offs, datas, strict=True)]
        await c.synchronize()
        assert [digest(f.result()) for f in futs] == [digest(x) for x in datas]
    assert everywhere.alive()


@async_test()
async def test_only_a_message_transport_announces_max_message(everywhere: DaemonProcess) -> None:
    from tests.helpers import RawConn

    with RawConn.to(everywhere) as raw:
        assert "max_message" not in raw.hello().body
    async with await Client.connect(_url(everywhere, "seqpacket")) as c:
        assert c.conn.transport is not None
        assert c.conn.transport.get_extra_info("transferd_message")
        assert c.conn.transport.continuation.max_message == 256 * 1024  # type: ignore[attr-defined]


@async_test()
async def test_tls_refuses_a_server_it_cannot_verify(everywhere: DaemonProcess) -> None:
    with pytest.raises((PeerUnreachable, TransferdError)):
        await Client.connect(_url(everywhere, "tls"), connect_timeout=5)


def test_listen_from_the_config_file_and_transferd_serve(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    sock = tmp_path / "cfg.sock"
    cfg = tmp_path / "t.toml"
    cfg.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = 0\nlisten = ["seqpacket://{sock}"]\n'
        "[metrics]\nport = 0\n"
    )
    d = daemon_factory(
        command=[sys.executable, "-m", "transferd.cli", "serve", "-c", str(cfg),
                 "--listen", f"unix://{tmp_path}/cli.sock"]
    )
    # The flag replaces the file's list (flags win over files).
    assert [u.split("://")[0] for u in d.urls] == ["tcp", "unix"]
    d2 = daemon_factory(command=[sys.executable, "-m", "transferd.cli", "serve", "-c", str(cfg)])
    assert _url(d2, "seqpacket") == f"seqpacket://{sock}"


def test_a_tls_listener_without_a_certificate_is_a_config_error(tmp_path: Path) -> None:
    d = DaemonProcess(["--listen", "tls://127.0.0.1:0"]).start()
    try:
        rc = d.proc.wait(30) if d.proc else None
        assert rc == Exit.CONFIG, d.output()
        assert "tls_cert" in d.stderr
    finally:
        d.stop()


def test_an_unknown_scheme_is_a_config_error() -> None:
    d = DaemonProcess(["--listen", "carrier-pigeon://x"]).start()
    try:
        assert (d.proc.wait(30) if d.proc else None) == Exit.CONFIG
        assert "unknown transport" in d.stderr
    finally:
        d.stop()


@async_test()
async def test_connect_to_a_missing_socket_fails_fast(tmp_path: Path) -> None:
    for scheme in ("unix", "seqpacket"):
        with pytest.raises(PeerUnreachable):
            await Client.connect(f"{scheme}://{tmp_path}/nobody.sock", connect_timeout=2)


@pytest.mark.parametrize("scheme", ["unix", "seqpacket"])
@async_test()
async def test_a_shared_buffer_arrives_over_each_descriptor_transport(
    everywhere: DaemonProcess, scheme: str
) -> None:
    """The descriptor path end to end: the daemon's memfd, mapped here, same pages."""
    async with await Client.connect(_url(everywhere, scheme)) as c:
        assert c.conn.carries_fds
        buf = await c.alloc_buffer(1 << 20, device="shm")
        data = pattern(1 << 20, 5)
        buf.view[:] = data  # type: ignore[attr-defined]
        assert digest(await c.get_tensor(buf.tensor())) == digest(data)
        await c.set_tensor(buf.tensor(0, 4096), pattern(4096, 6))
        assert bytes(buf.view[:4096]) == pattern(4096, 6)  # type: ignore[attr-defined]


def test_a_tls_handshake_that_never_comes_is_closed(
    daemon_factory: DaemonFactory, certs: tuple[str, str]
) -> None:
    import contextlib
    import socket
    import time

    cert, key = certs
    d = daemon_factory(["--listen", "tls://127.0.0.1:0"],
                       env={"TRANSFERD_SERVER_TLS_CERT": cert, "TRANSFERD_SERVER_TLS_KEY": key,
                            "TRANSFERD_SERVER_HANDSHAKE_TIMEOUT_S": "0.5"})
    host, _, port = _url(d, "tls")[len("tls://"):].rpartition(":")
    t0 = time.monotonic()
    # Not a byte of TLS: the server gives up after the handshake timeout.
    with (socket.create_connection((host, int(port)), timeout=10) as s,
          contextlib.suppress(ConnectionResetError)):
        assert s.recv(1) == b""
    assert 0.4 <= time.monotonic() - t0 < 8
    assert d.alive()
