"""Who may start a handshake, and how long a failed one waits: bounded tables.

- A cap on connections that have not finished their handshake, in all and per
  source address (the IP of a TCP or TLS peer; "local" for Unix sockets): a
  connection over either cap is closed at once, before a byte is read.
- Failed authentications per source: each failure within ``window`` seconds
  doubles the wait before the UNAUTHORIZED reply (and the close) goes out, from
  ``base`` up to ``cap`` seconds.  The verdicts of one source are answered one
  after another: a failure's wait starts when the source's previous one was
  answered, and while a source has failures in the window even a good secret
  is answered only after the waits before it (:meth:`verdict_delay`).  So
  neither parallel connections nor hanging up early and reading the silence
  as "wrong" (a success would have answered at once) gets a source more than
  one verdict per wait.  The table holds at most ``max_sources`` entries
  (oldest dropped).
"""

from __future__ import annotations

from collections import OrderedDict


class Admission:
    def __init__(
        self,
        max_pending: int = 1024,
        max_per_source: int = 128,
        *,
        base: float = 0.05,
        cap: float = 2.0,
        window: float = 60.0,
        max_sources: int = 4096,
    ) -> None:
        self.max_pending = max_pending
        self.max_per_source = max_per_source
        self.base, self.cap, self.window = base, cap, window
        self.max_sources = max_sources
        self.pending = 0
        self.by_source: dict[str, int] = {}
        self.refused = 0
        # source -> (failures in the window, time of the last one, the time
        # before which no further verdict for this source is answered)
        self._fails: OrderedDict[str, tuple[int, float, float]] = OrderedDict()

    def admit(self, source: str) -> str | None:
        """Count a new connection; the reason it is refused, or None."""
        n = self.by_source.get(source, 0)
        if self.pending >= self.max_pending:
            self.refused += 1
            return f"{self.pending} connections are not yet authenticated (the cap)"
        if n >= self.max_per_source:
            self.refused += 1
            return f"{n} connections from {source} are not yet authenticated (the cap per source)"
        self.pending += 1
        self.by_source[source] = n + 1
        return None

    def release(self, source: str) -> None:
        """The connection authenticated or went away."""
        self.pending -= 1
        n = self.by_source.get(source, 0) - 1
        if n > 0:
            self.by_source[source] = n
        else:
            self.by_source.pop(source, None)

    def failed(self, source: str, now: float) -> tuple[float, int]:
        """A failed authentication: (seconds to wait before answering, failures so far).

        The wait starts once this source's earlier verdicts are answered.
        """
        count, last, free = self._fails.pop(source, (0, now, now))
        if now - last > self.window:
            count, free = 0, now
        count += 1
        at = max(now, free) + min(self.cap, self.base * (1 << min(count - 1, 20)))
        self._fails[source] = (count, now, at)
        while len(self._fails) > self.max_sources:
            self._fails.popitem(last=False)
        return at - now, count

    def verdict_delay(self, source: str, now: float) -> float:
        """Seconds before a good secret from ``source`` may be answered (0: at once).

        Non-zero only while earlier failures of this source wait for their
        answer: answering a success sooner would tell a guesser that hangs up
        early which guess was right.
        """
        rec = self._fails.get(source)
        if rec is None or now - rec[1] > self.window:
            return 0.0
        return max(0.0, rec[2] - now)

    def failures(self, source: str) -> int:
        return self._fails.get(source, (0, 0.0, 0.0))[0]
