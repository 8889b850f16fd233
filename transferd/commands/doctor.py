"""``transferd doctor``: can this machine run this configuration? And ``devices``.

Doctor checks, in order: the configuration loads; what ``serve`` would check
before starting (addresses, ports free now, memory, the Unix socket), where a
port or socket taken by this configuration's running daemon is no problem
(:mod:`transferd.commands.live` asks who holds it: the daemon that answers with
this configuration's token); the memlock limit RDMA needs; files holding secrets
or keys (readable by us, by nobody else); a token where the RPC port is reachable
from other hosts; and every device probe (:mod:`transferd.commands.probes`).  One
line per check:
``ok``, ``warn`` or ``FAIL``.  Exit 1 when something the configuration needs
is missing, 3 when the configuration itself is invalid, 0 otherwise.
"""

from __future__ import annotations

import ipaddress
import json
import sys
from typing import Any

import click

from transferd import config as cfgmod
from transferd.exits import Exit

from . import probes


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def diagnose(cfg: cfgmod.Config, other_node: bool = False) -> list[tuple[str, str, str]]:
    """``(level, check, detail)`` for every check; level is ok, warn or FAIL."""
    from transferd import preflight

    from .live import probe

    out: list[tuple[str, str, str]] = []
    problems = preflight.check(cfg, this_machine=not other_node, bind=not other_node)
    live = probe(cfg, problems)
    for p in problems:
        held = live.held.get(p.key)
        if live.explains(p):
            continue
        out.append(("FAIL", "start-up", f"{p}" + (f" ({held[1]})" if held and held[1] else "")))
    if not [p for p in problems if not live.explains(p)]:
        out.append(("ok", "start-up", "addresses, memory and socket paths are usable"
                    + ("; the ports taken are the running daemon's" if live.held
                       else ", the ports free")))
    for key, (ok, what) in live.held.items():
        if ok:
            out.append(("ok", "running", f"{key}: {what}"))
    # RDMA pins registered memory: the lock limit must cover what can be registered.
    limit = probes.memlock_limit()
    verbs = probes.needs_rdma(cfg)
    shown = "unlimited" if limit is None else f"{limit >> 20} MiB"
    if limit is not None and limit < cfg.host_limit:
        level = "FAIL" if verbs else "warn"
        out.append((level, "memlock", f"RLIMIT_MEMLOCK is {shown}, under memory.host_limit_mib "
                    f"({cfg.memory.host_limit_mib} MiB): RDMA registration of large regions "
                    "fails (LimitMEMLOCK=infinity in the unit)"))
    else:
        out.append(("ok", "memlock", shown))
    for key, path in probes.env_secret_files(cfg):
        why = probes.mode_problem(path)
        out.append(("FAIL" if (why and "cannot read" in why) or (why and "not readable" in why)
                    else "warn" if why else "ok", f"permissions {key}", why or path))
    s = cfg.server
    token = "server.token_file" if s.token_file else "server.token" if s.token else ""
    if not _is_loopback(s.host) and not token:
        out.append(("warn", "secrets", f"server.host {s.host} is reachable from other hosts "
                    "and there is no token (server.token_file): anyone there can use the "
                    "daemon"))
    else:
        out.append(("ok", "secrets", f"clients prove the token of {token}" if token
                    else "loopback only, no token"))
    out.append(_checksums(cfg))
    from transferd.discovery.check import discovery_checks

    out += discovery_checks(cfg)
    # For another node this machine's devices say nothing about the config's needs.
    for sec in probes.run_all(None if other_node else cfg):
        for n in sec.needed:
            out.append(("FAIL", sec.name, n))
        if not sec.needed:
            count = len([i for i in sec.items if "config" not in i])
            out.append(("ok", sec.name, f"{count} found" + (f" ({sec.note})" if sec.note
                                                              else "")))
    return out


