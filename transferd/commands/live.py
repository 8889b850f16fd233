"""Whether the daemon of a configuration runs here: what answers on its fixed ports.

``transferd doctor`` right after ``systemctl restart transferd`` finds every fixed port
taken: by that daemon.  :func:`probe` asks each port that the start-up check found
taken who holds it, quietly (nothing a daemon would log or count as a failure):

- the RPC port: a HELLO with the configuration's own token (and AUTH), which also says
  whether the daemon accepts that token (where the token cannot be read, it does not
  ask: a HELLO without it would count as a failed authentication there);
- the metrics port: ``GET /metrics``, which must hold ``transferd_`` series;
- rail 0's peer port: the running daemon's engine address (MAIN_ADDRESS over the RPC
  connection) must name it;
- a Unix socket: a HELLO on it.

A port held by something else stays a start-up failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from transferd import config as cfgmod
from transferd import preflight


@dataclass
class Live:
    """What answered: key -> (ok, what)."""

    held: dict[str, tuple[bool, str]] = field(default_factory=dict)

    def explains(self, p: preflight.Problem) -> bool:
        """``p`` (a port or a socket taken) is the running daemon's doing."""
        ok = self.held.get(p.key)
        return p.kind is preflight.Kind.BIND and ok is not None and ok[0]


def token_of(s: cfgmod.ServerConfig) -> tuple[str | None, str]:
    """(the token clients prove, or None where none is set), or (None, why) when it is
    set in a file this user cannot read."""
    if s.token_file:
        try:
            with open(s.token_file, "rb") as f:
                return f.read(4096).strip().decode(errors="replace"), ""
        except OSError as exc:
            return None, f"cannot read server.token_file ({exc.strerror})"
    return (s.token.strip() or None), ""


def _client_host(host: str) -> str:
    """Where a client on this machine reaches a listener on ``host``."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _url(host: str, port: int, scheme: str = "tcp") -> str:
    h = _client_host(host)
    return f"{scheme}://[{h}]:{port}" if ":" in h else f"{scheme}://{h}:{port}"


REFUSED = ("a transferd daemon answers, and refuses this configuration's token: it runs "
           "with another one (reload it: systemctl reload transferd)")


async def _hello(url: str, token: str | None, timeout: float) -> tuple[bool, str, Any]:
    """(answered as transferd with this token, what it said, its engine address or None)."""
    from client import Client
    from transferd.protocol.errors import TransferdError, Unauthorized

    try:
        c = await asyncio.wait_for(Client.connect(url, token=token, timeout=timeout,
                                                  connect_timeout=timeout), timeout)
    except Unauthorized:
        return False, REFUSED, None
    except (OSError, TimeoutError, TransferdError) as exc:
        return False, f"it does not answer as transferd: {exc or type(exc).__name__}", None
    try:
        what = (f"{c.server} protocol {'.'.join(map(str, c.version))} answers"
                + (", and accepts this configuration's token" if token else ""))
        addr = None
        if "engine" in c.features:
            with contextlib.suppress(TransferdError, OSError, TimeoutError):
                addr = await asyncio.wait_for(c.main_address(), timeout)
        return True, what, addr
    finally:
        # Only asked (each answer waited for or given up on): nothing needs the server
        # to finish, so no linger for one that stopped answering and keeps its socket.
        with contextlib.suppress(Exception):
            await c.close(linger=0.0)


def _metrics(host: str, port: int, timeout: float) -> tuple[bool, str]:
    """Whether transferd's metrics answer at ``host:port``: one GET, read for at most
    ``timeout`` seconds in all and 1 MiB (a program that answers a byte at a time, each
    within a socket timeout, must not hold doctor: urlopen's timeout is per read)."""
    url = f"http://{_client_host(host)}:{port}/metrics"
    deadline = time.monotonic() + timeout
    got = bytearray()
    try:
        with socket.create_connection((_client_host(host), port), timeout=timeout) as s:
            s.sendall(f"GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            while len(got) < 1 << 20:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no whole answer within {timeout:g} s")
                s.settimeout(left)
                data = s.recv(1 << 16)
                if not data:
                    break
                got += data
    except OSError as exc:
        return False, f"{url} does not answer as transferd's metrics: {str(exc) or 'timed out'}"
    head, _, body = bytes(got).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if len(status) < 2 or not status[0].startswith(b"HTTP/") or status[1] != b"200":
        return False, (f"{url} does not answer as transferd's metrics: "
                       f"{head[:80].decode(errors='replace')!r}")
    if b"transferd_" not in body:
        return False, f"{url} answers, but with no transferd_ series: another program"
    return True, f"{url} serves the daemon's metrics"


def probe(cfg: cfgmod.Config, problems: list[preflight.Problem],
          timeout: float = 3.0) -> Live:
    """Who holds each port or socket of ``problems`` that was found taken."""
    from transferd import transports

    live = Live()
    taken = sorted(p.key for p in problems if p.kind is preflight.Kind.BIND)
    if not taken:
        return live
    token, unreadable = token_of(cfg.server)
    listeners = {li.key: li for li in preflight.listeners(cfg)}

    def hello(url: str) -> tuple[bool, str, Any]:
        if unreadable:  # without the token a HELLO would count as a failure there
            return False, f"{unreadable}: cannot ask who holds it", None
        return asyncio.run(_hello(url, token, timeout))

    engine_addr: Any = None
    refused = False
    rails: list[tuple[str, preflight.Listener]] = []
    for key in taken:
        li = listeners.get(key)
        if li is None:  # a Unix socket (server.unix_socket, a server.listen path)
            path = cfg.server.unix_socket if key == "server.unix_socket" else ""
            if key.startswith("server.listen["):
                path = transports.parse(cfg.server.listen[int(key[14:-1])]).path
            if path:
                live.held[key] = hello(f"unix://{path}")[:2]
        elif li.what == "metrics endpoint":
            live.held[key] = _metrics(li.host, li.port, timeout)
        elif li.what.startswith("engine rail"):
            rails.append((key, li))
        elif li.what == "RPC server" or li.what.startswith("tcp://"):
            ok, what, addr = hello(_url(li.host, li.port))
            live.held[key] = (ok, what)
            engine_addr = engine_addr or addr
            refused = refused or what == REFUSED
    for key, li in rails:
        if engine_addr is None:
            live.held[key] = (False, "the daemon on the RPC port refused the token, so its "
                              "rails are unknown" if refused else
                              "taken, and no daemon here says it holds it")
            continue
        have = [r.decode(errors="replace") for r in engine_addr.rails]
        mine = any(r.rsplit(":", 1)[-1] == str(li.port) for r in have)
        live.held[key] = (mine, f"the running daemon's rails are {', '.join(have)}" if mine
                          else f"the running daemon's rails are {', '.join(have)}: something "
                          f"else holds port {li.port}")
    return live
