"""``transferd peers URL`` and ``transferd names URL [PREFIX]``: the cluster's directory.

Both ask the daemon at URL (PEERS, NAMES: docs/protocol.md) what it knows: the
daemons alive, and the names published (through it, or mirrored from etcd).
The first line says where the daemon keeps its names and whether that store is
up.  ``--json`` prints one object for a script.
"""

from __future__ import annotations

import json
from typing import Any

import click

from .remote import TIMEOUT, TOKEN, URL, _with_client, say


def _where(st: dict[str, Any]) -> str:
    if st.get("backend") == "embedded":
        return f"names in this daemon alone (embedded), node {st.get('node_name', '?')}"
    line = f"names in {st.get('url', 'etcd')}: {st.get('state', '?')}"
    if st.get("error"):
        line += f" ({st['error']})"
    if st.get("pending"):
        line += f", {st['pending']} name(s) waiting to be written"
    return line + f"; node {st.get('node_name', '?')}"


@click.command(short_help="List the daemons alive in the cluster.")
@URL
@TOKEN
@TIMEOUT
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
def peers(url: str, token: str | None, timeout: float, as_json: bool) -> None:
    """The daemons the daemon at URL knows to be alive (PEERS): node name, version,
    rails, client URLs and engine node id; this daemon marked with *."""

    async def work(c: Any) -> tuple[list[Any], dict[str, Any]]:
        return await c.peers(), await c.discovery_status()

    nodes, status = _with_client(url, token, timeout, work)
    if as_json:
        click.echo(json.dumps({"discovery": status, "peers": [
            {"name": p.name, "node": f"{p.node:016x}", "local": p.local,
             "version": ".".join(map(str, p.version)), "rails": list(p.rails),
             "urls": list(p.urls), "server": p.server, "capabilities": p.capabilities,
             "addr": p.addr.to_bytes().hex() if p.addr else None} for p in nodes]}))
        return
    say(_where(status))
    say(f"  {'node':<28}{'version':<9}{'engine':<18}{'rails':<24}urls")
    for p in nodes:
        mark = "*" if p.local else " "
        say(f"{mark} {p.name:<28}{'.'.join(map(str, p.version)):<9}"
            f"{(f'{p.node:016x}' if p.node else '-'):<18}"
            f"{(','.join(p.rails) or '-'):<24}{' '.join(p.urls) or '-'}")
    say(f"{len(nodes)} node(s)")


@click.command(short_help="List the names published in the cluster.")
@URL
@click.argument("prefix", default="", required=False)
@TOKEN
@TIMEOUT
@click.option("--limit", type=click.IntRange(1), default=None,
              help="List at most this many (default: all, page after page).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
def names(url: str, prefix: str, token: str | None, timeout: float, limit: int | None,
          as_json: bool) -> None:
    """The names under PREFIX (all without one) the daemon at URL knows (NAMES): name,
    kind of value, its size, and the node it was published through."""

    async def work(c: Any) -> tuple[list[Any], dict[str, Any]]:
        return await c.names(prefix, limit), await c.discovery_status()

    rows, status = _with_client(url, token, timeout, work)
    if as_json:
        click.echo(json.dumps({"discovery": status, "names": [
            {"name": n.name, "kind": n.kind, "size": n.size, "node": n.node} for n in rows]}))
        return
    say(_where(status))
    width = max([len(n.name) for n in rows] + [4]) + 2
    say(f"{'name':<{width}}{'kind':<10}{'size':>6}  node")
    for n in rows:
        say(f"{n.name:<{width}}{n.kind:<10}{n.size:>6}  {n.node}")
    say(f"{len(rows)} name(s)" + (f" under {prefix!r}" if prefix else ""))
