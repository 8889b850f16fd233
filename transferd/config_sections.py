"""The configuration schema's sections: every key, its default, its doc and its bounds.

A leaf of :mod:`transferd.config`, which assembles these sections into
:class:`~transferd.config.Config` and loads them (file, environment, flags); split
from it so the schema an operator reads is not buried in the loader.  Every name
here is also importable from :mod:`transferd.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transferd.protocol.constants import DEFAULT_MAX_BODY, DEFAULT_MAX_PAYLOAD, PROTO_MINOR

TOKEN_REFUSED = (
    "--token is refused: a secret on the command line is visible to every local user "
    "(ps, /proc/PID/cmdline). Put it in a file only the daemon's user can read and pass "
    "--token-file FILE (server.token_file), or set TRANSFERD_SERVER_TOKEN."
)

ENV_PREFIX = "TRANSFERD_"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


class ConfigError(ValueError):
    """One or more configuration keys or values are wrong; each message names its key.

    ``errors`` lists every problem found; ``str()`` is one per line.
    """

    def __init__(self, errors: str | list[str]) -> None:
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


def key(
    default: Any,
    doc: str,
    *,
    min: float | None = None,
    max: float | None = None,
    choices: tuple[str, ...] = (),
    flag: str = "",
    reload: bool = False,
    secret: bool = False,
    unit: str = "",
    off: str = "",
) -> Any:
    """Declare a config key.

    ``doc``: what it does, for operators (becomes the comment in the TOML file
    and the reference).  ``min``/``max``: inclusive bounds of a number;
    ``choices``: the allowed strings (matched case-insensitively, stored lower
    case).  ``flag``: the command-line flags that set it, as documented.
    ``reload``: SIGHUP applies a change without a restart.  ``secret``: masked
    by ``check-config --print``.  ``off``: for a port, the setting that turns its
    listener off (named when a negative port is given, as ``--metrics-port -1`` is).
    """
    meta = {
        "doc": " ".join(doc.split()),
        "min": min,
        "max": max,
        "choices": choices,
        "flag": flag,
        "reload": reload,
        "secret": secret,
        "unit": unit,
        "off": off,
    }
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ServerConfig:
    """The RPC server: where clients connect."""

    host: str = key(
        "127.0.0.1",
        'Address the RPC server listens on (TCP), an IP address or a name that resolves. '
        '"0.0.0.0" listens on every IPv4 address; anything but loopback should come with '
        "a token. Also the engine's single rail when engine.host_rails is empty.",
        flag="-H/--host",
    )
    port: int = key(
        18515,
        'TCP port of the RPC server; 0 lets the system pick a free one (printed at start: '
        '"transferd: listening on tcp://HOST:PORT"). A port given that is taken is an error '
        "naming it.",
        min=0, max=65535, flag="-p/--port",
    )
    tcp_listener: bool = key(
        True,
        "Listen on tcp://host:port. false leaves only the listeners of server.listen and "
        "server.unix_socket (a daemon reachable only through local sockets or TLS).",
    )
    listen: list[str] = key(  # noqa: RUF009 - key() is dataclasses.field()
        [],
        'More listeners, by URL: "tcp://HOST:PORT", "tls://HOST:PORT" (needs '
        'server.tls_cert and server.tls_key), "unix:///PATH" (stream), '
        '"seqpacket:///PATH" (AF_UNIX SOCK_SEQPACKET, a message transport), '
        '"rdma://HOST:PORT" (an RDMA RC queue pair set up over TCP at HOST:PORT, a message '
        "transport; needs an RDMA device, docs/rdma.md). Port 0 picks "
        'one; the daemon prints every URL it got ("transferd: listening on URL"). unix and '
        "seqpacket connections can carry file descriptors (shared-memory buffers).",
        flag="--listen (repeatable)",
    )
    unix_socket: str = key(
        "",
        'Also listen on this Unix stream socket path ("" = none). A stale socket file at '
        'the path is removed at start, and the file at stop; anything else there (a file, '
        'a link, a directory) is refused, never removed. Clients connect with '
        '"unix:///path". Two daemons must not share a path: give each its own.',
        flag="--unix",
    )
    token: str = key(
        "",
        'Shared secret clients must prove ("" = none; server.token_file wins): with '
        "hmac-sha256 (the secret never crosses the wire) or, on server.token_transports, as "
        "a token in HELLO. Wrong or missing: UNAUTHORIZED and a close, logged with the "
        "source and slowed down per source. Set it with TRANSFERD_SERVER_TOKEN or "
        "server.token_file, never on the command line (--token is refused).",
        reload=True, secret=True,
    )
    token_file: str = key(
        "",
        "File holding the shared secret clients prove (its contents, outer whitespace "
        "removed); wins over server.token. Refused when another user could read or "
        "rewrite it (chmod 600, owned by the daemon's user or root; "
        "server.insecure_secret_files). SIGHUP re-reads it: the next handshakes use the "
        "new contents, open connections stay.",
        flag="--token-file", reload=True,
    )
    previous_token_file: str = key(
        "",
        "During a rotation of the client secret: a file holding the secret clients "
        "proved before. Clients proving either are accepted, and the daemon proves both "
        "in its HELLO reply, so clients that have the new secret and clients that still "
        "have the old one connect while they are updated; then empty the file (or the "
        "key) and reload again (docs/security.md, Rotating a secret). An empty file: no "
        "rotation in progress. Same rules as server.token_file otherwise.",
        reload=True,
    )
    insecure_secret_files: bool = key(
        False,
        "Accept secret files (server.token_file, server.previous_token_file, "
        "engine.secret_file, engine.previous_secret_file) that another user could read "
        "or rewrite. Without it such a file stops the start, check-config, doctor and a "
        "reload, as ssh refuses an exposed private key.",
        reload=True,
    )
    token_transports: list[str] = key(  # noqa: RUF009 - key() is dataclasses.field()
        ["unix", "seqpacket", "tls"],
        "Listener schemes on which the token method is offered besides hmac-sha256 (the "
        "token crosses the wire, so by default only local sockets and TLS). hmac-sha256 is "
        "offered everywhere a secret is set.",
    )
    handshake_timeout_s: float = key(
        5.0,
        "Seconds a connection has to finish HELLO (and AUTH) before it is closed.",
        min=0.01, max=600,
    )
    max_handshakes: int = key(
        1024,
        "Connections that have not finished their handshake, in all. One more is not "
        "refused: the oldest of the source holding the most gives way to it.",
        min=1,
    )
    max_handshakes_per_source: int = key(
        128,
        "Connections from one source (an IP address; on a Unix socket the peer's uid) that "
        "have not finished their handshake. One more is not refused: that source's oldest "
        "gives way to it.",
        min=1,
    )
    protocol_minor: int = key(
        PROTO_MINOR,
        "Protocol minor this server acts as: 2 (current) or 1. As minor 1 it reports minor 1 "
        "in HELLO and answers minor-2 commands (GET_TENSORS, SET_TENSORS, the engine "
        "commands) with UNKNOWN_COMMAND: for compatibility tests and A/B runs.",
        min=1, max=2, flag="--protocol-minor",
    )
    max_body: int = key(
        DEFAULT_MAX_BODY,
        "Largest frame body (the msgpack map) accepted, in bytes; announced in HELLO. A "
        "larger header gets TOO_LARGE and a close. The default (4 MiB) holds a batch of "
        "well over 100,000 tensors.",
        min=1024, unit="bytes",
    )
    max_payload: int = key(
        DEFAULT_MAX_PAYLOAD,
        "Largest frame payload (raw tensor bytes) accepted, in bytes; announced in HELLO. "
        "Clients split batches to stay under it. Default 16 GiB.",
        min=1, unit="bytes",
    )
    max_tensors: int = key(
        65536,
        "Most tensors in one GET_TENSORS or SET_TENSORS batch; announced in HELLO as "
        "max_tensors. A larger batch gets TOO_LARGE (the connection goes on) before any "
        "tensor is looked up; clients split their batches to stay under it. It bounds the "
        "work of one frame on the daemon's loop and what a reply holds while unread.",
        min=1, max=1 << 24,
    )
    max_reply: int = key(
        DEFAULT_MAX_PAYLOAD,
        "Most payload bytes of one reply (GET_TENSOR, GET_TENSORS); announced in HELLO as "
        "max_reply. A larger request gets TOO_LARGE (the connection goes on); clients split "
        "their batches to stay under it. Default 16 GiB.",
        min=1, unit="bytes",
    )
    max_message: int = key(
        256 * 1024,
        "Message transports (seqpacket): the size of every payload continuation message, "
        "announced in HELLO as max_message.",
        min=65536, max=1 << 20, unit="bytes",
    )
    drain_s: float = key(
        20.0,
        "SIGTERM/SIGINT: seconds to drain before exiting. The daemon stops accepting at "
        "once and refuses new requests on open connections (CANCELLED); requests and engine "
        "transfers already running finish for up to this long; what is still running then "
        "fails with TIMEOUT (outcome unknown: the peer may have placed it), connections are "
        "closed and the daemon exits 0. A second signal ends the drain early. Keep systemd's "
        "TimeoutStopSec at least 10 s above it (deploy/transferd.service: 30 s for 20 s).",
        min=0, max=3600, reload=True,
    )
    tls_cert: str = key(
        "",
        'PEM certificate chain for tls:// listeners ("" = none; a tls:// listener without '
        "it is a configuration error).",
    )
    tls_key: str = key("", "PEM private key for tls:// listeners (keep it readable by the "
                       "daemon only).")


@dataclass
class MemoryConfig:
    """Buffers: memory the daemon hands out to clients, each device under its own limit."""

    host_limit_mib: int = key(
        4096,
        "Host memory the daemon may hand out as buffers, all buffers together, in MiB. "
        "ALLOC_BUFFER past it gets OUT_OF_MEMORY; GET_DEVICES reports it as total. Buffers "
        "are backed lazily, so this is what the daemon promises; it must not exceed the "
        "machine's memory.",
        min=1, flag="-m/--mem", reload=True, unit="MiB",
    )
    max_buffer_mib: int = key(
        0,
        "Largest single buffer, in MiB; 0 = no cap but host_limit_mib, which it must not "
        "exceed. GET_DEVICES reports it as max_size.",
        min=0, reload=True, unit="MiB",
    )
    shm_limit_mib: int = key(
        1024,
        'Shared memory (device "shm": a memfd the daemon maps and passes to a client on the '
        "Unix socket, which maps the same pages) the daemon may hand out, all shared buffers "
        "together, in MiB; 0 serves no shm device. Counted apart from host_limit_mib.",
        min=0, reload=True, unit="MiB",
    )
    max_buffers: int = key(
        32768,
        "Most buffers held at once, all devices together (a freed buffer still counts while "
        "a reply or a write holds it). Each is a mapping of its own: the kernel allows a "
        "process vm.max_map_count of them (65530 by default), and the interpreter needs "
        "some too. ALLOC_BUFFER past it gets OUT_OF_MEMORY.",
        min=1, max=1 << 20,
    )
    default_owner: str = key(
        "daemon",
        "Who owns a buffer whose ALLOC_BUFFER names no owner: \"daemon\" (it stays until "
        "FREE_BUFFER, what every client that knows nothing of owners expects) or "
        "\"connection\" (freed, its regions deregistered, when the allocating connection "
        "closes: no buffer outlives a client that crashed). Shared-memory buffers are the "
        "connection's either way. A client may always say owner or lease itself.",
        choices=("daemon", "connection"),
    )
    max_leases: int = key(
        1024,
        "Most named leases (LEASE) the daemon holds at once; one more is refused with "
        "TOO_LARGE.",
        min=1, max=1 << 20,
    )
    max_leases_per_connection: int = key(
        64,
        "Most leases one open client connection may hold (made or joined); one more is "
        "refused with TOO_LARGE. Leases outlive their connection, which then no longer "
        "counts them (memory.max_leases_per_source still does).",
        min=1, max=1 << 20,
    )
    max_leases_per_source: int = key(
        256,
        "Most live leases made from one source (a client's IP address; every Unix-socket "
        "client is one source), counted until each ends or expires, so a client that "
        "reconnects cannot take every one of memory.max_leases; one more is refused "
        "with TOO_LARGE.",
        min=1, max=1 << 20,
    )
    max_lease_ttl_s: float = key(
        3600.0,
        "Longest ttl a LEASE may ask for, in seconds: a lease nobody renews frees its "
        "buffers within this long.",
        min=0.001, unit="s",
    )


@dataclass
class GpuConfig:
    """CUDA devices (needs CuPy): one domain group per GPU, its worker on the GPU's NUMA node."""

    devices: list[str] = key(  # noqa: RUF009 - key() is dataclasses.field()
        [],
        'CUDA devices to serve buffers from, besides host memory: "cuda:N" each, as '
        'GET_DEVICES and ALLOC_BUFFER name them (rpc-server -d cuda:0 or -d cuda:0,cuda:1; '
        "one rpc-server per GPU is the llama.cpp way). Each gets its own group: a worker "
        "pinned to a core of the GPU's NUMA node with the GPU's context current, a CUDA "
        "stream, and its pinned staging. A device CuPy does not find stops the start.",
        flag="-d/--device",
    )
    memory_limit_mib: int = key(
        0,
        "Device memory the daemon may hand out as buffers on each GPU, in MiB; 0 = 90% of "
        "what the device reports free at start. GET_DEVICES reports it as total.",
        min=0, unit="MiB",
    )
    staging_mib: int = key(
        32,
        "Pinned host staging per GPU, in MiB, allocated at start and reused: every byte "
        "between the wire and a device goes through it (a GET copies device to staging "
        "while the previous chunk is sent). When all of it is in use, work waits; it "
        "never grows.",
        min=1, max=65536, unit="MiB",
    )
    staging_chunk_kib: int = key(
        4096,
        "Size of one staging chunk, in KiB: the unit of one device copy in the pipeline. "
        "staging_mib holds staging_mib * 1024 / staging_chunk_kib chunks (at least one).",
        min=64, max=1048576, unit="KiB",
    )


