"""The daemon's discovery: its directory, the backend, this node's record, metrics.

Made by the daemon before its front ends start (so their sessions find the
directory), started once the engine and the listeners are up (the record
names their addresses), closed first at a stop (the record and names leave
the cluster at once, not a TTL later).  A missing etcd at start is not an
error: the daemon serves and keeps trying; a missing ``etcd`` extra, an
unreadable password file or a bad TLS file is (the key is named).
"""

from __future__ import annotations

import base64
import logging
import socket
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from transferd.config_discovery import DiscoveryConfig, parse_endpoints
from transferd.config_sections import ConfigError
from transferd.protocol.constants import PROTO_MAJOR, PROTO_PATCH
from transferd.protocol.values import NetAddr

from .backend import Backend, Embedded, State
from .directory import Directory
from .names import MAX_NAME, Limits, check_name, check_text

if TYPE_CHECKING:
    from transferd.metrics import Metrics

log = logging.getLogger("transferd.discovery")


def limits_of(cfg: DiscoveryConfig) -> Limits:
    return Limits(max_names=cfg.max_names, max_names_per_owner=cfg.max_names_per_owner,
                  max_value_bytes=cfg.max_value_bytes, max_cluster_names=cfg.max_cluster_names,
                  max_nodes=cfg.max_nodes, max_watches=cfg.max_watches,
                  max_watches_per_connection=cfg.max_watches_per_connection)


def make_backend(cfg: DiscoveryConfig) -> Backend:
    """The backend ``discovery.url`` names; ConfigError (naming the key) when it cannot be."""
    if not cfg.url:
        return Embedded()
    try:
        import h11  # noqa: F401 - the etcd extra
    except ImportError:
        raise ConfigError("discovery.url: etcd needs the 'etcd' extra (pip install "
                          "'transferd[etcd]', which brings h11)") from None
    from .etcd import EtcdBackend, ssl_context
    from .etcd_client import EtcdClient

    try:
        endpoints = parse_endpoints(cfg.url)
    except ValueError as exc:
        raise ConfigError(f"discovery.url: {exc}") from None
    password = ""
    if cfg.password_file:
        try:
            with open(cfg.password_file, "rb") as f:
                password = f.read(4096).strip().decode()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"discovery.password_file: {cfg.password_file}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None
    try:
        ctx = ssl_context(cfg.tls, cfg.ca_file, cfg.cert_file, cfg.key_file)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise ConfigError(f"discovery.ca_file / cert_file / key_file: {exc}") from None
    client = EtcdClient(endpoints, ssl_context=ctx, user=cfg.user, password=password,
                        timeout=cfg.timeout_s)
    return EtcdBackend(client, prefix=cfg.prefix, ttl_s=cfg.ttl_s, timeout_s=cfg.timeout_s,
                       retry_max_s=cfg.retry_max_s, url=cfg.url)


def default_node_name(urls: Sequence[str], node: int) -> str:
    host = socket.gethostname() or "localhost"
    for url in urls:
        u = urlsplit(url)
        if u.scheme in ("tcp", "tls") and u.port:
            return f"{host}:{u.port}"
    return f"{host}/{node:016x}"


class Discovery:
    def __init__(self, cfg: DiscoveryConfig, metrics: Metrics | None = None) -> None:
        self.config = cfg
        self.backend = make_backend(cfg)
        self.directory = Directory(cfg.node_name, limits_of(cfg), backend=self.backend)
        self.default_owner = cfg.default_owner
        self.started = False
        if metrics is not None:
            metrics.registry.register(_Collector(self))

    async def start(self, *, urls: Sequence[str], server: str, minor: int,
                    features: Sequence[str], addr: NetAddr | None = None,
                    capabilities: dict[str, Any] | None = None) -> None:
        d = self.directory
        node = addr.node if addr is not None else 0
        d.node_name = self.config.node_name or default_node_name(urls, node)
        d.record = {
            "v": 1, "name": d.node_name, "node": f"{node:016x}" if node else "",
            "addr": base64.b64encode(addr.to_bytes()).decode() if addr is not None else "",
            "version": [PROTO_MAJOR, minor, PROTO_PATCH], "server": server,
            "rails": [r.decode(errors="replace") for r in addr.rails] if addr else [],
            "capabilities": {"features": list(features), **(capabilities or {})},
            "urls": list(urls), "started": int(time.time()),
        }
        await self.backend.start()
        self.started = True
        where = "this daemon alone (discovery.url empty)" if isinstance(self.backend, Embedded) \
            else self.config.url
        log.info("discovery: node %r, names in %s", d.node_name, where)

    async def close(self) -> None:
        if self.backend.state is not State.CLOSED:
            await self.backend.close()
        self.directory.close()

    def status(self) -> dict[str, Any]:
        d = self.directory
        out = self.backend.status()
        out.update(node_name=d.node_name, names=len(d.local), mirrored=len(d.remote),
                   peers=len(d.peers()), watches=d.watches, ignored=d.ignored)
        return out

    @property
    def up(self) -> bool:
        return self.backend.state in (State.UP, State.EMBEDDED)


