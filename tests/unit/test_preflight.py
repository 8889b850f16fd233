"""The start-up preflight knows every listener of server.listen: ports and socket paths."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from transferd import config, preflight
from transferd.preflight import Kind


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check(bind: bool = False, **overrides: Any) -> list[preflight.Problem]:
    cfg = config.load(env={}, overrides={"server.host": "127.0.0.1", "server.port": 0,
                                         "metrics.port": 0, **overrides})
    return preflight.check(cfg, bind=bind)


def test_listen_urls_that_share_a_port_clash() -> None:
    p = free_port()
    (pr,) = check(**{"server.listen": [f"tcp://127.0.0.1:{p}", f"tls://127.0.0.1:{p}"],
                     "server.tls_cert": "c.pem", "server.tls_key": "k.pem"})
    assert pr.kind is Kind.CONFIG and pr.key == "server.listen[1]"
    assert f"port {p}" in pr.message and "server.listen[0]" in pr.message


def test_a_listen_url_on_the_metrics_port_or_the_rpc_port_clashes() -> None:
    p = free_port()
    (pr,) = check(**{"server.listen": [f"tcp://127.0.0.1:{p}"], "metrics.port": p})
    assert pr.kind is Kind.CONFIG
    assert {pr.key, pr.message.rsplit(" is also ", 1)[1].split(",")[0]} == {
        "server.listen[0]", "metrics.port"}
    (pr,) = check(**{"server.listen": [f"tcp://0.0.0.0:{p}"], "server.port": p})
    assert "server.port" in str(pr) and "server.listen[0]" in str(pr)


def test_a_listen_url_on_a_rail_port_clashes() -> None:
    p = free_port()
    (pr,) = check(**{"server.listen": [f"tcp://127.0.0.1:{p}"],
                     "engine.host_rails": ["127.0.0.1"], "engine.peer_port": p})
    assert "engine.peer_port" in str(pr) and "server.listen[0]" in str(pr)


def test_different_ports_and_addresses_do_not_clash() -> None:
    p = free_port()
    assert check(**{"server.listen": [f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.2:{p}"]}) == []


def test_a_taken_listen_port_is_a_bind_problem() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        p = held.getsockname()[1]
        (pr,) = check(bind=True, **{"server.listen": [f"tcp://127.0.0.1:{p}"]})
    assert pr.kind is Kind.BIND and pr.key == "server.listen[0]"


def test_socket_paths_one_per_listener(tmp_path: Path) -> None:
    path = str(tmp_path / "d.sock")
    (pr,) = check(**{"server.unix_socket": path, "server.listen": [f"seqpacket://{path}"]})
    assert pr.kind is Kind.CONFIG and pr.key == "server.listen[0]"
    assert "server.unix_socket" in pr.message


def test_a_seqpacket_path_in_use_is_not_taken_over(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as live:
        live.bind(path)
        live.listen()
        (pr,) = check(**{"server.listen": [f"seqpacket://{path}"]})
    assert pr.kind is Kind.BIND and pr.key == "server.listen[0]" and "in use" in pr.message
    # A stale one (nothing accepts on it) is no problem: the listener replaces it.
    assert check(**{"server.listen": [f"seqpacket://{path}"]}) == []


def test_without_the_tcp_listener_its_port_clashes_with_nothing() -> None:
    p = free_port()
    assert check(**{"server.tcp_listener": False, "server.port": p,
                    "server.listen": [f"tcp://127.0.0.1:{p}"]}) == []


def test_a_file_at_a_socket_path_is_refused_not_removed(tmp_path: Path) -> None:
    """A regular file (or a link, or a directory) where the socket goes is a path set
    wrong: refused before anything starts, and left as it is."""
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    link = tmp_path / "link.sock"
    link.symlink_to(f)
    for path in (f, link, tmp_path):
        for key, url in (("server.unix_socket", None), ("server.listen[0]", "seqpacket")):
            over = ({"server.unix_socket": str(path)} if url is None
                    else {"server.listen": [f"{url}://{path}"]})
            (pr,) = check(**over)
            assert pr.key == key and "is not a socket" in pr.message, pr
    assert f.read_text() == "keep me" and link.is_symlink()
