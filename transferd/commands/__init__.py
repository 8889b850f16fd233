"""The ``transferd`` subcommands beyond serve and check-config.

Each module defines click commands; :func:`register` adds them to the group.  A
helper with a new command adds its module here (one line), and device discovery
plugs into ``transferd devices`` / ``doctor`` through :mod:`transferd.commands.probes`.
"""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    from . import bench, doctor, inflight, names, reload, remote

    for cmd in (doctor.devices, doctor.doctor, remote.ping, remote.stats, remote.buffers,
                inflight.inflight, bench.bench, names.peers, names.names, reload.reload):
        group.add_command(cmd)
