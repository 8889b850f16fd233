"""``transferd reload PID``: SIGHUP a daemon and wait until its reload is done.

The unit's ``ExecReload=``, so that ``systemctl reload transferd`` returns once the
daemon has re-read its configuration (on every systemd, not only those with
``Type=notify-reload``) and fails when the daemon refused it.  It binds the abstract
datagram socket the daemon answers on (:func:`transferd.lifecycle.reload_socket`),
sends SIGHUP, and takes the one answer that the kernel says came from that PID
(SCM_CREDENTIALS), so another local process can neither fake an answer nor be taken
for the daemon.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import time

import click

from transferd.exits import Exit
from transferd.lifecycle import reload_socket

_UCRED = struct.Struct("iII")  # pid, uid, gid


def wait_for_reload(pid: int, timeout: float) -> tuple[bool, str]:
    """SIGHUP ``pid``; (applied, what it said).  Raises OSError (no such process, or
    the socket taken by another waiter) and TimeoutError."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        try:
            s.bind(reload_socket(pid))
        except OSError as exc:
            raise OSError(exc.errno, f"another reload of {pid} is being waited for "
                                     f"({exc.strerror})") from None
        os.kill(pid, signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                s.settimeout(left)
                data, anc, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(_UCRED.size))
            except TimeoutError:
                raise TimeoutError(f"process {pid} did not say within {timeout:g} s that its "
                                   "reload is done (is it a transferd daemon?)") from None
            sender = next((_UCRED.unpack(d[:_UCRED.size])[0] for lvl, kind, d in anc
                           if lvl == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS),
                          None)
            if sender != pid:
                continue  # not from the daemon: ignored
            word, _, text = data.decode(errors="replace").partition(" ")
            return word == "ok", text


@click.command(short_help="SIGHUP a daemon and wait for its reload (the unit's ExecReload).")
@click.argument("pid", type=click.IntRange(1))
@click.option("--timeout", type=click.FloatRange(0.1, 3600), default=30.0, show_default=True,
              help="Seconds to wait for the daemon to say its reload is done.")
def reload(pid: int, timeout: float) -> None:
    """Send SIGHUP to the daemon PID and wait until it has reloaded its configuration.

    Prints what it applied (and what needs a restart); exit 0 when the reload was
    applied, 1 when the daemon refused the configuration (it keeps running with the
    one it had) or did not answer within TIMEOUT.  systemd's unit runs it as
    ExecReload=, so `systemctl reload transferd` waits for the reload and reports a
    refused one.
    """
    try:
        ok, text = wait_for_reload(pid, timeout)
    except (OSError, TimeoutError) as exc:
        why = exc.strerror if type(exc) is not TimeoutError and exc.strerror else str(exc)
        click.echo(f"transferd reload: {pid}: {why}", err=True)
        sys.exit(Exit.FAILURE)
    click.echo(f"transferd reload: {pid}: {'reloaded' if ok else 'refused'}: {text}",
               err=not ok)
    sys.exit(Exit.OK if ok else Exit.FAILURE)