def record_to_wire(rec: dict[str, Any]) -> dict[str, Any] | None:
    """A node record as PEERS carries it (msgpack: addr bin, node int); None if malformed.

    A record is data from whoever can write to etcd: its lists are cut to their bounds,
    but a string that is too long or holds a control, format or separator character (as
    a name may not) makes the whole record malformed, since a cut or cleaned URL or
    rail would be another address than the one written."""
    try:
        addr = base64.b64decode(rec.get("addr") or "")
        if addr:
            NetAddr.from_bytes(addr)  # checked: a record is data, never trusted code
        version = [int(v) for v in rec.get("version") or (0, 0, 0)][:3]
        node = rec.get("node") or "0"
        return {
            "name": check_name(rec.get("name", "")), "node": int(str(node), 16) if node else 0,
            "addr": addr or None, "version": version,
            "server": check_text(rec.get("server", ""), "server", 128),
            "rails": [check_text(r, "rail") for r in (rec.get("rails") or ())[:16]],
            "capabilities": _plain(rec.get("capabilities") or {}),
            "urls": [check_text(u, "url", 512) for u in (rec.get("urls") or ())[:16]],
            "local": bool(rec.get("local", False)),
        }
    except Exception:
        return None


def _plain(v: Any, depth: int = 0) -> Any:
    """A JSON value kept small and msgpack-able (records come from other daemons); a
    string with a refused character raises (the record is malformed)."""
    if depth > 4:
        return None
    if isinstance(v, dict):
        return {check_text(str(k)[:64], "capability"): _plain(x, depth + 1)
                for k, x in list(v.items())[:32]}
    if isinstance(v, list):
        return [_plain(x, depth + 1) for x in v[:64]]
    if isinstance(v, str):
        return check_text(v[:MAX_NAME], "capability")
    if isinstance(v, bool | int | float) or v is None:
        return v
    return check_text(str(v)[:MAX_NAME], "capability")


class _Collector:
    """The discovery metrics, read when scraped."""

    def __init__(self, discovery: Discovery) -> None:
        self.discovery = discovery

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        disc = self.discovery
        d = disc.directory
        b = disc.backend
        up = GaugeMetricFamily("transferd_discovery_up", "1 while the discovery store "
                               "(etcd) is reachable and this node registered; the embedded "
                               "default is always 1.", labels=["backend"])
        up.add_metric([b.kind], 1.0 if disc.up else 0.0)
        yield up
        names = GaugeMetricFamily("transferd_discovery_names", "Names known, by where they "
                                  "were published (local: through this daemon).",
                                  labels=["where"])
        names.add_metric(["local"], len(d.local))
        names.add_metric(["cluster"], len(d.remote))
        yield names
        yield GaugeMetricFamily("transferd_discovery_peers", "Node records known, this "
                                "daemon's included.", value=len(d.peers()))
        yield GaugeMetricFamily("transferd_discovery_watches", "WATCH subscriptions open.",
                                value=d.watches)
        counts = getattr(b, "counts", {})
        for name, doc in (("failures", "Sessions with the discovery store that failed "
                           "(unreachable, lost, an error)."),
                          ("sessions", "Sessions with the discovery store that registered."),
                          ("conflicts", "Publishes refused because the name is another "
                           "node's in the store.")):
            yield CounterMetricFamily(f"transferd_discovery_{name}", doc,
                                      value=counts.get(name, 0))
        yield CounterMetricFamily("transferd_discovery_ignored", "Records from the store "
                                  "not mirrored: malformed, or over a bound.", value=d.ignored)
