"""Prometheus metrics, named by prometheus_client conventions.

Each daemon owns a private registry (tests run several daemons, and a global
registry would mix them).  Label values come from small fixed sets: command
names from PROTOCOL.md's table, error codes, and ``in``/``out``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
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
        self.request_seconds = Histogram(
            "transferd_request_duration_seconds",
            "Time from a request's last byte to its reply, by command.",
            ["command"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
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
        self._seconds = {c: self.request_seconds.labels(c.name) for c in Command}
        self._errors = {e: self.errors.labels(e.value) for e in ErrorCode}
        for e in ErrorCode:
            self._errors[e].inc(0)

    def command(self, cmd: Command, nbytes_in: int) -> None:
        self._cmd[cmd].inc()
        self._bytes_in[cmd].inc(nbytes_in)

    def reply(self, cmd: Command, nbytes_out: int, seconds: float) -> None:
        self._bytes_out[cmd].inc(nbytes_out)
        self._seconds[cmd].observe(seconds)

    def error(self, code: ErrorCode) -> None:
        self._errors[code].inc()

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the bound port (0 picks one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_address[1])
