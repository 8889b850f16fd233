"""``transferd``: run the daemon from a config file, validate a config file."""

from __future__ import annotations

import sys
from typing import Any

import click

from transferd import __version__
from transferd import config as cfgmod
from transferd.commands import register as register_commands
from transferd.config_docs import toml_value
from transferd.exits import Exit
from transferd.serve_options import serve as run_serve
from transferd.serve_options import serve_options


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="transferd")
def main() -> None:
    """transferd: moves bytes between machines for LLM systems."""


@main.command(short_help="Run the daemon until SIGTERM or Ctrl-C.")
@serve_options
def serve(**flags: Any) -> None:
    """Run the daemon (RPC server, engine, metrics) until SIGTERM or Ctrl-C.

    Takes the flags rpc-server takes where they overlap; flags beat TRANSFERD_*
    variables, which beat the file, which beats the defaults.
    """
    from transferd.daemon import discover_frontends

    run_serve("transferd", discover_frontends, **flags)


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
