"""PROBEs, for every Domain whose handshake runs over a rail's TCP link (no cluster secret).

Without a secret a responder holds an initiator to the address it claims by sending
a token in a PROBE, on a connection of its own, to that address
(:mod:`transferd.protocol.peer_handshake`).  :class:`Probes` is both sides of that
for one domain group:

- our outbound links waiting for their token, by handshake nonce
  (:meth:`Probes.expect`, :meth:`Probes.arrived` when a PROBE comes to one of our
  listeners), at most :data:`MAX_EXPECTED`;
- the probes we dial for peers' handshakes (:meth:`Probes.dial`): each takes a
  descriptor of the link budget while it runs (a stranger's HELLO naming a
  tarpit cannot spend descriptors the budget does not count), at most
  :data:`MAX_DIALS` at once, each ended by the handshake's timeout or as soon as
  the handshake it serves is over (:meth:`Probes.cancel`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Hashable

from transferd.fds import LinkBudget, LogEvery
from transferd.protocol.errors import BadRequest

from .rails import parse_rail

log = logging.getLogger("transferd.domain")

# Outbound handshakes waiting for a PROBE, per group.
MAX_EXPECTED = 1024
# Probe dials in flight at once, per group.
MAX_DIALS = 64


async def dial_probe(loop: asyncio.AbstractEventLoop, bind_host: str, host: str, port: int,
                     data: bytes, timeout: float, label: str) -> None:
    """Connect from ``bind_host`` to ``host:port``, send ``data`` (a PROBE), hang up.

    A failure is only logged (the initiator's handshake then times out on its own).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((bind_host, 0))
        sock.setblocking(False)
        await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
        await asyncio.wait_for(loop.sock_sendall(sock, data), timeout)
    except (TimeoutError, OSError) as exc:
        log.info("%s: probe to %s:%d failed: %s", label, host, port, exc)
    finally:
        sock.close()


class Probes:
    def __init__(self, loop: asyncio.AbstractEventLoop, budget: LinkBudget,
                 take: Callable[[], bool] | None = None) -> None:
        self.loop = loop
        self.budget = budget
        # How a dial gets its descriptor (the group's: room made at the cap).
        self._take = take or budget.take
        self._expected: dict[bytes, Callable[[bytes], None]] = {}
        self._dials: dict[Hashable, asyncio.Task[None]] = {}
        self._log = LogEvery(log)
        self.refused = 0  # probe dials not made (over the bound or the budget)

    def __len__(self) -> int:
        return len(self._dials)

    # -- ours: links waiting for their token -------------------------------------------

    def expect(self, nonce: bytes, on_token: Callable[[bytes], None]) -> bool:
        """Hand the token of a PROBE naming ``nonce`` to ``on_token``; False if too many
        wait already (that handshake then cannot finish without a secret)."""
        if len(self._expected) >= MAX_EXPECTED:
            return False
        self._expected[nonce] = on_token
        return True

    def forget(self, nonce: bytes) -> None:
        self._expected.pop(nonce, None)

    def arrived(self, nonce: bytes, token: bytes) -> None:
        """A PROBE came to one of our listeners."""
        fn = self._expected.pop(nonce, None)
        if fn is not None:
            fn(token)

    # -- theirs: probes we dial ---------------------------------------------------------

    def dial(self, owner: Hashable, bind_host: str, addr: bytes, data: bytes, timeout: float,
             label: str) -> bool:
        """Send a PROBE to ``addr`` for the handshake of ``owner`` (an inbound link);
        False if it cannot be (a bad address, too many probes, no descriptor)."""
        try:
            host, port = parse_rail(addr)
        except BadRequest as exc:
            log.info("%s: peer claims a bad address: %s", label, exc.message)
            return False
        if len(self._dials) >= MAX_DIALS or owner in self._dials or not self._take():
            self.refused += 1
            self._log(logging.WARNING, "%s: probe to %s not sent: %d probes in flight, %d of "
                      "%d peer links open", label, addr.decode(errors="replace"),
                      len(self._dials), self.budget.used, self.budget.limit)
            return False
        task = self.loop.create_task(dial_probe(self.loop, bind_host, host, port, data,
                                                timeout, label))
        self._dials[owner] = task
        task.add_done_callback(lambda _t: self._dialled(owner, task))
        return True

    def _dialled(self, owner: Hashable, task: asyncio.Task[None]) -> None:
        if self._dials.get(owner) is task:
            del self._dials[owner]
        self.budget.release()

    def cancel(self, owner: Hashable) -> None:
        """The handshake ``owner``'s probe served is over: stop dialling for it."""
        task = self._dials.get(owner)
        if task is not None:
            task.cancel()

    def close(self) -> None:
        for task in list(self._dials.values()):
            task.cancel()
        self._expected.clear()
