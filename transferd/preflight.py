"""What a configuration needs of this machine, checked before anything starts.

:func:`check` looks at a valid :class:`~transferd.config.Config` the way
``serve`` would use it: every host resolves, every listener's address is one
this machine has (``engine.host_rails[1]: 10.0.1.11 is not an address of this
machine``), no two listeners of the daemon share a port (server.port, every
network URL of server.listen, metrics, the engine's rails) or a socket path, the memory limit fits
in the machine, a Unix socket path is not a running daemon's, and (``bind=True``)
every fixed port is free.  Each problem names the key it comes from.  ``serve``
runs it first and starts nothing when it finds one; ``check-config`` runs it
too (``--other-node`` skips what depends on this machine).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import stat
from dataclasses import dataclass
from enum import Enum

from transferd import transports
from transferd.config import Config
from transferd.exits import Exit
from transferd.transports.base import Endpoint


class Kind(Enum):
    CONFIG = "config"  # wrong wherever it runs: a clash, a name that does not resolve
    MACHINE = "machine"  # wrong for this machine: too little memory, no socket directory
    ADDRESS = "address"  # an address this machine does not have: cannot bind
    BIND = "bind"  # a port or socket path taken right now

    @property
    def exit(self) -> Exit:
        return Exit.CONFIG if self in (Kind.CONFIG, Kind.MACHINE) else Exit.BIND


@dataclass(frozen=True)
class Problem:
    key: str
    message: str
    kind: Kind

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


@dataclass(frozen=True)
class Listener:
    """A TCP listener the daemon opens: the config key of its port and its host."""

    what: str
    key: str  # the key that sets the port (or the address, for extra rails)
    host_key: str
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def listeners(cfg: Config) -> list[Listener]:
    out = []
    if cfg.server.tcp_listener:
        out.append(Listener("RPC server", "server.port", "server.host", cfg.server.host,
                            cfg.server.port))
    # server.listen's network URLs (tcp, tls, rdma's set-up port): config validation
    # parsed them already.
    for i, (url, ep) in enumerate(_listen_endpoints(cfg)):
        if not ep.path:
            out.append(Listener(f"{url} listener", f"server.listen[{i}]", f"server.listen[{i}]",
                                ep.host, ep.port))
    if cfg.metrics.enabled:
        out.append(Listener("metrics endpoint", "metrics.port", "metrics.host",
                            cfg.metrics.host, cfg.metrics.port))
    if cfg.engine.enabled and cfg.server.protocol_minor >= 2:
        rails = cfg.engine.host_rails
        if not rails:
            out.append(Listener("engine rail 0", "engine.peer_port", "server.host",
                                cfg.server.host, cfg.engine.peer_port))
        for i, host in enumerate(rails):
            # Rail 0 takes engine.peer_port; the others a port of the system's choice.
            port = cfg.engine.peer_port if i == 0 else 0
            out.append(Listener(f"engine rail {i}", "engine.peer_port" if i == 0 else
                                f"engine.host_rails[{i}]", f"engine.host_rails[{i}]", host, port))
    return out


def _listen_endpoints(cfg: Config) -> list[tuple[str, Endpoint]]:
    return [(url, transports.parse(url)) for url in cfg.server.listen]


def _resolve(host: str) -> list[str] | None:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    return sorted({str(info[4][0]) for info in infos})


def _is_wildcard(addr: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(addr).is_unspecified
    return False


def _bind(addr: str, port: int) -> OSError | None:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # As the real listeners do: a port in TIME_WAIT is not "taken".
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
            s.listen(1)
    except OSError as exc:
        return exc
    return None


def is_local_address(addr: str) -> bool:
    """Whether this machine can bind ``addr`` (what every listener needs of it)."""
    err = _bind(addr, 0)
    return err is None or err.errno != errno.EADDRNOTAVAIL


def machine_memory() -> int | None:
    """Bytes of physical memory, or None where it cannot be told."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def limit_problems(cfg: Config) -> list[Problem]:
    """What this machine refuses of the limits a configuration sets.  Asked at a start,
    and by whatever takes a configuration without a start's checks: a SIGHUP (these
    keys are reloadable) and an inproc node (client/inproc.py)."""
    total = machine_memory()
    if total is not None and cfg.host_limit > total:
        return [Problem("memory.host_limit_mib", f"{cfg.memory.host_limit_mib} MiB is more "
                        f"than this machine's memory ({total >> 20} MiB)", Kind.MACHINE)]
    return []