@dataclass
class MetricsConfig:
    """The Prometheus endpoint, http://HOST:PORT/metrics."""

    enabled: bool = key(
        True, "Serve Prometheus metrics over HTTP.", flag="--metrics-port -1 turns it off"
    )
    host: str = key(
        "127.0.0.1",
        'Address of the metrics endpoint; "0.0.0.0" for a Prometheus on another host (the '
        "endpoint has no authentication: firewall it).",
    )
    port: int = key(
        0,
        "Port of the metrics endpoint. 0 (the default) lets the system pick a free one, "
        'printed at start ("transferd: metrics on http://HOST:PORT/metrics"), so that '
        "daemons started with different RPC ports never collide; a node's service sets a "
        "fixed port for Prometheus to scrape (18516 in deploy/ and config/examples/). A port "
        "given that is taken is an error naming metrics.port.",
        min=0, max=65535, flag="--metrics-port", off="metrics.enabled = false",
    )
    timeout_s: float = key(
        10.0,
        "Seconds a metrics connection may stay open in all, sending its request and "
        "reading the answer; then it is closed (a silent or slow client holds nothing "
        "longer).",
        min=0.1, max=600,
    )
    max_connections: int = key(
        64,
        "Metrics connections open at once. At the cap, a new one closes the oldest that "
        "has not sent a whole request yet (silent connections cannot lock a scrape out), "
        "or is closed itself.",
        min=1, max=65536,
    )


