"""The configuration schema's ``[discovery]`` section: where the cluster's names live.

Split from :mod:`transferd.config_sections` as ``[engine]`` is; every name here is
also importable from :mod:`transferd.config`.  docs/discovery.md is the guide.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from transferd.config_sections import key

SCHEMES = ("etcd", "etcds")


@dataclass
class DiscoveryConfig:
    """The cluster's directory: names (publish, lookup, watch) and the nodes alive."""

    url: str = key(
        "",
        'Where names and node records live. "" (the default): this daemon alone, in '
        "memory; publish, lookup and watch serve its own clients. "
        '"etcd://HOST:PORT[,HOST:PORT...]": etcd v3 (3.4 or later, over its JSON '
        'gateway); "etcds://..." or any of discovery.ca_file / cert_file set: over TLS. '
        "Credentials never go in the URL: discovery.user and discovery.password_file.",
    )
    prefix: str = key(
        "/transferd",
        "The etcd key prefix of this cluster: node records under PREFIX/nodes/, names "
        "under PREFIX/names/. Daemons with the same etcd and prefix see each other; "
        "another prefix is another cluster.",
    )
    node_name: str = key(
        "",
        "This daemon's name in peers() and in the node record; empty = HOSTNAME:PORT of "
        "the RPC server (HOSTNAME/NODE-ID without a TCP listener). Unique in the cluster: "
        "while a live daemon holds the name, another one configured with it stays "
        "unregistered (serving its own clients, saying why) until the name is free; a "
        "restart after a clean stop takes it back at once, after a crash within ttl_s. "
        "Without control, format or separator characters, as a published name.",
    )
    ttl_s: int = key(
        10,
        "TTL of this daemon's etcd lease, kept alive every ttl_s/3: a daemon that dies "
        "leaves peers() and its names leave lookup within this many seconds; etcd away "
        "for longer drops them too, until it is back and the daemon re-registers.",
        min=3, max=3600, unit="s",
    )
    timeout_s: float = key(
        2.0,
        "How long one etcd request may take (a publish waits at most this long for etcd "
        "to confirm, then answers synced=false and keeps the name queued). At most "
        "ttl_s/3.",
        min=0.05, max=60, unit="s",
    )
    retry_max_s: float = key(
        5.0,
        "The longest wait between two tries to reach etcd while it is away (the back-off "
        "starts at 0.1 s and doubles, with jitter).",
        min=0.1, max=300, unit="s",
    )
    user: str = key(
        "",
        "etcd user name (etcd auth); its password is read from discovery.password_file.",
    )
    password_file: str = key(
        "",
        "File holding the etcd user's password (whitespace stripped); never on the "
        "command line. Keep it readable by the daemon's user only.",
    )
    ca_file: str = key(
        "",
        "PEM CA bundle to verify etcd's server certificate (TLS); empty with etcds:// = "
        "the system's trust store.",
    )
    cert_file: str = key(
        "",
        "PEM client certificate for etcd (TLS client auth, etcd --client-cert-auth).",
    )
    key_file: str = key(
        "",
        "PEM private key of discovery.cert_file (readable by the daemon's user only).",
    )
    default_owner: str = key(
        "connection",
        'Owner of a name whose PUBLISH names none: "connection" (gone when the '
        'publishing connection closes) or "daemon" (until unpublished or the daemon '
        "stops). A publish may ask for either, or a lease.",
        choices=("connection", "daemon"),
    )
    max_names: int = key(
        16384,
        "Names published through this daemon, all owners together; one more is TOO_LARGE.",
        min=1, max=1 << 20,
    )
    max_names_per_owner: int = key(
        1024,
        "Names one owner (a connection, a lease, the daemon) may hold.",
        min=1, max=1 << 20,
    )
    max_value_bytes: int = key(
        4096,
        "Largest published value (an MrDesc of 4 rails is about 200 bytes); names are "
        "at most 256 bytes. Larger values from other daemons are not mirrored.",
        min=64, max=65536, unit="bytes",
    )
    max_cluster_names: int = key(
        65536,
        "Names of the whole cluster this daemon mirrors (etcd); past it, others' names "
        "are counted and not mirrored (transferd_discovery_ignored_total).",
        min=1, max=1 << 22,
    )
    max_nodes: int = key(
        1024,
        "Node records this daemon mirrors (peers()).",
        min=1, max=1 << 16,
    )
    max_watches: int = key(
        1024, "WATCH subscriptions open on this daemon, all connections together.",
        min=1, max=1 << 16,
    )
    max_watches_per_connection: int = key(
        64, "WATCH subscriptions one connection may hold.", min=1, max=1 << 16,
    )

    @property
    def etcd(self) -> bool:
        return bool(self.url)

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme == "etcds" or bool(self.ca_file or self.cert_file)


def parse_endpoints(url: str) -> list[tuple[str, int]]:
    """``etcd://h:p,h2:p2`` -> [(h, p), (h2, p2)]; ValueError naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"{url!r} is not etcd://HOST:PORT[,HOST:PORT...] (or etcds://)")
    rest = rest.rstrip("/")
    if "@" in rest:
        raise ValueError("credentials do not go in the URL: use discovery.user and "
                         "discovery.password_file")
    out = []
    for part in rest.split(","):
        part = part.strip()
        if part.startswith("["):
            host, _, port = part[1:].partition("]:")
        else:
            host, _, port = part.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"{part!r} is not HOST:PORT (a port 1-65535)")
        out.append((host, int(port)))
    return out


def discovery_problems(d: DiscoveryConfig) -> list[str]:
    out = []
    if d.url:
        try:
            parse_endpoints(d.url)
        except ValueError as exc:
            out.append(f"discovery.url: {exc}")
    if d.timeout_s > d.ttl_s / 3:
        out.append(f"discovery.timeout_s: {d.timeout_s:g} s is over discovery.ttl_s / 3 "
                   f"({d.ttl_s / 3:g} s): a keepalive must fit between two")
    if d.key_file and not d.cert_file:
        out.append("discovery.key_file: set discovery.cert_file too (its certificate)")
    if d.password_file and not d.user:
        out.append("discovery.password_file: set discovery.user too")
    if not d.prefix.startswith("/") or len(d.prefix.encode()) > 128:
        out.append(f"discovery.prefix: {d.prefix!r} must start with / (at most 128 bytes)")
    if len(d.node_name.encode()) > 128 or "/" in d.node_name:
        out.append("discovery.node_name: at most 128 bytes, no '/'")
    else:
        from transferd.discovery.names import check_text
        from transferd.protocol.errors import BadRequest

        try:
            check_text(d.node_name, "discovery.node_name")
        except BadRequest as e:
            out.append(f"discovery.node_name: {e}")
    return out