def check(cfg: Config, *, this_machine: bool = True, bind: bool = True) -> list[Problem]:
    """Every problem ``serve`` would hit with ``cfg``; see the module's doc."""
    problems: list[Problem] = []
    lst = listeners(cfg)
    resolved: dict[str, list[str]] = {}
    seen: set[str] = set()
    for li in lst:
        if li.host in seen:
            continue
        seen.add(li.host)
        addrs = _resolve(li.host)
        if addrs is None:
            problems.append(Problem(li.host_key, f"{li.host!r} is not an address and does not "
                                    "resolve", Kind.CONFIG))
            continue
        resolved[li.host] = addrs
        if this_machine:
            for a in addrs:
                if not is_local_address(a):
                    problems.append(Problem(
                        li.host_key, f"{li.host} is not an address of this machine "
                        "(check a config meant for another node with --other-node)",
                        Kind.ADDRESS))
                    break
    # Two listeners of this daemon on one fixed port, where their addresses meet.
    for i, one in enumerate(lst):
        for two in lst[i + 1:]:
            if not one.port or one.port != two.port:
                continue
            aa, bb = set(resolved.get(one.host, [])), set(resolved.get(two.host, []))
            if aa & bb or any(map(_is_wildcard, aa | bb)):
                problems.append(Problem(
                    two.key, f"port {two.port} of the {two.what} ({two.address}) is also "
                    f"{one.key}, the {one.what}'s ({one.address})", Kind.CONFIG))
    rails = cfg.engine.host_rails
    for i, host in enumerate(rails):
        if host in rails[:i]:
            problems.append(Problem(f"engine.host_rails[{i}]", f"{host} is rail "
                                    f"{rails.index(host)} already: one address per rail",
                                    Kind.CONFIG))
    if this_machine:
        problems += limit_problems(cfg)
        # Secret files another user could read or rewrite (transferd.secret_files).
        from transferd.secret_files import problems as secret_problems

        problems += [Problem(key, message, Kind.MACHINE)
                     for key, message in secret_problems(cfg)]
    # Local sockets: one path per listener, each free to take.
    paths = [("server.unix_socket", cfg.server.unix_socket, socket.SOCK_STREAM)]
    for i, (_, ep) in enumerate(_listen_endpoints(cfg)):
        if ep.path:
            kind = socket.SOCK_SEQPACKET if ep.scheme == "seqpacket" else socket.SOCK_STREAM
            paths.append((f"server.listen[{i}]", ep.path, kind))
    taken: dict[str, str] = {}
    for key, path, kind in paths:
        if not path:
            continue
        where = os.path.abspath(path)
        if where in taken:
            problems.append(Problem(key, f"{path} is also {taken[where]}'s socket: one path "
                                    "per listener", Kind.CONFIG))
            continue
        taken[where] = key
        if this_machine:
            problems += _check_unix(path, key, kind)
    for i, url in enumerate(cfg.server.listen):
        if this_machine and url.startswith("rdma://"):
            from transferd.rdma.devices import rdma_problem

            if (why := rdma_problem(url)) is not None:
                problems.append(Problem(f"server.listen[{i}]", why, Kind.MACHINE))
    if this_machine and cfg.engine.enabled:
        from transferd.domains import registry

        # The Domain says what this machine lacks for it (verbs: a device, a port).
        problems += [Problem(k, m, Kind.MACHINE) for k, m in
                     registry.machine_problems(cfg.engine.domain, cfg.engine)]
    if bind and not problems:
        for li in lst:
            if not li.port:
                continue
            for a in resolved.get(li.host, []):
                err = _bind(a, li.port)
                if err is not None:
                    problems.append(Problem(li.key, f"cannot listen on {li.address} for the "
                                            f"{li.what}: {err.strerror or err}", Kind.BIND))
                    break
    return problems


def _check_unix(path: str, key: str = "server.unix_socket",
                kind: int = socket.SOCK_STREAM) -> list[Problem]:
    if not path:
        return []
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return [Problem(key, f"{path}: directory {parent} does not exist", Kind.MACHINE)]
    if not os.access(parent, os.W_OK | os.X_OK):
        return [Problem(key, f"{path}: directory {parent} is not writable by this user",
                        Kind.MACHINE)]
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return []
    if not stat.S_ISSOCK(st.st_mode):
        # Not a socket a daemon left (a file, a link, a directory: a path set wrong):
        # never removed to make room.
        return [Problem(key, f"{path} exists and is not a socket: it is not removed to "
                             "listen there; remove it, or choose another path",
                        Kind.MACHINE)]
    # A socket file: stale (removed at start) unless something still accepts on it.
    with socket.socket(socket.AF_UNIX, kind) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            return []
    return [Problem(key, f"{path} is in use by a running daemon: give each daemon its own path",
                    Kind.BIND)]
