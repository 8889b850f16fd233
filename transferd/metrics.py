"""Prometheus metrics, named by prometheus_client conventions.

Each daemon owns a private registry (tests run several daemons, and a global
registry would mix them).  Label values come from small fixed sets: command
names from PROTOCOL.md's table, error codes, and ``in``/``out``.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from transferd.protocol.constants import Command, ErrorCode

if TYPE_CHECKING:
    from transferd.engine import TransferEngine

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
            if not self.counts[c][-1] and not any(self.counts[c]):
                # Only commands that replied at least once: an idle daemon's page
                # stays small, and commands that never reply (NO_REPLY) add nothing.
                continue
            total = 0
            buckets = []
            for le, n in zip(self._les, list(self.counts[c]), strict=True):
                total += n
                buckets.append((le, total))
            fam.add_metric([c.name], buckets, self.sums[c])
        yield fam


class _AuthFailures:
    """``transferd_auth_failures_total``: failed handshakes by plane and reason
    (transferd/authlog.py), every pair exported from the start at 0."""

    name = "transferd_auth_failures"
    doc = "Failed handshakes, by plane (client, peer) and reason."

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.doc, labels=["plane", "reason"])]

    def collect(self) -> Iterator[Metric]:
        from transferd import authlog

        fam = CounterMetricFamily(self.name, self.doc, labels=["plane", "reason"])
        for plane, reason, n in authlog.FAILURES.counts():
            fam.add_metric([plane, reason], n)
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
        self.started = time.monotonic()
        self.registry = CollectorRegistry(auto_describe=True)
        self.http: Any = None  # the endpoint's server (serve())
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
            "Bytes charged for buffers whose memory is held now (whole pages plus a page of "
            "bookkeeping each), by device.",
            ["device"],
            registry=r,
        )
        self.buffer_lingering = Gauge(
            "transferd_buffer_lingering_bytes",
            "Of those, bytes of buffers already freed whose memory is still held (a reply "
            "being sent from it, a write landing in it), by device.",
            ["device"],
            registry=r,
        )
        self.buffer_limit = Gauge(
            "transferd_buffer_limit_bytes",
            "Bytes of buffers the daemon may allocate to clients, by device.",
            ["device"],
            registry=r,
        )
        self.leases = Gauge(
            "transferd_leases", "Named leases (LEASE) held now: owners of buffers that outlive "
            "their connection while renewed.", registry=r
        )
        self.leases_expired = Counter(
            "transferd_leases_expired", "Leases that expired unrenewed (their buffers were "
            "freed).", registry=r
        )
        self.reload_ok = Gauge(
            "transferd_config_last_reload_successful",
            "1 when the last SIGHUP's configuration was applied (or at start), 0 when it "
            "was refused.", registry=r)
        self.reload_ok.set(1)
        self.reload_time = Gauge(
            "transferd_config_last_reload_success_timestamp_seconds",
            "Unix time of the last configuration applied: the start, or a SIGHUP.",
            registry=r)
        self.reload_time.set_to_current_time()
        self.request_seconds = _RequestSeconds()
        r.register(self.request_seconds)
        r.register(_AuthFailures())
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
        # A command's series appear once it was received (an idle daemon's page
        # stays small); the request path only adds to tallies, folded in by sync().
        self._children: dict[Command, tuple[Any, Any, Any]] = {}
        # Per command: [commands, bytes in, bytes out], tallied and folded in.
        self._tally = {c: [0, 0, 0] for c in Command}
        self._folded = {c: [0, 0, 0] for c in Command}
        # The engine's transfers ended [ok, error] and bytes written out: tallied by the
        # engine as each ends (a labelled child's inc() takes a lock), folded in by sync().
        self.engine_tally = [0, 0, 0]
        self._engine_folded = [0, 0, 0]
        self._engine_children = (self.transfers.labels("ok"), self.transfers.labels("error"),
                                 self.transfer_bytes.labels("out"))
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
                children = self._children.get(c)
                if children is None:
                    children = self._children[c] = (
                        self.commands.labels(c.name),
                        self.command_bytes.labels(c.name, "in"),
                        self.command_bytes.labels(c.name, "out"),
                    )
                for child, n, d in zip(children, now, done, strict=True):
                    if n != d:
                        child.inc(n - d)
                self._folded[c] = now
            now = list(self.engine_tally)
            for child, n, d in zip(self._engine_children, now, self._engine_folded,
                                   strict=True):
                if n != d:
                    child.inc(n - d)
            self._engine_folded = now

    def error(self, code: ErrorCode) -> None:
        self._errors[code].inc()

    def summary(self) -> dict[str, Any]:
        """What STATS ``{"summary": true}`` adds (``transferd stats``): the uptime, the
        connections, errors by code, failed handshakes, the engine's transfers.  Read
        from the registry itself, so it says what a scrape would."""
        values: dict[tuple[str, tuple[str, ...]], float] = {}
        for fam in self.registry.collect():
            for sample in fam.samples:
                values[(sample.name, tuple(sample.labels.values()))] = sample.value

        def one(name: str, *labels: str) -> int:
            return int(values.get((name, labels), 0))

        out: dict[str, Any] = {
            "uptime_s": round(time.monotonic() - self.started, 3),
            "connections": {"open": one("transferd_open_connections"),
                            "accepted": one("transferd_connections_accepted_total")},
            "errors": {e.value: one("transferd_errors_total", e.value) for e in ErrorCode},
            "auth_failures": {f"{k[1][0]} {k[1][1]}": int(v) for k, v in values.items()
                              if k[0] == "transferd_auth_failures_total" and v},
        }
        if ("transferd_engine_landed_bytes_total", ()) in values:
            out["engine"] = {
                "bytes_out": one("transferd_engine_bytes_total", "out"),
                "bytes_landed": one("transferd_engine_landed_bytes_total"),
                "transfers_ok": one("transferd_engine_transfers_total", "ok"),
                "transfers_error": one("transferd_engine_transfers_total", "error"),
                "in_flight": one("transferd_engine_transfers_in_flight"),
                "refused_writes": sum(int(v) for k, v in values.items()
                                      if k[0] == "transferd_engine_refused_writes_total"),
            }
        return out

    def watch_engine(self, engine: TransferEngine) -> None:
        """Export the engine's state when scraped (both the initiator and the receiver)."""
        self.registry.register(_EngineCollector(engine))

    def serve(self, host: str, port: int, timeout_s: float = 10.0,
              max_connections: int = 64) -> int:
        """Expose /metrics over HTTP (transferd/metrics_http.py); the bound port (0 picks)."""
        from transferd.metrics_http import MetricsServer

        self.http = MetricsServer(self.registry, host, port, timeout_s, max_connections)
        return self.http.port

    def close(self) -> None:
        if self.http is not None:
            self.http.close()


