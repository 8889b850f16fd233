"""Exit statuses of every transferd command (``transferd ...`` and ``rpc-server``).

Scripts and systemd rely on them; docs/operations.md lists them.
"""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    #: Failed after start-up (a daemon that died), a check that found a
    #: problem (doctor), a daemon that could not be reached (stats, ping).
    FAILURE = 1
    #: The command line is wrong (click's own usage errors use 2 as well).
    USAGE = 2
    #: The configuration is invalid (file, TRANSFERD_* variables, flags); nothing started.
    CONFIG = 3
    #: A listener could not bind its address (in use, not on this host); nothing serves.
    BIND = 4
    #: The install is broken: no front end, a module missing.
    INSTALL = 5