def _checksums(cfg: cfgmod.Config) -> tuple[str, str, str]:
    """Which CRC32C a verified write gets here (docs/integrity.md)."""
    from transferd.protocol import crc
    from transferd.protocol.errors import TransferdError

    try:
        crc.require()
    except TransferdError as exc:
        # A daemon with engine.verify refuses every write it receives without one.
        return ("FAIL" if cfg.engine.verify else "warn", "checksums", str(exc))
    if crc.timings:
        # Both installed: the faster here was timed (crc.require), and its figures say by how much.
        times = ", ".join(f"{name} {ms:.0f}" for name, ms in sorted(crc.timings.items()))
        return ("ok", "checksums", f"CRC32C from {crc.backend}, the faster here "
                f"(ms per GiB in cache: {times})")
    other = "crc32c" if crc.backend == "awscrt" else "awscrt"
    return ("ok", "checksums", f"CRC32C from {crc.backend} (pip install {other}: on some "
            "CPUs twice as fast; the faster installed is chosen)")


CONFIG = click.option("-c", "--config", "config_path", default=None,
                      type=click.Path(dir_okay=False),
                      help="The configuration to check (default: the embedded defaults), "
                           "with the TRANSFERD_* variables.")


def _load(config_path: str | None) -> cfgmod.Config:
    try:
        return cfgmod.load(config_path)
    except cfgmod.ConfigError as exc:
        for line in exc.errors:
            click.echo(f"FAIL  config: {line}")
        sys.exit(Exit.CONFIG)


@click.command(short_help="Check that this machine can run the configuration.")
@CONFIG
@click.option("--other-node", is_flag=True,
              help="Skip what depends on this machine's addresses, memory and ports.")
@click.option("--json", "as_json", is_flag=True, help="The checks as a JSON list.")
def doctor(config_path: str | None, other_node: bool, as_json: bool) -> None:
    """Check the configuration, start-up needs, memlock, permissions, secrets, checksums
    and devices.

    Exit 1 when something the configuration needs is missing (a FAIL line), 3 when
    the configuration is invalid, 0 otherwise (warnings do not fail).
    """
    cfg = _load(config_path)
    checks = diagnose(cfg, other_node)
    if as_json:
        click.echo(json.dumps([{"level": lv, "check": c, "detail": d} for lv, c, d in checks]))
    else:
        from .remote import say

        for level, check, detail in checks:
            say(f"{level:<5} {check}: {detail}")  # a detail may quote what answered
    failed = sum(1 for lv, _, _ in checks if lv == "FAIL")
    if not as_json:
        click.echo(f"{failed} problem(s)" if failed else "all good")
    sys.exit(Exit.FAILURE if failed else Exit.OK)


@click.command(short_help="List GPUs, RDMA devices, NUMA nodes and NICs.")
@CONFIG
@click.option("--rdma", is_flag=True,
              help="RDMA devices only, in detail; exit 0 only when some port is ACTIVE.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
def devices(config_path: str | None, rdma: bool, as_json: bool) -> None:
    """What this machine has (NUMA nodes, NICs and their addresses, GPUs, RDMA devices,
    ports, GIDs), what the configuration would use, and what it needs that is missing.

    Exits 0 when some RDMA port is ACTIVE, 1 otherwise (docs/rdma.md), as scripts
    that look for RDMA expect; `transferd doctor` answers "can this config run here".
    """
    from transferd.rdma.devices import discover

    report = discover()
    if rdma:
        click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.text())
        sys.exit(Exit.OK if report.usable else Exit.FAILURE)
    cfg = _load(config_path)
    sections = [s for s in probes.run_all(cfg) if s.name != "rdma"]
    if as_json:
        body: dict[str, Any] = report.to_dict()  # the RDMA report at the top, as --rdma
        body.update({s.name: s.to_dict() for s in sections})
        body["missing"] = [n for s in probes.run_all(cfg) for n in s.needed]
        click.echo(json.dumps(body, indent=2))
    else:
        click.echo("rdma:")
        click.echo("\n".join("  " + line for line in report.text().splitlines()))
        click.echo(probes.text(sections))
        missing = [n for s in probes.run_all(cfg) if s.name == "rdma" for n in s.needed]
        for n in missing:
            click.echo(f"  MISSING: {n}")
    sys.exit(Exit.OK if report.usable else Exit.FAILURE)
