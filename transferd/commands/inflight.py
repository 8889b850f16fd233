"""``transferd inflight URL``: what a daemon has in flight now (STATS with "inflight").

Every pending transfer, expectation and read, oldest first: its age, its stage and how
long it has been in it, the peer and rails, bytes done of total, the trace id and the
connection that owns it (docs/integrity.md, docs/protocol.md).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from transferd.exits import Exit

from .remote import TIMEOUT, TOKEN, URL, _size, _with_client, ask, say, unreadable


def _done(e: dict[str, Any]) -> str:
    if e["kind"] == "expectation":
        return f"{e['done']:,}/{e['total']:,}"
    return f"{_size(e['done'])}/{_size(e['total'])}"


@click.command(short_help="List what a daemon has in flight (transfers, expectations).")
@URL
@TOKEN
@TIMEOUT
@click.option("--json", "as_json", is_flag=True, help="The listing as JSON.")
def inflight(url: str, token: str | None, timeout: float, as_json: bool) -> None:
    """List what the daemon at URL has in flight, oldest first: each pending transfer,
    expectation and read, and what peers have under way there (a write landing, a READ
    being answered, a message waiting for a receive), with its age, stage (queued,
    waiting for a peer slot, sent, partly acknowledged, landing, expecting, answering,
    waiting for a receive, delivering) and time in it, peer, rails, bytes done of total,
    trace id and owner (STATS with "inflight", docs/protocol.md)."""
    from transferd.protocol.constants import Command

    async def work(c: Any) -> dict[str, Any]:
        return dict((await ask(c, Command.STATS, {"inflight": True})).body)

    body = _with_client(url, token, timeout, work)
    listing = body.get("inflight")
    if not isinstance(listing, dict):
        click.echo(f"transferd: {url}: this daemon does not list what is in flight (an "
                   "older version, or its engine is off)", err=True)
        sys.exit(Exit.FAILURE)
    if as_json:
        click.echo(json.dumps(listing))
        return
    # Read whole before a line is printed: a daemon that answers something else (a
    # field missing, of another type) gets one error naming it, not a traceback.
    with unreadable(url):
        rows = listing["entries"]
        lines = [f"{'kind':<12}{'op':>8}  {'stage':<24}{'in it':>8}{'age':>8}  "
                 f"{'peer':<17}{'rails':<6}{'done':>20}  {'trace id':<33}owner"]
        for e in rows:
            what = f" ({e['what']})" if e.get("what") else ""
            lines.append(f"{e['kind']:<12}{e['op']:>8}  {e['stage']:<24}"
                         f"{e['in_stage_s']:>7.1f}s{e['age_s']:>7.1f}s  {e['peer'] or '-':<17}"
                         f"{','.join(map(str, e['rails'])) or '-':<6}{_done(e):>20}  "
                         f"{e['trace_id'] or '-':<33}{e['owner'] or '-'}{what}")
        more = " (listing cut at 10,000)" if listing.get("truncated") else ""
        warn = listing.get("stall_warn_s") or 0
        stalls = (f"; {listing.get('stalls', 0)} stalled so far (engine.stall_warn_s "
                  f"{warn:g} s)" if warn else "; stall warnings off (engine.stall_warn_s = 0)")
        lines.append(f"{len(rows)} in flight{more}{stalls}")
    say("\n".join(lines))
