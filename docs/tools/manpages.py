#!/usr/bin/env python3
"""Manual pages for ``transferd`` and ``rpc-server``, generated from their click commands.

    python docs/tools/manpages.py --write    # rewrite man/transferd.1 and man/rpc-server.1
    python docs/tools/manpages.py --check    # exit 1 when they are stale (a test runs it)

The pages are what ``--help`` says, every command and flag, set as roff, with the exit
statuses, the environment and the files of the service.  The package installs them
under ``share/man/man1`` (pyproject.toml), so ``man transferd`` finds them wherever the
``bin/`` of the install is on the PATH.  No date in them: a rebuild changes nothing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from transferd import __version__  # noqa: E402
from transferd.exits import Exit  # noqa: E402

MAN = REPO / "man"

EXIT_TEXT = {
    Exit.OK: "done; or a daemon stopped by SIGTERM or SIGINT",
    Exit.FAILURE: "a failure at run time: a daemon that failed after it started, a check "
                  "that found a problem, a daemon that could not be reached",
    Exit.USAGE: "a usage error: a flag that does not exist, a value of the wrong form",
    Exit.CONFIG: "the configuration is invalid (every problem on stderr); nothing started",
    Exit.BIND: "a listener cannot bind its address (in use, not on this host)",
    Exit.INSTALL: "a broken install: no front end, a module missing",
}


def _esc(text: str) -> str:
    """Text for roff: backslashes and hyphens escaped, no line starting a request."""
    out = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + ln if ln[:1] in (".", "'") else ln for ln in out.splitlines())


def _paragraphs(text: str | None) -> list[str]:
    """click's help text as paragraphs (blank lines between; ``\\b`` blocks kept)."""
    if not text:
        return []
    paras, cur = [], []
    for line in text.strip().splitlines():
        if line.strip() in ("", "\b"):
            if cur:
                paras.append(" ".join(cur))
                cur = []
            continue
        cur.append(line.strip())
    if cur:
        paras.append(" ".join(cur))
    return paras


def _options(ctx: click.Context, cmd: click.Command) -> Iterable[str]:
    for p in cmd.get_params(ctx):
        if not isinstance(p, click.Option) or p.hidden:
            continue
        names = ", ".join(f"\\fB{_esc(o)}\\fR" for o in [*p.opts, *p.secondary_opts])
        meta = "" if p.is_flag or p.count else f" \\fI{_esc(p.make_metavar(ctx))}\\fR"
        help_ = p.help or ""
        if p.show_default and p.default is not None and not p.is_flag:
            help_ += f" [default: {p.default}]"
        yield ".TP"
        yield names + meta
        yield _esc(help_)


def _usage(ctx: click.Context, cmd: click.Command, name: str) -> str:
    pieces = [f".B {_esc(name)}"]
    rest = [f"\\fI{_esc(p)}\\fR" for p in cmd.collect_usage_pieces(ctx)]
    return pieces[0] + ("\n" + " ".join(rest) if rest else "")


def render(cmd: click.Command, name: str, summary: str) -> str:
    """The roff of one program's page."""
    ctx = click.Context(cmd, info_name=name)
    lines = [f'.TH {name.upper()} 1 "" "transferd {__version__}" "User Commands"',
             ".SH NAME", f"{_esc(name)} \\- {_esc(summary)}", ".SH SYNOPSIS",
             _usage(ctx, cmd, name), ".SH DESCRIPTION"]
    for para in _paragraphs(cmd.help):
        lines += [_esc(para), ".PP"]
    if isinstance(cmd, click.Group):
        lines.append(".SH COMMANDS")
        for sub_name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, sub_name)
            if sub is None or sub.hidden:
                continue
            sctx = click.Context(sub, info_name=sub_name, parent=ctx)
            lines.append(f'.SS "{_esc(name)} {_esc(sub_name)}"')
            lines.append(_usage(sctx, sub, f"{name} {sub_name}"))
            lines.append(".PP")
            for para in _paragraphs(sub.help):
                lines += [_esc(para), ".PP"]
            lines += list(_options(sctx, sub))
        lines.append('.SS "Options of transferd itself"')
    else:
        lines.append(".SH OPTIONS")
    lines += list(_options(ctx, cmd))
    lines.append(".SH EXIT STATUS")
    for status, text in EXIT_TEXT.items():
        lines += [".TP", f"\\fB{int(status)}\\fR", _esc(text)]
    lines += [
        ".SH ENVIRONMENT",
        ".TP", "\\fBTRANSFERD_\\fISECTION\\fB_\\fIKEY\\fR",
        _esc("Any configuration key (server.port is TRANSFERD_SERVER_PORT); beats the file, "
             "loses to a flag."),
        ".TP", "\\fBTRANSFERD_TOKEN\\fR",
        _esc("The token the commands that talk to a daemon prove (or --token-file)."),
        ".SH FILES",
        ".TP", "\\fI/etc/transferd/transferd.toml\\fR",
        _esc("The service's configuration (config/transferd.toml lists every key)."),
        ".SH SEE ALSO",
        _esc("The project's docs/operations.md, docs/configuration.md and "
             "docs/getting-started.md; systemctl(1), journalctl(1)."),
    ]
    return "\n".join(lines) + "\n"


def pages() -> dict[str, str]:
    """file name -> its text, for both programs."""
    from rpc_server.cli import main as rpc_server
    from transferd.cli import main as transferd

    return {
        "transferd.1": render(transferd, "transferd",
                              "moves bytes between machines for LLM systems"),
        "rpc-server.1": render(rpc_server, "rpc-server",
                               "a complete transferd daemon with llama.cpp's flag names"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"rewrite the pages in {MAN}")
    ap.add_argument("--check", action="store_true", help="exit 1 when they are stale")
    args = ap.parse_args(argv)
    stale = []
    for name, text in pages().items():
        path = MAN / name
        if args.write:
            MAN.mkdir(exist_ok=True)
            path.write_text(text)
        elif args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            sys.stdout.write(text)
    for name in stale:
        print(f"man/{name} is stale: run python docs/tools/manpages.py --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
