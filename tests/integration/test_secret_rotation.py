"""Rotating secrets on live daemons (issue 16.3), and secret files others can read (16.11).

A rotation rewrites the secret files in place and sends SIGHUP: the daemon compares the
files' contents with what it uses, switches, and logs which key changed (never a value).
``server.previous_token_file`` / ``engine.previous_secret_file`` hold the old secret
meanwhile, so clients and peers with either are served while a fleet is updated.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from client import SyncClient
from tests.conftest import DaemonFactory
from tests.helpers import REPO, DaemonProcess, RawConn, async_test, wait_until
from tests.integration.engine_cluster import (
    HANDSHAKE_TIMEOUT_S,
    RAILS,
    WAIT,
    Node,
    engine_env,
    fresh_imm,
    nodes,
    start_many,
)
from tests.integration.fake_peer import FakePeer, handshake_error
from transferd.exits import Exit
from transferd.protocol import auth
from transferd.protocol.constants import PROTO_MAJOR, Command
from transferd.protocol.errors import Unauthorized

OLD = "old-secret-0123456789abcdef0123456789abcdef"
NEW = "new-secret-fedcba9876543210fedcba9876543210"
ONE = "cluster-secret-one-7f3a9c0e5b2d4f61"
TWO = "cluster-secret-two-1e8d6b4a2c0f9e73"


def write_secret(path: Path, text: str, mode: int = 0o600) -> None:
    """Rewrite ``path`` in place (as an operator's editor or `install` would)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    path.chmod(mode)


def reload(d: DaemonProcess, expect: str) -> None:
    """SIGHUP, then wait for ``expect`` in the log (after this reload's mark)."""
    assert d.proc is not None
    mark = len(d.stderr)
    d.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: expect in d.stderr[mark:], 10), d.stderr[mark:]


def accepted(d: DaemonProcess, token: str) -> bool:
    try:
        with SyncClient(d.url, token=token) as c:
            c.get_devices()
    except Unauthorized:
        return False
    return True


def test_sighup_switches_to_the_new_client_secret(daemon_factory: DaemonFactory,
                                                  tmp_path: Path) -> None:
    """The issue: the file rewritten and SIGHUP said "configuration unchanged" and kept
    the old secret.  Now the new one is in use at once and the old one refused; a
    connection opened before stays; neither secret is ever logged; a file another user
    could read is refused at the reload and the running secret stays."""
    cur = tmp_path / "token"
    write_secret(cur, OLD)
    d = daemon_factory(["--token-file", str(cur)])
    with SyncClient(d.url, token=OLD) as before, RawConn.to(d) as midway:
        # A handshake under way when the file is swapped: its HELLO proved the old one.
        nonce = auth.fresh_nonce()
        midway.send(Command.HELLO, {"major": PROTO_MAJOR, "minor": 2, "client": "raw",
                                    "auth": auth.HMAC_SHA256, "nonce": nonce})
        ch = midway.recv().body["challenge"]
        write_secret(cur, NEW)
        reload(d, "SIGHUP: applied")
        assert "server.token_file: the client secret replaced" in d.stderr, d.stderr
        midway.send(Command.AUTH, {"mac": auth.client_mac(OLD.encode(), ch, nonce)})
        assert midway.recv().body == {}  # finished under what its HELLO proved
        assert accepted(d, NEW) and not accepted(d, OLD)
        assert before.get_devices()  # opened under the old secret: it stays
        write_secret(cur, OLD, 0o644)
        reload(d, "a secret file is refused")
        assert "chmod 600" in d.stderr
        assert accepted(d, NEW) and not accepted(d, OLD)
    assert OLD not in d.stderr and NEW not in d.stderr
    assert d.alive()


