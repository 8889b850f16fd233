"""``transferd``: run the daemon from a config file, validate a config file."""

from __future__ import annotations

import sys

import click

from transferd import __version__
from transferd import config as cfgmod
from transferd.commands import register as register_commands
from transferd.config_docs import toml_value
from transferd.exits import Exit


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="transferd")
def main() -> None:
    """transferd: moves bytes between machines for LLM systems."""


def metrics_port_overrides(port: int | None) -> dict[str, object]:
    """``--metrics-port``: -1 turns metrics off, 0 picks a port, else that port."""
    if port is None:
        return {}
    if port < 0:
        return {"metrics.enabled": False}
    return {"metrics.port": port}


@main.command(short_help="Run the daemon until SIGTERM or Ctrl-C.")
@click.option(
    "-c",
    "--config",
    "config_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="TOML config file; without one the embedded defaults are used.",
)
@click.option("-H", "--host", default=None, help="Address to listen on (server.host).")
@click.option("-p", "--port", type=int, default=None,
              help="TCP port (server.port); 0 picks one.")
@click.option("-m", "--mem", type=int, default=None,
              help="Host memory limit in MiB (memory.host_limit_mib).")
@click.option("--protocol-minor", type=click.IntRange(1, 2), default=None,
              help="Act as a server of this protocol minor (server.protocol_minor).")
@click.option("--metrics-port", type=int, default=None,
              help="Metrics port (metrics.port); 0 picks one; -1 turns metrics off.")
@click.option("--token", default=None, metavar="SECRET",
              help="Refused (visible in ps): use --token-file or TRANSFERD_SERVER_TOKEN.")
@click.option("--token-file", default=None, type=click.Path(dir_okay=False),
              help="Clients must prove the secret in this file (server.token_file).")
@click.option("--unix", "unix_socket", default=None,
              help="Also listen on this Unix socket path (server.unix_socket).")
@click.option("--listen", multiple=True, metavar="URL",
              help="Also listen on URL, repeatable, replacing server.listen: tcp://HOST:PORT, "
                   "tls://HOST:PORT, unix:///PATH, seqpacket:///PATH.")
@click.option(
    "--log-level",
    default=None,
    type=click.Choice(cfgmod.LOG_LEVELS, case_sensitive=False),
    help="Log level (log.level).",
)
@click.option(
    "--log-format",
    default=None,
    type=click.Choice(cfgmod.LOG_FORMATS, case_sensitive=False),
    help="Log format (log.format): text, or json lines for log shippers.",
)
def serve(
    config_path: str | None,
    host: str | None,
    port: int | None,
    mem: int | None,
    protocol_minor: int | None,
    metrics_port: int | None,
    token: str | None,
    token_file: str | None,
    unix_socket: str | None,
    listen: tuple[str, ...],
    log_level: str | None,
    log_format: str | None,
) -> None:
    """Run the daemon (RPC server, engine, metrics) until SIGTERM or Ctrl-C.

    Takes the flags rpc-server takes where they overlap; flags beat TRANSFERD_*
    variables, which beat the file, which beats the defaults.
    """
    from transferd.daemon import discover_frontends, run_daemon

    if token is not None:
        click.echo(f"transferd: {cfgmod.TOKEN_REFUSED}", err=True)
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
    }
    try:
        config = cfgmod.load(config_path, overrides=overrides)
    except cfgmod.ConfigError as exc:
        for line in exc.errors:
            click.echo(f"transferd: configuration error: {line}", err=True)
        sys.exit(Exit.CONFIG)
    frontends = discover_frontends()
    if not frontends:
        click.echo("transferd: no front end installed (is rpc_server installed?)", err=True)
        sys.exit(Exit.INSTALL)
    # SIGHUP re-reads the same file, variables and flags.
    run_daemon(config, frontends, loader=lambda: cfgmod.load(config_path, overrides=overrides))


@main.command("check-config", short_help="Validate a configuration; --print shows it.")
@click.argument("path", required=False, type=click.Path(dir_okay=False))
@click.option("--print", "show", is_flag=True,
              help="Print the effective configuration, with where each value came from.")
@click.option("--other-node", is_flag=True,
              help="The config is for another machine: skip the checks of this machine's "
                   "addresses and memory.")
def check_config(path: str | None, show: bool, other_node: bool) -> None:
    """Validate PATH (or, without one, the defaults) with the TRANSFERD_* variables.

    Besides each key's type and range it checks what serve would fail on: hosts
    that do not resolve, addresses this machine does not have, listeners that
    share a port, limits over the machine's memory, a Unix socket path in use.
    Every problem is reported, one per line on stderr, and the exit status is 3
    (4 for an address this machine lacks); 0 when the configuration is good.
    Ports taken right now are warnings only (the daemon itself may hold them).
    """
    from transferd import preflight

    try:
        cfg, sources = cfgmod.load_with_sources(path)
    except cfgmod.ConfigError as exc:
        for line in exc.errors:
            click.echo(line, err=True)
        sys.exit(Exit.CONFIG)
    problems = preflight.check(cfg, this_machine=not other_node, bind=False)
    errors = [p for p in problems if p.kind is not preflight.Kind.BIND]
    for p in problems:
        if p.kind is preflight.Kind.BIND:
            click.echo(f"warning: {p}", err=True)
    if errors:
        for p in errors:
            click.echo(str(p), err=True)
        sys.exit(max(p.kind.exit for p in errors))
    if not problems and not other_node:
        for p in preflight.check(cfg, bind=True):
            click.echo(f"warning: {p}", err=True)
    if show:
        for name, f, value in cfg.items():
            shown = "********" if f.metadata.get("secret") and value else value
            click.echo(f"{name} = {toml_value(shown)}  # {sources[name]}")
    s = cfg.server
    click.echo(
        f"{path or '(defaults)'}: OK (tcp://{s.host}:{s.port}, protocol minor "
        f"{s.protocol_minor}, host memory {cfg.memory.host_limit_mib} MiB)"
    )


register_commands(main)


if __name__ == "__main__":
    main()