# Refusal reasons are wire codes; anything else is "other", so the label set stays fixed.
REFUSE_REASONS = ("NOT_FOUND", "OUT_OF_BOUNDS", "BAD_REQUEST", "OUT_OF_MEMORY", "other")
LINK_STATES = ("connecting", "ready", "paused", "closed")
QUEUES = ("link_waiting", "recv_backlog", "recv_posted", "worker_slots")


def _by_reason(family: Any, tallies: list[dict[str, int]]) -> Any:
    """``family`` with one sample per refusal reason (REFUSE_REASONS, the rest "other"),
    summed over every group's tally."""
    counts = dict.fromkeys(REFUSE_REASONS, 0)
    for tally in tallies:
        for code, n in tally.items():
            counts[code if code in counts else "other"] += n
    for reason, n in counts.items():
        family.add_metric([reason], n)
    return family


def _snapshot(fn: Any, default: Any) -> Any:
    """Read state another thread is changing; a dict resized mid-read is read again."""
    for _ in range(3):
        try:
            return fn()
        except RuntimeError:  # "changed size during iteration"
            continue
    return default


class _EngineCollector:
    """``transferd_engine_*`` series read from the engine when scraped.

    Receiver side: writes and bytes landed, writes refused by reason, immediates
    counted, expectations pending, messages delivered.  Both sides: transfers in
    flight, links by rail and state, queue depths.  Labels: rail index (at most 4),
    state, reason and queue, each from the fixed sets above.
    """

    def __init__(self, engine: TransferEngine) -> None:
        # Read by name, typed: a renamed attribute fails mypy and the metrics tests, never
        # reads as a silent 0.
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        if e.group is None:  # not started yet
            return
        # Every host group's tallies together (engine.host_groups), each read by the
        # group's own stats() (a dict another thread resizes is read again).
        groups = list(e.groups)
        stats = [_snapshot(gr.stats, None) for gr in groups]
        stats = [st for st in stats if st is not None]

        def total(name: str) -> int:
            return sum(getattr(st, name) for st in stats)

        c = CounterMetricFamily
        g = GaugeMetricFamily
        yield c("transferd_engine_landed_writes", "Peer WRITE parts whose bytes landed here.",
                value=total("writes_in"))
        yield c("transferd_engine_landed_bytes", "Bytes peers wrote into this daemon's regions.",
                value=total("bytes_in"))
        yield _by_reason(c("transferd_engine_refused_writes",
                           "Peer WRITE parts this daemon refused, by reason (the wire code).",
                           labels=["reason"]), [st.refused_by for st in stats])
        yield c("transferd_engine_served_reads",
                "Peer READ parts this daemon answered from its regions.",
                value=total("reads_out"))
        yield c("transferd_engine_served_read_bytes",
                "Bytes peers read from this daemon's regions.", value=total("read_bytes_out"))
        yield _by_reason(c("transferd_engine_refused_reads",
                           "Peer READ parts this daemon refused, by reason (the wire code).",
                           labels=["reason"]), [st.reads_refused_by for st in stats])
        integrity = c("transferd_engine_integrity_failures",
                      "Peer WRITE parts whose CRC32C did not match the bytes placed here "
                      "(refused, not counted; the sender re-sends once), by peer node and "
                      "rail.", labels=["peer", "rail"])
        failures: dict[tuple[int, int], int] = {}
        for st in stats:
            for key, n in st.integrity_failures.items():
                failures[key] = failures.get(key, 0) + n
        # Every rail from the start at 0 with no peer (an empty label is none to
        # Prometheus), so rate() works before the first mismatch; a peer's series
        # appears with its first.
        for rail in range(max((len(st.links) for st in stats), default=0)):
            integrity.add_metric(["", str(rail)], 0)
        for (node, rail), n in sorted(failures.items()):
            integrity.add_metric([f"{node:016x}", str(rail)], n)
        yield integrity
        yield c("transferd_engine_stalls",
                "Transfers and expectations logged for staying in one stage longer than "
                "engine.stall_warn_s (each once per stage).",
                value=e.inflight.stalls)
        yield c("transferd_engine_integrity_resends",
                "Write parts this daemon re-sent after a peer refused their checksum.",
                value=total("integrity_resends"))
        yield c("transferd_engine_immediates", "Immediates counted here (the sum of counts).",
                value=total("imms_in"))
        yield c("transferd_engine_messages_delivered",
                "Peer messages (two-sided SEND) handed to a posted receive here (and out "
                "of this daemon: acknowledged).",
                value=total("messages_in"))
        yield g("transferd_engine_expectations_pending",
                "Immediate-count expectations clients wait on here.",
                value=_snapshot(e.expectations_pending, 0))
        in_flight = e.slots.in_flight
        yield g("transferd_engine_transfers_in_flight",
                "Transfers this daemon initiated that have not finished.", value=in_flight)
        peer_slots = e.peer_slots
        yield g("transferd_engine_transfers_waiting",
                "Transfers waiting for a slot of a busy peer (engine.max_inflight_per_peer).",
                value=peer_slots.waiting if peer_slots is not None else 0)
        yield g("transferd_engine_partial_writes",
                "Multi-part writes to this daemon some of whose parts landed.",
                value=total("partial_writes"))
        yield c("transferd_engine_failovers",
                "Write parts re-sent on another rail after theirs failed (rail failover).",
                value=total("failovers"))
        yield c("transferd_engine_duplicate_parts",
                "Peer write parts that had landed already (a re-send): acknowledged, "
                "not applied or counted again.",
                value=total("duplicate_parts"))
        yield g("transferd_engine_peers_known",
                "Peer domain groups bound to the rail addresses they proved, every host "
                "group together (engine.max_peers each; this daemon counts once per group).",
                value=total("peers_known"))
        yield g("transferd_engine_link_budget",
                "Peer links (descriptors) this daemon may hold (engine.max_links, "
                "RLIMIT_NOFILE less engine.fd_reserve), every group together.",
                value=groups[0].link_budget.limit)
        links = g("transferd_engine_links", "Links to peers, by rail and state.",
                  labels=["rail", "state"])
        waiting = 0
        by_rail: dict[int, dict[str, int]] = {}
        inbound_by_rail: dict[int, int] = {}
        for st in stats:
            for rail, ls in enumerate(st.links):
                states = by_rail.setdefault(rail, dict.fromkeys(LINK_STATES, 0))
                for state, n in ls.states.items():
                    states[state if state in states else "closed"] += n
                waiting += ls.waiting
                inbound_by_rail[rail] = inbound_by_rail.get(rail, 0) + ls.inbound
        for rail, states in by_rail.items():
            for state, n in states.items():
                links.add_metric([str(rail), state], n)
        yield links
        inbound = g("transferd_engine_inbound_links", "Peers' links to this daemon, by rail.",
                    labels=["rail"])
        for rail, n in inbound_by_rail.items():
            inbound.add_metric([str(rail)], n)
        yield inbound
        depth = g("transferd_engine_queue_depth",
                  "Items waiting in the engine's bounded queues, by queue.", labels=["queue"])
        depth.add_metric(["link_waiting"], waiting)
        recv = e.receives
        depth.add_metric(["recv_backlog"], recv.waiting)
        depth.add_metric(["recv_posted"], _snapshot(recv.free_receives, 0))
        depth.add_metric(["worker_slots"], in_flight)
        yield depth
        yield c("transferd_engine_write_id_duplicates",
                "Peer WRITE frames whose write id was applied here already (a retry): "
                "acknowledged, neither placed nor counted again.",
                value=total("write_id_duplicates"))
        yield g("transferd_engine_messages_waiting_bytes",
                "Bytes of peer messages here waiting for a busy receive, or in a receiving "
                "connection's write buffer (charged to the host memory limit).",
                value=recv.waiting_bytes)
        yield c("transferd_engine_messages_expired",
                "Peer messages dropped after engine.recv_wait_s without a free receive "
                "(their senders' SEND failed with CANCELLED).",
                value=recv.expired)
