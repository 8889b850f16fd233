"""``rpc-server``: one command that starts a complete daemon, llama.cpp's flag names."""

from __future__ import annotations

from typing import Any

import click

from transferd import __version__
from transferd.serve_options import serve, serve_options

from .server import RpcFrontend


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rpc-server")
@serve_options
def main(**flags: Any) -> None:
    """Serve transferd's RPC protocol (and its transfer engine) on HOST:PORT."""
    serve("rpc-server", lambda: [RpcFrontend()], **flags)


if __name__ == "__main__":
    main()
