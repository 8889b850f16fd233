"""The daemon's secrets: read from files nobody else can read, and swapped whole on SIGHUP.

Two secrets, each a :class:`~transferd.protocol.keyring.Keyring`: the one
clients prove (``server.token_file`` or ``server.token``, and during a
rotation ``server.previous_token_file``) and the cluster secret daemons prove
to each other (``engine.secret_file`` or ``engine.secret``, and
``engine.previous_secret_file``).  :func:`load` reads them all at once, so a
reload compares what the files hold now with what is in use, not their paths
(:func:`changes` says what changed without showing a secret).

A secret file is refused, as ssh refuses a private key, when a user other than
the daemon's could read it (any group or other permission bit) or rewrite it
(owned by someone other than the daemon's user or root), or replace it (a directory
on its way that another user owns, or can write without the sticky bit), unless
``server.insecure_secret_files`` is set.  The file is opened once and judged
by what was opened (a symlink is followed, and its target judged), so it
cannot be swapped between the check and the read.  Anything but a regular
file (a FIFO that never ends, a device) is refused without reading it.
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transferd.config_sections import ConfigError
from transferd.protocol.keyring import Keyring

if TYPE_CHECKING:  # the config's loader reads secret files through this module
    from transferd.config import Config, EngineConfig, ServerConfig

# Longest secret file read, in bytes (a longer one is refused, not cut).
MAX_CLIENT_SECRET = 4096
MAX_CLUSTER_SECRET = 65536
INSECURE_KEY = "server.insecure_secret_files"


def read_secret(path: str, key: str, *, insecure: bool = False,
                limit: int = MAX_CLIENT_SECRET, may_be_empty: bool = False) -> bytes:
    """The secret in ``path`` (its contents, outer whitespace removed); ConfigError
    naming ``key`` when it cannot be read, is not a regular file, is empty (unless
    ``may_be_empty``: then b""), longer than ``limit`` bytes, or (unless
    ``insecure``) open to another user."""
    if "\0" in path:  # os.open's ValueError, not an OSError
        raise ConfigError(f"{key}: {path!r} has a NUL byte: not a file name")
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{key}: {path} is not a regular file")
        if not insecure:
            target = os.path.realpath(path)
            why, fix = _exposed(st, target)
            rule = "a secret must be readable by this daemon's user only"
            if not why:
                why, fix = _replaceable(path, target)
                rule = "nobody but this daemon's user (or root) may replace a secret"
            if why:
                via = f" (a symlink to {target})" if target != os.path.abspath(path) else ""
                raise ConfigError(
                    f"{key}: {path}{via} {why}: {rule}. Fix it with: {fix} (or set "
                    f"{INSECURE_KEY} = true to accept the risk)")
        data = b""
        while len(data) <= limit:
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ConfigError(f"{key}: {path} is longer than {limit} bytes: is it the secret?")
    secret = data.strip()
    if not secret and not may_be_empty:
        raise ConfigError(f"{key}: {path} is empty")
    return secret


def _exposed(st: os.stat_result, target: str) -> tuple[str, str]:
    """(why another user could read or replace the file, the command that fixes it);
    ("", "") when none could."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return (f"belongs to uid {st.st_uid}, who can rewrite it",
                f"chown {_user(me)} {target} && chmod 600 {target}")
    if st.st_mode & 0o077:
        return (f"can be read by other users (mode {stat.S_IMODE(st.st_mode):04o})",
                f"chmod 600 {target}")
    return "", ""


