"""Failed handshakes are visible on the daemon that refused them (issue 23, item 1).

Client plane: a wrong token (the client hangs up after the server's proof), a missing
token, an AUTH that never comes, each one WARNING naming the source and counted in
``transferd_auth_failures_total`` by reason, and a flood from one source one line.  Peer
plane: daemons with different cluster secrets, or one without: the receiving daemon logs
who dialled it and both count it; each side's message says which side lacks what.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import SyncClient
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, metric, scrape, wait_until
from transferd.authlog import AuthFailures
from transferd.protocol import auth
from transferd.protocol.constants import PROTO_MAJOR, Command
from transferd.protocol.errors import PeerUnreachable, Unauthorized

SECRET = "the-right-token"
FAILED = "client authentication failed from 127.0.0.1:"


def failures(d: DaemonProcess, plane: str, reason: str) -> float:
    assert d.metrics_url is not None
    return metric(scrape(d.metrics_url), "transferd_auth_failures_total", plane=plane,
                  reason=reason)


@pytest.fixture
def secured(daemon_factory: DaemonFactory, tmp_path: Path) -> Iterator[DaemonProcess]:
    tok = tmp_path / "token"
    tok.write_text(SECRET)
    tok.chmod(0o600)
    yield daemon_factory(["--token-file", str(tok)],
                         env={"TRANSFERD_SERVER_HANDSHAKE_TIMEOUT_S": "0.5"})


def test_a_wrong_token_is_logged_counted_and_blamed_on_the_token(secured: DaemonProcess) -> None:
    with pytest.raises(Unauthorized) as err:
        SyncClient.connect(secured.url, token="not-the-token")
    # The client is told its token is wrong, not that the server is.
    assert "token is wrong" in str(err.value) and "does not know" not in str(err.value)
    assert wait_until(lambda: FAILED in secured.stderr, 5), secured.stderr
    line = next(ln for ln in secured.stderr.splitlines() if FAILED in ln)
    assert "WARNING transferd.auth" in line and "(wrong_secret)" in line
    assert "hung up after the server's proof" in line and "server.token" in line
    assert failures(secured, "client", "wrong_secret") == 1
    # The right token still works, and counts nothing.
    with SyncClient.connect(secured.url, token=SECRET) as c:
        c.synchronize()
    assert failures(secured, "client", "wrong_secret") == 1


def test_a_missing_token_says_the_client_gave_none(secured: DaemonProcess) -> None:
    with pytest.raises(Unauthorized, match="the client gave none"):
        SyncClient.connect(secured.url)
    assert wait_until(lambda: failures(secured, "client", "no_secret") == 1, 5)
    assert "(no_secret): authentication required" in secured.stderr


def _hang_up_after_the_proof(d: DaemonProcess) -> None:
    with RawConn.to(d) as raw:
        raw.send(Command.HELLO, {"major": PROTO_MAJOR, "minor": 2, "client": "raw",
                                 "auth": auth.HMAC_SHA256, "nonce": auth.fresh_nonce()})
        assert "proof" in raw.recv().body


def test_a_flood_from_one_source_is_one_line_and_every_failure_counted(
    secured: DaemonProcess,
) -> None:
    for _ in range(30):
        _hang_up_after_the_proof(secured)
    assert wait_until(lambda: failures(secured, "client", "wrong_secret") == 30, 5)
    assert secured.stderr.count(FAILED) == 1, secured.stderr


def test_an_auth_that_never_comes_is_one_warning(secured: DaemonProcess) -> None:
    with RawConn.to(secured) as raw:
        raw.send(Command.HELLO, {"major": PROTO_MAJOR, "minor": 2, "client": "raw",
                                 "auth": auth.HMAC_SHA256, "nonce": auth.fresh_nonce()})
        raw.recv()
        assert raw.closed_by_peer(5)  # the handshake timeout (0.5 s)
    assert wait_until(lambda: failures(secured, "client", "timeout") == 1, 5)
    assert "(timeout): AUTH did not arrive within 0.5 s" in secured.stderr
    assert "TIMEOUT on AUTH" not in secured.stderr  # not logged a second time, at INFO
    assert failures(secured, "client", "wrong_secret") == 0


def test_a_connection_closed_before_hello_is_no_failure(secured: DaemonProcess) -> None:
    # What a TCP health check does.
    socket.create_connection(secured.host_port, timeout=5).close()
    with SyncClient.connect(secured.url, token=SECRET) as c:  # it was seen, and served
        c.synchronize()
    assert sum(failures(secured, "client", r) for r in ("wrong_secret", "no_secret",
                                                        "timeout", "protocol")) == 0
    assert FAILED not in secured.stderr


# -- the peer plane ------------------------------------------------------------------


def _secret(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    p.chmod(0o600)
    return str(p)


def _write(src: DaemonProcess, dst: DaemonProcess) -> Exception:
    with SyncClient.connect(src.url) as a, SyncClient.connect(dst.url) as b:
        (mr, _), (_, desc) = a.reg_mr(a.alloc_buffer(4096)), b.reg_mr(b.alloc_buffer(4096))
        with pytest.raises(PeerUnreachable) as err:
            a.wait(a.submit_single_write(4096, 1, (mr, 0), (desc, 0)), 20)
        return err.value


def _peer_line(d: DaemonProcess) -> str:
    return next(ln for ln in d.stderr.splitlines() if "peer handshake failed from" in ln)


def test_different_cluster_secrets_are_logged_where_refused(tmp_path: Path) -> None:
    with DaemonProcess(env={"TRANSFERD_ENGINE_SECRET_FILE": _secret(tmp_path, "a", "one")}) \
            as a, DaemonProcess(env={"TRANSFERD_ENGINE_SECRET_FILE": _secret(tmp_path, "b",
                                                                               "two")}) as b:
        err = _write(a, b)
        assert "did not prove the cluster secret" in str(err) and "differs" in str(err)
        # The receiving daemon says who dialled it (its address and the node it claims).
        assert wait_until(lambda: "peer handshake failed from 127.0.0.1:" in b.stderr, 5)
        line = _peer_line(b)
        assert "WARNING transferd.auth" in line and "(wrong_secret)" in line
        node = next(ln for ln in a.output().splitlines() if "engine " in ln).split()[2]
        assert f"node {node}" in line and "engine.secret_file differs" in line
        assert failures(b, "peer", "wrong_secret") >= 1
        assert failures(a, "peer", "wrong_secret") >= 1


def test_a_missing_cluster_secret_names_the_side_that_lacks_it(tmp_path: Path) -> None:
    with DaemonProcess(env={"TRANSFERD_ENGINE_SECRET_FILE": _secret(tmp_path, "a", "one")}) \
            as a, DaemonProcess() as b:
        # a (with a secret) dials b (without): b refuses, and the text travels back.
        err = _write(a, b)
        assert ("the receiving daemon has no cluster secret (engine.secret_file) and the "
                "dialling daemon has one") in str(err)
        assert "this daemon has no" not in str(err)  # never "this daemon" for the peer
        assert wait_until(lambda: "peer handshake failed from" in b.stderr, 5)
        assert "(no_secret)" in _peer_line(b) and "WARNING" in _peer_line(b)
        # b dials a: a refuses.
        err = _write(b, a)
        assert "the receiving daemon requires the cluster secret" in str(err)
        assert "the dialling daemon has none" in str(err)
        assert wait_until(lambda: "peer handshake failed from" in a.stderr, 5)
        assert "(no_secret)" in _peer_line(a)
        for d in (a, b):
            assert failures(d, "peer", "no_secret") >= 2  # refused here, and refused there


# -- the tally and its window ------------------------------------------------------------


def test_one_line_per_source_per_window_and_what_was_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    f = AuthFailures(clock=lambda: now[0], window_s=10.0)
    with caplog.at_level("WARNING", logger="transferd.auth"):
        for _ in range(5):
            f.failed("client", "wrong_secret", "10.0.0.1:5000", "wrong")
        f.failed("client", "wrong_secret", "10.0.0.2:5000", "wrong")  # another source
        f.failed("client", "no_secret", "10.0.0.1:6000", "none")  # another reason
        assert len(caplog.records) == 3
        now[0] += 10.0
        f.failed("client", "wrong_secret", "10.0.0.1:5001", "wrong")
    last = caplog.records[-1].getMessage()
    assert "[4 more from 10.0.0.1 like this in the last 10 s]" in last
    assert f.count("client", "wrong_secret") == 7 and f.count("client", "no_secret") == 1
    f.failed("peer", "made-up", "[::1]:9", "x")  # an unknown reason is "protocol"
    assert f.count("peer", "protocol") == 1
