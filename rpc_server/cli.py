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
@click.option(
    "-d", "--device", default=None,
    help="Devices to serve buffers from: cpu (always served), or CUDA devices as "
    "cuda:0 or cuda:0,cuda:1 (needs CuPy; sets gpu.devices) [cpu].",
)
def main(device: str | None, **flags: Any) -> None:
    """Serve transferd's RPC protocol (and its transfer engine) on HOST:PORT."""
    gpus = [d.strip() for d in (device or "").split(",") if d.strip() and d.strip() != "cpu"]
    serve("rpc-server", lambda: [RpcFrontend()], extra={"gpu.devices": gpus or None}, **flags)


if __name__ == "__main__":
    main()
