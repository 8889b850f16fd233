"""``rpc-server``: one command that starts a complete daemon, llama.cpp's flag names."""

from __future__ import annotations

import sys

import click

from transferd import __version__
from transferd import config as cfgmod
from transferd.daemon import run_daemon
from transferd.exits import Exit

from .server import RpcFrontend


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rpc-server")
@click.option("-H", "--host", default=None, help="Address to listen on [127.0.0.1].")
@click.option("-p", "--port", type=int, default=None, help="TCP port [18515]; 0 picks one.")
@click.option("-m", "--mem", type=int, default=None, help="Host memory limit in MiB [4096].")
@click.option(
    "-d", "--device", default=None,
    help="Devices to serve buffers from: cpu (always served), or CUDA devices as "
    "cuda:0 or cuda:0,cuda:1 (needs CuPy; sets gpu.devices) [cpu].",
)
@click.option(
    "--protocol-minor",
    type=click.IntRange(1, 2),
    default=None,
    help="Act as a server of this protocol minor [2].",
)
@click.option(
    "--metrics-port",
    type=int,
    default=None,
    help="Prometheus metrics port [0: a free one, printed]; -1 turns metrics off.",
)
@click.option("--token", default=None, metavar="SECRET",
              help="Refused (visible in ps): use --token-file or TRANSFERD_SERVER_TOKEN.")
@click.option("--token-file", default=None, type=click.Path(dir_okay=False),
              help="Clients must prove the secret in this file (server.token_file).")
@click.option("--unix", "unix_socket", default=None, help="Also listen on this Unix socket path.")
@click.option(
    "--listen",
    "listen",
    multiple=True,
    metavar="URL",
    help="Also listen on URL (repeatable): tcp://HOST:PORT, tls://HOST:PORT, unix:///PATH, "
    "seqpacket:///PATH.",
)
@click.option(
    "-c",
    "--config",
    "config_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Read settings from this TOML file first.",
)
@click.option(
    "--log-level",
    default=None,
    type=click.Choice(cfgmod.LOG_LEVELS, case_sensitive=False),
    help="Override log.level.",
)
@click.option(
    "--log-format",
    default=None,
    type=click.Choice(cfgmod.LOG_FORMATS, case_sensitive=False),
    help="Override log.format: text, or json lines for log shippers.",
)
def main(
    host: str | None,
    port: int | None,
    mem: int | None,
    device: str | None,
    protocol_minor: int | None,
    metrics_port: int | None,
    token: str | None,
    token_file: str | None,
    unix_socket: str | None,
    listen: tuple[str, ...],
    config_path: str | None,
    log_level: str | None,
    log_format: str | None,
) -> None:
    """Serve transferd's RPC protocol (and its transfer engine) on HOST:PORT."""
    if token is not None:
        click.echo(f"rpc-server: {cfgmod.TOKEN_REFUSED}", err=True)
        sys.exit(Exit.CONFIG)
    gpus = [d.strip() for d in (device or "").split(",") if d.strip() and d.strip() != "cpu"]
    overrides = {
        "gpu.devices": gpus or None,
        "server.host": host,
        "server.port": port,
        "memory.host_limit_mib": mem,
        "server.protocol_minor": protocol_minor,
        "server.token_file": token_file,
        "server.unix_socket": unix_socket,
        "server.listen": list(listen) or None,
        "log.level": log_level,
        "log.format": log_format,
    }
    if metrics_port is not None:
        if metrics_port < 0:
            overrides["metrics.enabled"] = False
        else:
            overrides["metrics.port"] = metrics_port
    try:
        config = cfgmod.load(config_path, overrides=overrides)
    except cfgmod.ConfigError as exc:
        for line in exc.errors:
            click.echo(f"rpc-server: configuration error: {line}", err=True)
        sys.exit(Exit.CONFIG)
    run_daemon(config, [RpcFrontend()],
               loader=lambda: cfgmod.load(config_path, overrides=overrides))


if __name__ == "__main__":
    main()