def _replaceable(path: str, target: str) -> tuple[str, str]:
    """(why another user could put another file in the secret's place, the fix); ("", "")
    when none could.  As ssh's StrictModes: every directory from the root to the file
    (and to the symlink naming it) must belong to this user or root and be writable by
    no one else, unless it is sticky (/tmp): there nobody can replace another's file."""
    me = os.geteuid()
    seen: set[str] = set()
    for start in (target, os.path.realpath(os.path.dirname(os.path.abspath(path)) or "/")
                  + "/."):
        d = os.path.dirname(start)
        while d not in seen:
            seen.add(d)
            try:
                st = os.stat(d)
            except OSError:
                break  # the file was read through it: the open judged it enough
            if st.st_uid not in (me, 0):
                return (f"is under {d}, which belongs to uid {st.st_uid}, who can put "
                        "another file in its place",
                        f"chown {_user(me)} {d}, or move the secret elsewhere")
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                return (f"is under {d}: {d} can be written by other users (mode "
                        f"{stat.S_IMODE(st.st_mode):04o}), who can put another file in its "
                        "place", f"chmod go-w {d}")
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
    return "", ""


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@dataclass(frozen=True)
class Secrets:
    """What the daemon proves and accepts: from clients, and from other daemons."""

    client: Keyring
    # None: no cluster secret (rails on loopback only, unless engine.insecure).
    cluster: Keyring | None


def client_keyring(s: ServerConfig) -> Keyring:
    """server.token_file (else server.token) and server.previous_token_file."""
    insecure = s.insecure_secret_files
    if s.token_file:
        current = read_secret(s.token_file, "server.token_file", insecure=insecure)
    else:
        current = s.token.strip().encode()
    previous = b""
    if s.previous_token_file:
        # Empty between rotations: the key can stay set, the file truncated.
        previous = read_secret(s.previous_token_file, "server.previous_token_file",
                               insecure=insecure, may_be_empty=True)
    return Keyring(current, previous)


def cluster_keyring(e: EngineConfig, insecure: bool = False) -> Keyring | None:
    """engine.secret_file (else engine.secret) and engine.previous_secret_file."""
    if e.secret_file:
        current = read_secret(e.secret_file, "engine.secret_file", insecure=insecure,
                              limit=MAX_CLUSTER_SECRET)
    else:
        current = e.secret.strip().encode()
    if not current:
        return None
    previous = b""
    if e.previous_secret_file:
        previous = read_secret(e.previous_secret_file, "engine.previous_secret_file",
                               insecure=insecure, limit=MAX_CLUSTER_SECRET, may_be_empty=True)
    return Keyring(current, previous)


def load(config: Config) -> Secrets:
    """Every secret of ``config``, read now; ConfigError listing every file refused."""
    errors: list[str] = []
    client: Keyring = Keyring()
    cluster: Keyring | None = None
    try:
        client = client_keyring(config.server)
    except ConfigError as exc:
        errors += exc.errors
    if config.engine.enabled:
        try:
            cluster = cluster_keyring(config.engine, config.server.insecure_secret_files)
        except ConfigError as exc:
            errors += exc.errors
    if errors:
        raise ConfigError(errors)
    return Secrets(client, cluster)


def problems(config: Config) -> list[tuple[str, str]]:
    """``(key, message)`` for every secret file this machine would refuse (preflight)."""
    try:
        load(config)
    except ConfigError as exc:
        return [(e.split(":", 1)[0], e.split(":", 1)[1].strip()) for e in exc.errors]
    return []


def changes(old: Secrets, new: Secrets, config: Config) -> list[str]:
    """What a reload changes, for the log: which secret and from which key, never a value."""
    s, e = config.server, config.engine
    out = []
    for what, key, prev_key, a, b in (
        ("client secret", "server.token_file" if s.token_file else "server.token",
         "server.previous_token_file", old.client, new.client),
        ("cluster secret", "engine.secret_file" if e.secret_file else "engine.secret",
         "engine.previous_secret_file", old.cluster, new.cluster),
    ):
        a, b = a or Keyring(), b or Keyring()
        if a.current != b.current:
            out.append(f"{key}: the {what} {_change(a.current, b.current)}")
        if a.previous != b.previous:
            out.append(f"{prev_key}: the previous {what} "
                       f"{_change(a.previous, b.previous, previous=True)}")
    return out


def _change(a: bytes, b: bytes, previous: bool = False) -> str:
    if not a:
        return ("set (accepted beside the current one until this file is emptied)"
                if previous else "set (new handshakes require it)")
    if not b:
        return "removed (no longer accepted)"
    return "replaced (new handshakes use the new contents)"
