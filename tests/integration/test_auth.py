"""Authentication against live daemons: hmac-sha256, the token method, secrets, refusals.

Raw sockets do the protocol by hand where the test is about the bytes (a wrong
mac, a mac replayed from another connection, a frame where AUTH is due).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client import Client, SyncClient
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, async_test, digest, pattern, wait_until
from transferd.exits import Exit
from transferd.protocol import auth
from transferd.protocol.constants import PROTO_MAJOR, Command, ErrorCode, Flag
from transferd.protocol.errors import Unauthorized

SECRET = "s3cret-t0ken"


@pytest.fixture
def secured(daemon_factory: DaemonFactory, tmp_path: Path) -> Iterator[DaemonProcess]:
    """A daemon that requires the secret (from a file), on tcp and a Unix socket."""
    tok = tmp_path / "token"
    tok.write_text(f"  {SECRET}\n")  # outer whitespace is not part of the secret
    tok.chmod(0o600)
    d = daemon_factory(["--token-file", str(tok), "--unix", f"{tmp_path}/u.sock"])
    yield d


def hello_hmac(raw: RawConn, nonce: bytes) -> Any:
    raw.send(Command.HELLO, {"major": PROTO_MAJOR, "minor": 2, "client": "raw",
                             "auth": auth.HMAC_SHA256, "nonce": nonce})
    return raw.recv()


def test_hmac_sha256_on_the_wire(secured: DaemonProcess) -> None:
    with RawConn.to(secured) as raw:
        nonce = auth.fresh_nonce()
        f = hello_hmac(raw, nonce)
        assert f.flags == Flag.REPLY and f.body["auth"] == ["hmac-sha256"]  # tcp: no token
        challenge, proof = f.body["challenge"], f.body["proof"]
        assert len(challenge) == 32
        # The server knows the secret: its proof checks out with ours.
        assert proof == auth.server_proof(SECRET.encode(), nonce, challenge)
        raw.send(Command.AUTH, {"mac": auth.client_mac(SECRET.encode(), challenge, nonce)})
        a = raw.recv()
        assert a.cmd == Command.AUTH and a.flags == Flag.REPLY and a.body == {}
        assert raw.request(Command.SYNCHRONIZE).flags == Flag.REPLY


def test_every_connection_gets_a_fresh_challenge_and_a_replayed_mac_fails(
    secured: DaemonProcess,
) -> None:
    nonce = auth.fresh_nonce()
    with RawConn.to(secured) as first:
        c1 = hello_hmac(first, nonce).body["challenge"]
        good_mac = auth.client_mac(SECRET.encode(), c1, nonce)
        first.send(Command.AUTH, {"mac": good_mac})
        assert not first.recv().is_error
    with RawConn.to(secured) as replay:
        # Same nonce, but the server's challenge differs: the old mac is useless.
        c2 = hello_hmac(replay, nonce).body["challenge"]
        assert c2 != c1
        replay.send(Command.AUTH, {"mac": good_mac})
        f = replay.recv()
        assert f.is_error and f.body["code"] == ErrorCode.UNAUTHORIZED
        assert replay.closed_by_peer()


@pytest.mark.parametrize(
    "mac", [b"\x00" * 32, b"short", "a string", None], ids=["wrong", "short", "str", "missing"]
)
def test_a_bad_mac_is_unauthorized_and_closes(secured: DaemonProcess, mac: Any) -> None:
    with RawConn.to(secured) as raw:
        hello_hmac(raw, auth.fresh_nonce())
        raw.send(Command.AUTH, {} if mac is None else {"mac": mac})
        f = raw.recv()
        assert f.cmd == Command.AUTH and f.is_error
        assert f.body["code"] == ErrorCode.UNAUTHORIZED
        assert raw.closed_by_peer()


def test_only_auth_where_auth_is_due(secured: DaemonProcess) -> None:
    with RawConn.to(secured) as raw:
        hello_hmac(raw, auth.fresh_nonce())
        raw.send(Command.GET_DEVICES, seq=77)
        f = raw.recv()
        assert f.seq == 77 and f.body["code"] == ErrorCode.UNAUTHORIZED
        assert raw.closed_by_peer()
    with RawConn.to(secured) as raw:
        hello_hmac(raw, auth.fresh_nonce())
        # AUTH with a payload, or a body over 4096 bytes: refused from the header.
        raw.send(Command.AUTH, {"mac": b"x" * 32}, payload=b"p" * 10)
        assert raw.recv().body["code"] == ErrorCode.TOO_LARGE
        assert raw.closed_by_peer()


def test_hello_without_a_secret_lists_the_methods(secured: DaemonProcess) -> None:
    with RawConn.to(secured) as raw:
        f = raw.hello()
        assert f.body["code"] == ErrorCode.UNAUTHORIZED and "hmac-sha256" in f.body["message"]
        assert raw.closed_by_peer()


def test_the_token_method_only_where_it_is_offered(secured: DaemonProcess) -> None:
    # TCP: the token would cross the wire in clear, so it is not offered.
    with RawConn.to(secured) as raw:
        f = raw.hello(token=SECRET)
        assert f.body["code"] == ErrorCode.UNAUTHORIZED and "hmac-sha256" in f.body["message"]
    # The Unix socket offers it.
    assert secured.unix_url is not None
    with RawConn.at(secured.unix_url) as raw:
        f = raw.hello(token=SECRET)
        assert f.flags == Flag.REPLY and f.body["auth"] == ["hmac-sha256", "token"]
        assert raw.request(Command.SYNCHRONIZE).flags == Flag.REPLY
    for wrong in ("", "s3cret", SECRET + "x", SECRET.upper()):
        with RawConn.at(secured.unix_url) as raw:
            assert raw.hello(token=wrong).body["code"] == ErrorCode.UNAUTHORIZED, wrong
            assert raw.closed_by_peer()


@async_test()
async def test_the_client_uses_hmac_and_checks_the_server(
    secured: DaemonProcess, daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    async with await Client.connect(secured.url, token=SECRET) as c:
        buf = await c.alloc_buffer(4096)
        data = pattern(4096, 3)
        await c.set_tensor(buf.tensor(), data)
        assert digest(await c.get_tensor(buf.tensor())) == digest(data)
        # The token method, asked for explicitly, on the Unix socket.
    async with await Client.connect(secured.unix_url or "", token=SECRET, auth="token") as c:
        assert c.minor == 2
    with pytest.raises(Unauthorized):
        await Client.connect(secured.url)
    with pytest.raises(Unauthorized, match="proof"):
        # A wrong secret: the client sees the server's proof fail and stops
        # before sending anything derived from its own secret.
        await Client.connect(secured.url, token="wrong")
    # A client that holds a secret uses only a server that proves it knows it: one that
    # requires nothing could be anyone (issue 16: it was accepted and got the tensors).
    plain = daemon_factory()
    with pytest.raises(Unauthorized, match="does not ask for authentication"):
        await Client.connect(plain.url, token="anything")
    async with await Client.connect(plain.url) as c:
        assert c.minor == 2
    assert secured.alive()


def test_secret_from_the_environment(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(env={"TRANSFERD_SERVER_TOKEN": "from-env"})
    with pytest.raises(Unauthorized):
        SyncClient(d.url, token="nope")
    with SyncClient(d.url, token="from-env") as c:
        assert c.minor == 2


@pytest.mark.parametrize("argv", [["rpc_server.cli"], ["transferd.cli", "serve"]])
def test_token_on_the_command_line_is_refused(argv: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", *argv, "--token", "visible-in-ps"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == Exit.CONFIG
    assert "--token-file" in r.stderr and "TRANSFERD_SERVER_TOKEN" in r.stderr
    assert "ps" in r.stderr


def test_an_unreadable_token_file_is_a_config_error(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "rpc_server.cli", "-p", "0",
                        "--token-file", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == Exit.CONFIG and "server.token_file" in r.stderr


def test_failures_are_logged_with_the_source_and_slowed_down(secured: DaemonProcess) -> None:
    took = []
    for _ in range(5):
        with RawConn.to(secured) as raw:
            t0 = time.monotonic()
            hello_hmac(raw, auth.fresh_nonce())
            raw.send(Command.AUTH, {"mac": b"\x00" * 32})
            assert raw.recv().body["code"] == ErrorCode.UNAUTHORIZED
            took.append(time.monotonic() - t0)
    # 0.05, 0.1, 0.2, 0.4, 0.8 s: each failure from this source waits twice as long.
    assert took[-1] >= 0.7 and took[-1] > 3 * took[0], took
    assert wait_until(lambda: "authentication failed from 127.0.0.1:" in secured.stderr, 5)
    assert "wrong mac" in secured.stderr
    # A client with the secret is not held back.
    with SyncClient(secured.url, token=SECRET) as c:
        assert c.minor == 2
