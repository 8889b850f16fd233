"""Failed handshakes, client and peer: one WARNING each, per source at most once per
window, and a count by reason that Prometheus exports (``transferd_auth_failures_total``).

Both planes call in here: the RPC sessions (a client's token missing or wrong, a client
that hung up after the server's proof, an AUTH that never came) and every Domain's peer
links (a cluster secret missing on one side or different, a peer that proves another
identity, a handshake that timed out or broke its rules).  The line names the source
address and says which side lacks what; the counter lets ``TransferdUnauthorized`` and
``TransferdPeerAuthFailures`` fire however much of the log the window held back.

The tally is the process's, as its log is: one daemon per process.  It is taken from any
thread (engine workers run peer links), so it holds a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from transferd.logs import hostport

PLANES = ("client", "peer")
#: Why a handshake failed, from a fixed set (the metric's ``reason`` label):
#: ``no_secret``: one side has a secret (token, cluster secret) and the other none;
#: ``wrong_secret``: both have one and they differ;
#: ``identity``: a peer proved or claimed another node, group or address;
#: ``timeout``: not finished in time (after the HELLO, for clients);
#: ``protocol``: a frame the handshake does not allow (a bad nonce, an unoffered method);
#: ``config``: the two daemons cannot link as configured (rail counts, versions).
REASONS = ("no_secret", "wrong_secret", "identity", "timeout", "protocol", "config")
#: The reasons that mean a secret or an identity did not match (what the alerts count).
AUTH_REASONS = ("no_secret", "wrong_secret", "identity")

WINDOW_S = 10.0
MAX_SOURCES = 4096

log = logging.getLogger("transferd.auth")


def source_host(addr: str) -> str:
    """The host part of ``host:port`` / ``[v6]:port`` (a source's failures are counted
    together whatever its ports)."""
    if addr.startswith("["):
        return addr[1:].partition("]")[0]
    host, sep, port = addr.rpartition(":")
    return host if sep and port.isdigit() else addr


class AuthFailures:
    """Counts by (plane, reason); logs each failure unless its source logged one lately.

    A source (plane, host, reason) gets one line per ``window_s``; the next line it gets
    says how many were held back.  The table of sources is bounded (oldest forgotten):
    a flood of sources costs at most one line each, and the log's own flood guard
    (:class:`transferd.logs.RateLimit`) bounds those.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S,
                 max_sources: int = MAX_SOURCES) -> None:
        self.clock = clock
        self.window_s = window_s
        self.max_sources = max_sources
        self._lock = threading.Lock()
        self._counts = {(p, r): 0 for p in PLANES for r in REASONS}
        # (plane, host, reason) -> [time of the last line, failures held back since]
        self._sources: OrderedDict[tuple[str, str, str], list[float]] = OrderedDict()

    def counts(self) -> Iterator[tuple[str, str, int]]:
        with self._lock:
            items = list(self._counts.items())
        for (plane, reason), n in items:
            yield plane, reason, n

    def count(self, plane: str, reason: str) -> int:
        with self._lock:
            return self._counts[(plane, reason)]

    def failed(self, plane: str, reason: str, source: str, message: str, *,
               emit: bool = True, **fields: Any) -> None:
        """One failed handshake from ``source`` (``host:port``): counted, and logged at
        WARNING unless ``emit`` is false (a line elsewhere names it) or the window holds
        it back."""
        if reason not in REASONS:
            reason = "protocol"
        now = self.clock()
        key = (plane, source_host(source), reason)
        with self._lock:
            self._counts[(plane, reason)] += 1
            if not emit:
                return
            st = self._sources.get(key)
            if st is not None and now - st[0] < self.window_s:
                st[1] += 1
                return
            held = int(st[1]) if st is not None else 0
            self._sources[key] = [now, 0]
            self._sources.move_to_end(key)
            while len(self._sources) > self.max_sources:
                self._sources.popitem(last=False)
        more = (f" [{held} more from {key[1]} like this in the last {self.window_s:g} s]"
                if held else "")
        what = "client authentication failed" if plane == "client" else "peer handshake failed"
        log.warning("%s from %s (%s): %s%s", what, source, reason, message, more,
                    extra={"plane": plane, "reason": reason, "source": source,
                           "held_back": held, **fields})


#: The process's tally (the metrics export it; tests make their own).
FAILURES = AuthFailures()


def client_failed(source: str, reason: str, message: str) -> None:
    """A client's handshake failed at this server."""
    FAILURES.failed("client", reason, source, message)


def peer_failed(hs: Any, source: Any, rail: int, error: Any = None, *,
                emit: bool = True) -> None:
    """A peer link's handshake (``hs``, a :class:`~transferd.protocol.peer_handshake.
    PeerHandshake` that failed: its ``reason`` and ``error``) on ``rail``, with the
    other end at ``source``.  ``emit=False`` where the caller logs the failure itself
    (an initiator's broken link is its own WARNING)."""
    err = error if error is not None else getattr(hs, "error", None)
    message = getattr(err, "message", None) or str(err or "handshake failed")
    reason = getattr(hs, "reason", "") or "protocol"
    who = "this daemon dialled it" if _initiator(hs) else f"{_node(hs)} dialled this daemon"
    FAILURES.failed("peer", reason, _where(source), f"rail {rail} ({who}): {message}",
                    emit=emit, rail=rail)


def peer_hung_up(hs: Any, source: Any, rail: int) -> None:
    """The other end closed a link mid-handshake.  Counted (and logged) only after this
    daemon, receiving, sent its proof: a dialling daemon that checks it and hangs up
    holds another cluster secret (or expected another node).  A close before the HELLO
    is a port probe or a health check, not a failure."""
    from transferd.protocol.peer_handshake import State

    if _initiator(hs) or getattr(hs, "state", None) is not State.AWAIT_AUTH:
        return
    if hs.secret is not None:
        reason = "wrong_secret"
        message = ("the dialling daemon hung up after this daemon's proof of the cluster "
                   "secret: its engine.secret_file differs from this daemon's (or it "
                   "dialled another node)")
    else:
        reason = "identity"
        message = ("the dialling daemon hung up before echoing the probe sent to the "
                   "address it claims (it does not listen there, or expected another node)")
    FAILURES.failed("peer", reason, _where(source),
                    f"rail {rail} ({_node(hs)} dialled this daemon): {message}", rail=rail)


def _where(source: Any) -> str:
    """``host:port`` of a socket address, or of a rail's address bytes."""
    if isinstance(source, bytes):
        return source.decode(errors="backslashreplace")
    return hostport(source)


def _node(hs: Any) -> str:
    """The node the other end claimed in its HELLO (not proven), else "it"."""
    peer = getattr(hs, "peer", None)
    return f"node {peer.node:016x}, as it claims," if peer is not None else "it"


def _initiator(hs: Any) -> bool:
    return getattr(getattr(hs, "role", None), "value", "") == "initiator"
