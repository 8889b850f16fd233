"""Prometheus metrics, named by prometheus_client conventions.

Each daemon owns a private registry (tests run several daemons, and a global
registry would mix them).  Label values come from small fixed sets: command
names from PROTOCOL.md's table, error codes, and ``in``/``out``.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from transferd.protocol.constants import Command, ErrorCode

# Request latencies span ~20 us (a small GET on loopback) to seconds (a large
# transfer); buckets are spread log-uniformly over that range.
LATENCY_BUCKETS = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class _Sync:
    """Registered first, so a collection brings the counters up to date first."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        self.metrics.sync()
        return []


class _RequestSeconds:
    """``transferd_request_duration_seconds``: a histogram by command, kept as
    plain per-bucket tallies and exported when collected."""

    name = "transferd_request_duration_seconds"
    doc = "Time from a request's last byte to its reply, by command."

    def __init__(self) -> None:
        self.counts = {c: [0] * (len(LATENCY_BUCKETS) + 1) for c in Command}
        self.sums = dict.fromkeys(Command, 0.0)
        self._les = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.doc, labels=["command"])]

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(self.name, self.doc, labels=["command"])
        for c in Command:
            total = 0
            buckets = []
            for le, n in zip(self._les, list(self.counts[c]), strict=True):
                total += n
                buckets.append((le, total))
            fam.add_metric([c.name], buckets, self.sums[c])
        yield fam


class Metrics:
    """The daemon's metrics.

    :meth:`command` and :meth:`reply` run once per request on the event loop
    thread, so they only add to plain tallies (Counter.inc and
    Histogram.observe take a lock and several Python calls each, a visible
    share of a small request's cost); the Prometheus counters catch up
    whenever the registry is collected (a scrape) or :meth:`sync` is called.
    Call those two from the event loop thread only.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        r.register(_Sync(self))
        self.commands = Counter(
            "transferd_commands", "Commands received, by command.", ["command"], registry=r
        )
        self.command_bytes = Counter(
            "transferd_command_bytes",
            "Frame bytes (header, body, payload) by command and direction.",
            ["command", "direction"],
            registry=r,
        )
        self.errors = Counter(
            "transferd_errors", "Error replies and events sent, by code.", ["code"], registry=r
        )
        self.connections = Gauge(
            "transferd_open_connections", "Client connections open now.", registry=r
        )
        self.connections_accepted = Counter(
            "transferd_connections_accepted", "Client connections accepted.", registry=r
        )
        self.buffer_bytes = Gauge(
            "transferd_buffer_allocated_bytes",
            "Bytes of buffers allocated to clients, by device.",
            ["device"],
            registry=r,
        )
        self.buffer_limit = Gauge(
            "transferd_buffer_limit_bytes",
            "Bytes of buffers the daemon may allocate to clients, by device.",
            ["device"],
            registry=r,
        )
        self.request_seconds = _RequestSeconds()
        r.register(self.request_seconds)
        self.transfer_bytes = Counter(
            "transferd_engine_bytes",
            "Bytes moved by the transfer engine, by direction.",
            ["direction"],
            registry=r,
        )
        self.transfers = Counter(
            "transferd_engine_transfers",
            "Engine transfers finished, by outcome.",
            ["outcome"],
            registry=r,
        )
        # Children are looked up once: .labels() takes a lock and a dict hit
        # per call, which the per-request path should not pay.
        self._cmd = {c: self.commands.labels(c.name) for c in Command}
        self._bytes_in = {c: self.command_bytes.labels(c.name, "in") for c in Command}
        self._bytes_out = {c: self.command_bytes.labels(c.name, "out") for c in Command}
        # Per command: [commands, bytes in, bytes out], tallied and folded in.
        self._tally = {c: [0, 0, 0] for c in Command}
        self._folded = {c: [0, 0, 0] for c in Command}
        self._sync_lock = threading.Lock()
        self._errors = {e: self.errors.labels(e.value) for e in ErrorCode}
        for e in ErrorCode:
            self._errors[e].inc(0)

    def command(self, cmd: Command, nbytes_in: int) -> None:
        t = self._tally[cmd]
        t[0] += 1
        t[1] += nbytes_in

    def reply(self, cmd: Command, nbytes_out: int, seconds: float) -> None:
        self._tally[cmd][2] += nbytes_out
        rs = self.request_seconds
        rs.counts[cmd][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        rs.sums[cmd] += seconds

    def sync(self) -> None:
        """Fold the per-request tallies into the Prometheus counters."""
        with self._sync_lock:
            for c, tally in self._tally.items():
                now = list(tally)
                done = self._folded[c]
                if now == done:
                    continue
                for child, n, d in zip(
                    (self._cmd[c], self._bytes_in[c], self._bytes_out[c]), now, done, strict=True
                ):
                    if n != d:
                        child.inc(n - d)
                self._folded[c] = now

    def error(self, code: ErrorCode) -> None:
        self._errors[code].inc()

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the bound port (0 picks one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_address[1])
