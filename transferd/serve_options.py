"""The flags ``rpc-server`` and ``transferd serve`` share, and how both start a daemon.

Both commands take the same overrides of the configuration; keeping the flags in
one place keeps their names, help and config keys from drifting apart.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from transferd import config as cfgmod
from transferd.exits import Exit
from transferd.logs import fatal

F = TypeVar("F", bound=Callable[..., Any])

_SHARED: tuple[Callable[[Any], Any], ...] = (
    click.option("-c", "--config", "config_path", default=None,
                 type=click.Path(dir_okay=False),
                 help="TOML config file; without one the embedded defaults are used."),
    click.option("-H", "--host", default=None,
                 help="Address to listen on (server.host) [127.0.0.1]."),
    click.option("-p", "--port", type=int, default=None,
                 help="TCP port (server.port) [18515]; 0 picks one."),
    click.option("-m", "--mem", type=int, default=None,
                 help="Host memory limit in MiB (memory.host_limit_mib) [4096]."),
    click.option("--protocol-minor", type=click.IntRange(1, 2), default=None,
                 help="Act as a server of this protocol minor (server.protocol_minor) [2]."),
    click.option("--metrics-port", type=int, default=None,
                 help="Prometheus metrics port (metrics.port) [0: a free one, printed]; "
                      "-1 turns metrics off."),
    click.option("--token", default=None, metavar="SECRET",
                 help="Refused (visible in ps): use --token-file or TRANSFERD_SERVER_TOKEN."),
    click.option("--token-file", default=None, type=click.Path(dir_okay=False),
                 help="Clients must prove the secret in this file (server.token_file)."),
    click.option("--unix", "unix_socket", default=None,
                 help="Also listen on this Unix socket path (server.unix_socket)."),
    click.option("--listen", multiple=True, metavar="URL",
                 help="Also listen on URL, repeatable, replacing server.listen: "
                      "tcp://HOST:PORT, tls://HOST:PORT, unix:///PATH, seqpacket:///PATH."),
    click.option("--log-level", default=None,
                 type=click.Choice(cfgmod.LOG_LEVELS, case_sensitive=False),
                 help="Log level (log.level)."),
    click.option("--log-format", default=None,
                 type=click.Choice(cfgmod.LOG_FORMATS, case_sensitive=False),
                 help="Log format (log.format): text, or json lines for log shippers."),
    click.option("-d", "--device", default=None,
                 help="Devices to serve buffers from: cpu (always served), or CUDA devices "
                      "as cuda:0 or cuda:0,cuda:1 (needs CuPy; sets gpu.devices) [cpu]."),
)


def serve_options(fn: F) -> F:
    """Add the shared flags to a click command (the first listed shows first)."""
    for option in reversed(_SHARED):
        fn = option(fn)
    return fn


def metrics_port_overrides(port: int | None) -> dict[str, object]:
    """``--metrics-port``: -1 turns metrics off, 0 picks a port, else that port."""
    if port is None:
        return {}
    if port < 0:
        return {"metrics.enabled": False}
    return {"metrics.port": port}


def device_overrides(device: str | None) -> list[str] | None:
    """``-d``: the CUDA devices named (cpu is always served), or None (no override)."""
    gpus = [d.strip() for d in (device or "").split(",") if d.strip() and d.strip() != "cpu"]
    return gpus or None


def serve(prog: str, frontends: Callable[[], Sequence[Any]], *, config_path: str | None,
          host: str | None, port: int | None, mem: int | None, protocol_minor: int | None,
          metrics_port: int | None, token: str | None, token_file: str | None,
          unix_socket: str | None, listen: tuple[str, ...], log_level: str | None,
          log_format: str | None, device: str | None) -> None:
    """Load the configuration the flags override and run the daemon until it stops.

    Flags beat TRANSFERD_* variables, which beat the file, which beats the defaults.
    A configuration error is printed a line each and exits with Exit.CONFIG.
    """
    from transferd.daemon import run_daemon

    if token is not None:
        fatal(f"{prog}: {cfgmod.TOKEN_REFUSED}")
        sys.exit(Exit.CONFIG)
    overrides = {
        "server.host": host,
        "server.port": port,
        "memory.host_limit_mib": mem,
        "server.protocol_minor": protocol_minor,
        "server.token_file": token_file,
        "server.unix_socket": unix_socket,
        "server.listen": list(listen) or None,
        "log.level": log_level,
        "log.format": log_format,
        **metrics_port_overrides(metrics_port),
        "gpu.devices": device_overrides(device),
    }
    try:
        config = cfgmod.load(config_path, overrides=overrides)
    except cfgmod.ConfigError as exc:
        for line in exc.errors:
            fatal(f"{prog}: configuration error: {line}")
        sys.exit(Exit.CONFIG)
    found = list(frontends())
    if not found:
        fatal(f"{prog}: no front end installed (is rpc_server installed?)")
        sys.exit(Exit.INSTALL)
    # SIGHUP re-reads the same file, variables and flags.
    run_daemon(config, found, loader=lambda: cfgmod.load(config_path, overrides=overrides))
