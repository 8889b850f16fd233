"""``transferd``: run the daemon from a config file, validate a config file."""

from __future__ import annotations

import sys

import click

from transferd import __version__
from transferd import config as cfgmod


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="transferd")
def main() -> None:
    """transferd: moves bytes between machines for LLM systems."""


@main.command()
@click.option(
    "-c",
    "--config",
    "config_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="TOML config file; without one the embedded default is used.",
)
@click.option("-H", "--host", default=None, help="Override server.host.")
@click.option("-p", "--port", type=int, default=None, help="Override server.port.")
@click.option("--metrics-port", type=int, default=None, help="Override metrics.port.")
@click.option("--log-level", default=None, type=click.Choice(cfgmod.LOG_LEVELS))
def serve(
    config_path: str | None,
    host: str | None,
    port: int | None,
    metrics_port: int | None,
    log_level: str | None,
) -> None:
    """Run the daemon (RPC server, engine, metrics) until SIGTERM or Ctrl-C."""
    from transferd.daemon import discover_frontends, run_daemon

    try:
        config = cfgmod.load(
            config_path,
            overrides={
                "server.host": host,
                "server.port": port,
                "metrics.port": metrics_port,
                "log.level": log_level,
            },
        )
    except cfgmod.ConfigError as exc:
        click.echo(f"transferd: configuration error: {exc}", err=True)
        sys.exit(2)
    frontends = discover_frontends()
    if not frontends:
        click.echo("transferd: no front end installed (is rpc_server installed?)", err=True)
        sys.exit(1)
    run_daemon(config, frontends)


@main.command("check-config")
@click.argument("path", type=click.Path(dir_okay=False))
def check_config(path: str) -> None:
    """Validate a config file (and TRANSFERD_* variables); exit 0 when good."""
    try:
        cfg = cfgmod.load(path)
    except cfgmod.ConfigError as exc:
        click.echo(f"{exc}", err=True)
        sys.exit(2)
    s = cfg.server
    click.echo(
        f"{path}: OK (tcp://{s.host}:{s.port}, protocol minor {s.protocol_minor}, "
        f"host memory {cfg.memory.host_limit_mib} MiB)"
    )


if __name__ == "__main__":
    main()