def test_previous_token_file_accepts_both_during_a_rotation(daemon_factory: DaemonFactory,
                                                            tmp_path: Path) -> None:
    """A window where clients with the old secret and clients with the new one are both
    served (the daemon proves both), then the old one refused once the file is emptied."""
    cur, prev = tmp_path / "token", tmp_path / "token.previous"
    write_secret(cur, OLD)
    write_secret(prev, "")  # set up once; empty between rotations
    d = daemon_factory(["--token-file", str(cur), "--unix", str(tmp_path / "u.sock")],
                       env={"TRANSFERD_SERVER_PREVIOUS_TOKEN_FILE": str(prev)})
    assert accepted(d, OLD) and not accepted(d, NEW)
    # 1. The daemon gets the new secret; the old one stays accepted.
    write_secret(prev, OLD)
    write_secret(cur, NEW)
    reload(d, "SIGHUP: applied")
    assert "server.previous_token_file: the previous client secret set (accepted beside " \
        "the current one until this file is emptied)" in d.stderr
    assert accepted(d, NEW) and accepted(d, OLD)
    for token in (OLD, NEW):  # the token method too, where it is offered
        with SyncClient(f"unix://{tmp_path / 'u.sock'}", token=token, auth="token") as c:
            assert c.get_devices()
    # On the wire: the usual proof under the new secret, and the old one's beside it.
    with RawConn.to(d) as raw:
        nonce = auth.fresh_nonce()
        raw.send(Command.HELLO, {"major": PROTO_MAJOR, "minor": 2, "client": "raw",
                                 "auth": auth.HMAC_SHA256, "nonce": nonce})
        body = raw.recv().body
        ch = body["challenge"]
        assert body["proof"] == auth.server_proof(NEW.encode(), nonce, ch)
        assert body["previous_proof"] == auth.server_proof(OLD.encode(), nonce, ch)
        raw.send(Command.AUTH, {"mac": auth.client_mac(OLD.encode(), ch, nonce)})
        assert raw.recv().body == {}
    # 2. Every client has the new secret: the window closes.
    write_secret(prev, "")
    reload(d, "server.previous_token_file: the previous client secret removed")
    assert accepted(d, NEW) and not accepted(d, OLD)
    assert OLD not in d.stderr and NEW not in d.stderr


def test_a_reload_cannot_take_the_client_secret_away(tmp_path: Path) -> None:
    """The token_file line deleted from the configuration (a slip in an edit), then
    SIGHUP: the daemon went on without any secret, open to every client that reaches
    it, and said so at INFO only.  As for the cluster secret, taking it away needs a
    restart: the reload keeps the running secret and says so at WARNING."""
    token = tmp_path / "token"
    write_secret(token, OLD)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[server]\nport = 0\ntoken_file = \"{token}\"\n[metrics]\nport = 0\n")
    with DaemonProcess(command=[sys.executable, "-m", "transferd.cli", "serve", "-c",
                                str(cfg)]) as d:
        cfg.write_text("[server]\nport = 0\n[metrics]\nport = 0\n")
        reload(d, "SIGHUP: not applied, needs a restart")
        assert "removing the client secret" in d.stderr, d.stderr
        assert not accepted(d, "")  # no token: still refused
        assert accepted(d, OLD)


def contract_only(d: DaemonProcess, secret: str) -> bool:
    """A client written from PROTOCOL.md alone: it checks ``proof`` (nothing else: an
    unknown key such as ``previous_proof`` is not its business) and closes when that is
    wrong; True when the daemon then accepts its AUTH."""
    with RawConn.to(d) as raw:
        nonce = auth.fresh_nonce()
        raw.send(Command.HELLO, {"major": PROTO_MAJOR, "minor": 2, "client": "contract",
                                 "auth": auth.HMAC_SHA256, "nonce": nonce})
        body = raw.recv().body
        if body["proof"] != auth.server_proof(secret.encode(), nonce, body["challenge"]):
            return False  # PROTOCOL.md: "closes if it is wrong"
        raw.send(Command.AUTH, {"mac": auth.client_mac(secret.encode(), body["challenge"],
                                                       nonce)})
        return raw.recv().body == {}


def test_a_client_that_checks_only_proof_during_a_rotation(daemon_factory: DaemonFactory,
                                                           tmp_path: Path) -> None:
    """``proof`` is made with the secret in server.token_file: a client that reads only
    it (PROTOCOL.md) is served during a window with that secret alone.  So for such
    clients the new secret goes into the previous file first (accepted ahead, proved in
    ``previous_proof``): they keep working on the old one while this library's clients
    switch; the files are swapped when they switch (docs/security.md)."""
    cur, prev = tmp_path / "token", tmp_path / "token.previous"
    write_secret(cur, NEW)
    write_secret(prev, OLD)
    d = daemon_factory(["--token-file", str(cur)],
                       env={"TRANSFERD_SERVER_PREVIOUS_TOKEN_FILE": str(prev)})
    assert contract_only(d, NEW) and not contract_only(d, OLD)
    assert accepted(d, OLD) and accepted(d, NEW)
    # The new secret accepted ahead: the old one still proved in `proof`.
    write_secret(cur, OLD)
    write_secret(prev, NEW)
    reload(d, "SIGHUP: applied")
    assert contract_only(d, OLD) and not contract_only(d, NEW)
    assert accepted(d, OLD) and accepted(d, NEW)


