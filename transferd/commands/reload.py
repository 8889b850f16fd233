"""``transferd reload PID``: SIGHUP a daemon and wait until its reload is done.

The unit's ``ExecReload=``, so that ``systemctl reload transferd`` returns once the
daemon has re-read its configuration (on every systemd, not only those with
``Type=notify-reload``) and fails when the daemon refused it.  It binds the abstract
datagram socket the daemon answers on (:func:`transferd.lifecycle.reload_socket`),
sends SIGHUP, and takes the one answer that the kernel says came from that PID
(SCM_CREDENTIALS), so another local process can neither fake an answer nor be taken
for the daemon.

SIGHUP's default action ends a process, so before sending it the command checks that
the PID is a transferd daemon ready for it: it catches SIGHUP (a daemon still starting,
a shell, ``sleep`` do not: they would be killed) and its command line is transferd's or
rpc-server's (sshd and nginx catch SIGHUP too, and would restart).  The signal goes
through a pidfd opened before the checks, so a PID reused meanwhile is not signalled.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import time

import click

from transferd.commands.remote import say
from transferd.exits import Exit
from transferd.lifecycle import reload_socket

_UCRED = struct.Struct("iII")  # pid, uid, gid
# A daemon's command line names one of these (``transferd serve``, ``rpc-server``,
# ``python -m rpc_server.cli``, ``python -m transferd.cli serve``).
_PROGRAMS = ("transferd", "rpc-server", "rpc_server")


def not_a_daemon(pid: int, proc: str = "/proc") -> str:
    """Why SIGHUP must not be sent to ``pid`` ("" when it is a transferd daemon that
    handles it).  Raises OSError when there is no such process."""
    with open(f"{proc}/{pid}/status") as f:
        masks = dict(line.split(":\t", 1) for line in f if ":\t" in line)
    with open(f"{proc}/{pid}/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    hup = 1 << (signal.SIGHUP - 1)
    command = " ".join(argv)[:200] or masks.get("Name", "?").strip()
    if int(masks.get("SigIgn", "0"), 16) & hup:
        return f"it ignores SIGHUP ({command}): not a transferd daemon"
    if not int(masks.get("SigCgt", "0"), 16) & hup:
        return (f"it does not handle SIGHUP, which would end it ({command}): not a transferd "
                "daemon, or one still starting")
    if not any(p in os.path.basename(a) for a in argv[:3] for p in _PROGRAMS):
        return f"its command line is not transferd's ({command})"
    return ""


class NotADaemon(Exception):
    """The PID is not a transferd daemon that handles SIGHUP: nothing was sent."""


def wait_for_reload(pid: int, timeout: float) -> tuple[bool, str]:
    """SIGHUP ``pid``; (applied, what it said).  Raises OSError (no such process, or
    the socket taken by another waiter), NotADaemon and TimeoutError."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        try:
            s.bind(reload_socket(pid))
        except OSError as exc:
            raise OSError(exc.errno, f"another reload of {pid} is being waited for "
                                     f"({exc.strerror})") from None
        pidfd = os.pidfd_open(pid)
        try:
            why = not_a_daemon(pid)
            # Still the process the checks read (not one that took its PID since).
            signal.pidfd_send_signal(pidfd, 0)
            if why:
                raise NotADaemon(f"{why}; nothing sent")
            signal.pidfd_send_signal(pidfd, signal.SIGHUP)
        finally:
            os.close(pidfd)
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
    except (OSError, TimeoutError, NotADaemon) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        click.echo(f"transferd reload: {pid}: {why}", err=True)
        sys.exit(Exit.FAILURE)
    # (What the daemon answered: shown escaped, as every command prints a daemon's words.)
    say(f"transferd reload: {pid}: {'reloaded' if ok else 'refused'}: {text}", err=not ok)
    sys.exit(Exit.OK if ok else Exit.FAILURE)