@dataclass
class LogConfig:
    """The daemon's log, on stderr (the journal under systemd)."""

    level: str = key(
        "info",
        "Log level: debug, info, warning or error (any case). docs/operations.md says what "
        "each level logs.",
        choices=LOG_LEVELS, flag="--log-level", reload=True,
    )
    format: str = key(
        "text",
        'Log line format: "text" (one readable line per record) or "json" (one JSON '
        "object per line, for log shippers).",
        choices=LOG_FORMATS, flag="--log-format",
    )
    otel: str = key(
        "auto",
        "OpenTelemetry spans per traced transfer (docs/integrity.md; needs the otel extra, "
        "pip install 'transferd[otel]'): \"console\" (one JSON object per span and line, to "
        "log.otel_file), \"otlp\" (the OTLP exporter package, set up by the standard "
        "OTEL_EXPORTER_OTLP_* variables), \"none\", or \"auto\": what OTEL_TRACES_EXPORTER "
        "says (console or otlp), none when it is unset or OTEL_SDK_DISABLED=true.",
        choices=("auto", "none", "console", "otlp"),
    )
    otel_file: str = key(
        "",
        "With log.otel = \"console\": the file spans are appended to (\"\": stderr, with "
        "the log).",
    )


def _listen_problems(s: ServerConfig) -> list[str]:
    from transferd import transports  # the registry knows every scheme

    out: list[str] = []
    for scheme in s.token_transports:
        if scheme not in transports.schemes():
            out.append(f"server.token_transports: {scheme!r} is not a transport "
                       f"({', '.join(transports.schemes())})")
    for url in s.listen:
        try:
            kind = transports.get(url)
            kind.parse(url)
        except Exception as exc:
            out.append(f"server.listen: {getattr(exc, 'message', exc)}")
            continue
        if kind.scheme == "tls" and not (s.tls_cert and s.tls_key):
            out.append(f"server.listen: {url} needs server.tls_cert and server.tls_key")
    from transferd.secret_files import read_secret

    # Readable and not empty (wherever it runs); who else can read it is the
    # preflight's to judge (transferd.secret_files.problems), on the machine itself.
    for key_name, path in (("server.token_file", s.token_file),
                           ("server.previous_token_file", s.previous_token_file)):
        if path:
            try:
                read_secret(path, key_name, insecure=True,
                            may_be_empty=key_name == "server.previous_token_file")
            except ConfigError as exc:
                out += exc.errors
    if not s.tcp_listener and not s.listen and not s.unix_socket:
        out.append("server.tcp_listener: false leaves nothing to listen on")
    return out