@async_test(timeout=60)
async def test_sighup_switches_to_the_new_cluster_secret(tmp_path: Path) -> None:
    """X had ONE, Z has TWO: once X's file says TWO and X reloads, they link both ways
    (before: the reload did not look at engine.secret_file at all)."""
    sx, sz = tmp_path / "x.secret", tmp_path / "z.secret"
    write_secret(sx, ONE)
    write_secret(sz, TWO)
    x, z = start_many([
        {"env": engine_env(RAILS["a"], secret_file=sx, handshake_timeout_s=HANDSHAKE_TIMEOUT_S)},
        {"env": engine_env(RAILS["c"], secret_file=sz, handshake_timeout_s=HANDSHAKE_TIMEOUT_S)},
    ])
    try:
        write_secret(sx, TWO)
        await asyncio.to_thread(reload, x, "engine.secret_file: the cluster secret replaced")
        async with nodes(x, z) as (nx, nz):
            await _write_both_ways(nx, nz)
        assert ONE not in x.stderr and TWO not in x.stderr
    finally:
        for d in (x, z):
            d.stop()


async def _write_both_ways(*pairs: Node) -> None:
    """A checked write from each node to the next and back (new links, new handshakes)."""
    imm = fresh_imm()
    regions = {id(n): (await n.region(4096, seed=i + 1), await n.region(4096))
               for i, n in enumerate(pairs)}
    for one, two in itertools.pairwise(pairs):
        for src, dst in ((one, two), (two, one)):
            c = await src.client.submit_single_write(
                4096, imm, (regions[id(src)][0].mr, 0), (regions[id(dst)][1].desc, 0))
            await c.wait(WAIT)
            assert await dst.read(regions[id(dst)][1]) == await src.read(regions[id(src)][0])


@async_test(timeout=120)
async def test_sighup_rotates_the_cluster_secret_without_cutting_links(tmp_path: Path) -> None:
    """X goes from secret ONE to TWO with ONE as previous: it links both ways with Y
    (still ONE) and Z (already TWO).  With the previous emptied, a peer that proves only
    ONE is refused and one that proves TWO is not."""
    sx, px = tmp_path / "x.secret", tmp_path / "x.previous"
    sy, sz = tmp_path / "y.secret", tmp_path / "z.secret"
    write_secret(sx, ONE)
    write_secret(px, "")
    write_secret(sy, ONE)
    write_secret(sz, TWO)
    x, y, z = start_many([
        {"env": engine_env(RAILS["a"], secret_file=sx, previous_secret_file=px,
                           handshake_timeout_s=HANDSHAKE_TIMEOUT_S)},
        {"env": engine_env(RAILS["b"], secret_file=sy, handshake_timeout_s=HANDSHAKE_TIMEOUT_S)},
        {"env": engine_env(RAILS["c"], secret_file=sz, handshake_timeout_s=HANDSHAKE_TIMEOUT_S)},
    ])
    try:
        write_secret(px, ONE)
        write_secret(sx, TWO)
        await asyncio.to_thread(reload, x, "engine.secret_file: the cluster secret replaced")
        async with nodes(x, y, z) as (nx, ny, nz):
            # Y (ONE) and X, then X and Z (TWO): every link new, each way.
            await _write_both_ways(ny, nx, nz)
            addr = await nx.client.main_address()
        write_secret(px, "")
        await asyncio.to_thread(reload, x, "the previous cluster secret removed")
        with FakePeer(addr, 0, ONE.encode(), timeout=3) as p:
            err = handshake_error(p)
            assert isinstance(err, Unauthorized) and "did not prove" in str(err), err
        with FakePeer(addr, 0, TWO.encode(), timeout=3) as p:
            assert handshake_error(p) is None
        # A reload cannot take the cluster secret away: the rails would be open.
        write_secret(sx, "")
        await asyncio.to_thread(reload, x, "a secret file is refused")
        with FakePeer(addr, 0, TWO.encode(), timeout=3) as p:
            assert handshake_error(p) is None
        for d in (x, y, z):
            assert ONE not in d.stderr and TWO not in d.stderr
            assert d.alive()
    finally:
        for d in (x, y, z):
            d.stop()


def _check_config(cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "transferd.cli", "check-config", str(cfg)],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith("TRANSFERD_")})


@pytest.mark.parametrize("key", ["server.token_file", "engine.secret_file"])
def test_a_secret_file_others_can_read_is_refused(tmp_path: Path, key: str) -> None:
    """0644 was accepted silently (issue 16.11).  Now serve, check-config and doctor
    refuse it, saying how to fix it; through a symlink the target is judged and named;
    server.insecure_secret_files lets it through."""
    section, name = key.split(".")
    real = tmp_path / "real.secret"
    write_secret(real, OLD, 0o644)
    link = tmp_path / "link.secret"
    link.symlink_to(real)
    cfg = tmp_path / "c.toml"

    def config(path: Path, insecure: bool = False) -> None:
        server = "insecure_secret_files = true\n" if insecure else ""
        mine = f"{name} = \"{path}\"\n"
        cfg.write_text(f"[server]\nport = 0\n{server}{mine if section == 'server' else ''}"
                       f"[metrics]\nenabled = false\n"
                       f"[engine]\n{mine if section == 'engine' else ''}")

    for path in (real, link):
        config(path)
        r = _check_config(cfg)
        assert r.returncode == Exit.CONFIG, r.stdout + r.stderr
        assert f"{key}: {path}" in r.stderr and f"chmod 600 {real}" in r.stderr, r.stderr
        assert "mode 0644" in r.stderr and OLD not in r.stderr + r.stdout
        if path == link:
            assert f"a symlink to {real}" in r.stderr
        r = subprocess.run([sys.executable, "-m", "transferd.cli", "doctor", "-c", str(cfg)],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
        assert r.returncode == Exit.FAILURE and f"FAIL  start-up: {key}: {path}" in r.stdout, \
            r.stdout
        d = DaemonProcess(command=[sys.executable, "-m", "transferd.cli", "serve", "-c",
                                   str(cfg)]).start()
        assert d.proc is not None and d.proc.wait(30) == Exit.CONFIG, d.output()
        d.stop()
        assert "chmod 600" in d.stderr and OLD not in d.stderr
    # The risk accepted, or the file fixed as told: it passes.
    config(link, insecure=True)
    assert _check_config(cfg).returncode == 0, _check_config(cfg).stderr
    real.chmod(0o600)
    config(link)
    assert _check_config(cfg).returncode == 0, _check_config(cfg).stderr


def test_a_secret_in_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    """A 0600 file in a directory any user can write (no sticky bit) was accepted: any
    local user could rename it away and put there a symlink to a file of the daemon's
    user or root whose contents they know or choose (RHEL's /etc/shadow is mode 0000
    root: it passed the file's own check), which the next reload or start would take as
    the secret.  Now the directories on the way to the file and to its target are judged
    as ssh's StrictModes does: none writable by another user unless sticky (/tmp)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    secret = shared / "token"
    write_secret(secret, OLD)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[server]\nport = 0\ntoken_file = \"{secret}\"\n")
    for mode in (0o777, 0o770):
        shared.chmod(mode)
        r = _check_config(cfg)
        assert r.returncode == Exit.CONFIG, r.stdout + r.stderr
        assert f"{shared} can be written by other users (mode {mode:04o})" in r.stderr, r.stderr
        assert f"chmod go-w {shared}" in r.stderr and OLD not in r.stderr
    # Through a symlink kept in a safe place, the target's directory is judged too.
    link = tmp_path / "link"
    link.symlink_to(secret)
    cfg.write_text(f"[server]\nport = 0\ntoken_file = \"{link}\"\n")
    r = _check_config(cfg)
    assert r.returncode == Exit.CONFIG and f"{shared} can be written" in r.stderr, r.stderr
    shared.chmod(0o1777)  # sticky, as /tmp: nobody else can replace the file
    assert _check_config(cfg).returncode == 0
    shared.chmod(0o755)
    assert _check_config(cfg).returncode == 0


def test_a_secret_path_that_is_not_a_file_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO never ends (nothing writes it): check-config and the start used to block
    reading it.  Now it is refused without a read; so is a file that is too long."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[server]\nport = 0\ntoken_file = \"{fifo}\"\n")
    r = _check_config(cfg)
    assert r.returncode == Exit.CONFIG and "is not a regular file" in r.stderr, r.stderr
    big = tmp_path / "big"
    write_secret(big, "x" * 5000)
    cfg.write_text(f"[server]\nport = 0\ntoken_file = \"{big}\"\n")
    r = _check_config(cfg)
    assert r.returncode == Exit.CONFIG and "longer than 4096 bytes" in r.stderr, r.stderr
