"""Daemon configuration: the schema, and how it is loaded.

Later sources win: embedded defaults < a TOML file < ``TRANSFERD_<SECTION>_<KEY>``
variables < command-line flags.  The schema is the dataclasses below: every key
is declared with :func:`key`, which carries its doc string and its bounds, and
is typed by its default.  ``config/transferd.toml`` and the key reference in
``docs/configuration.md`` are generated from it (``python -m
transferd.config_docs --write``; a test fails when they drift).

Adding a key: one ``key(...)`` line in its section's dataclass, with a doc
string written for operators, then run the generator.  Checks that span
several keys go in :meth:`Config.problems`.

A key nobody knows, a value of the wrong type, out of range, or not finite is a
:class:`ConfigError`; every problem is collected and reported at once, each
naming its key, before anything starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transferd.memory.buffers import DeviceSpec
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
) -> Any:
    """Declare a config key.

    ``doc``: what it does, for operators (becomes the comment in the TOML file
    and the reference).  ``min``/``max``: inclusive bounds of a number;
    ``choices``: the allowed strings (matched case-insensitively, stored lower
    case).  ``flag``: the command-line flags that set it, as documented.
    ``reload``: SIGHUP applies a change without a restart.  ``secret``: masked
    by ``check-config --print``.
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
        'the path is removed at start, and the file at stop. Clients connect with '
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
        "removed); wins over server.token. Keep it readable by the daemon's user only. "
        "SIGHUP re-reads it.",
        flag="--token-file", reload=True,
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
        "Connections that have not finished their handshake, in all; one more is closed at "
        "once.",
        min=1,
    )
    max_handshakes_per_source: int = key(
        128,
        "Connections from one source address (an IP; all Unix-socket clients are one "
        "source) that have not finished their handshake; one more is closed at once.",
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
        min=0, max=65535, flag="--metrics-port",
    )


@dataclass
class EngineConfig:
    """The transfer engine: the peer plane between daemons."""

    enabled: bool = key(
        True,
        "Run the transfer engine (registered regions, one-sided writes, immediate "
        "counters, the engine commands 0x20-0x3F). Off: those commands get "
        'UNKNOWN_COMMAND and HELLO\'s features lack "engine".',
    )
    host_rails: list[str] = key(  # noqa: RUF009 - key() is dataclasses.field()
        [],
        "One local address per rail (NIC) of the host domain group, 1 to 4 of them; empty "
        "= one rail on server.host. Each must be an address of this machine. Every peer "
        "must have the same rail count.",
    )
    peer_port: int = key(
        0,
        "Port of the peer plane (daemon-to-daemon links) on the first rail; 0 lets the "
        "system pick. The ports in use travel in the daemon's NetAddr (printed at start: "
        '"transferd: engine NODE rails HOST:PORT ..."), so peers need not be told. Fix it '
        "when a firewall must be opened for it.",
        min=0, max=65535,
    )
    pin_workers: bool = key(
        True,
        "Pin each engine worker thread to a core of its device's NUMA node, within the "
        "CPUs the process may use; a failure to pin is logged, never fatal.",
    )
    peer_timeout_s: float = key(
        30.0,
        "Seconds the engine waits for a peer to acknowledge a transfer before it fails the "
        "transfer with TIMEOUT at the initiator; must be positive.",
        min=1e-3, unit="s",
    )
    domain: str = key(
        "tcp",
        'The Domain (transport) of each rail, by its registry name: "tcp"; "verbs" (RDMA '
        "through pyverbs, one device of engine.rdma_devices per rail; docs/rdma.md); or, "
        'for tests, "chaos" (a wrapper around tcp; "chaos:NAME" wraps another Domain) that '
        "delivers every write in pieces, out of order, after random delays, to prove "
        'nothing depends on delivery order. Never use "chaos" in production. '
        "docs/domains.md says how to add a Domain.",
        choices=("tcp", "chaos", "chaos:tcp", "verbs"),
    )
    rdma_devices: list[str] = key(  # noqa: RUF009 - key() is dataclasses.field()
        [],
        'With domain = "verbs": the RDMA device of each rail, in the order of '
        'engine.host_rails (names as `transferd devices` lists them, e.g. "mlx5_0"); one '
        "per rail. The rail's host address carries the queue-pair set-up over TCP.",
    )
    rdma_port: int = key(
        1, 'With domain = "verbs": the port of each RDMA device to use (1 on most NICs).',
        min=1, max=255,
    )
    rdma_gid_index: int = key(
        -1,
        'With domain = "verbs": the GID index of the port; -1 picks one (on RoCE the '
        "RoCE v2 GID of an IPv4 address first, on InfiniBand index 0).",
        min=-1, max=255,
    )
    chaos_seed: int = key(
        0, 'Seed of the "chaos" domain\'s random delays and order. Ignored by "tcp".'
    )
    chaos_max_delay_ms: float = key(
        5.0,
        'Largest random delay the "chaos" domain puts before each piece it sends, in '
        'milliseconds. Ignored by "tcp".',
        min=0, unit="ms",
    )
    secret_file: str = key(
        "",
        "A file holding the cluster secret (its contents, whitespace stripped), the same "
        "on every daemon, readable by the daemon's user only: every peer link proves it "
        "in both directions (HMAC-SHA256 over fresh nonces) before any byte or rkey "
        'crosses. "" (and no engine.secret): links are not authenticated, the rails bind '
        "to loopback only, and a non-loopback rail is refused unless engine.insecure is "
        "set. Never a command-line flag.",
    )
    secret: str = key(
        "",
        "The cluster secret itself, for a service manager that injects secrets into the "
        "environment (TRANSFERD_ENGINE_SECRET); prefer engine.secret_file. Not both.",
        secret=True,
    )
    insecure: bool = key(
        False,
        "Without a cluster secret, allow rails beyond loopback anyway: any host that "
        "reaches a rail port can then act as a peer. Only on a network you trust.",
    )
    handshake_timeout_s: float = key(
        5.0,
        "Seconds a peer link may take to finish its handshake before it is closed. Until "
        "then it takes a 4 KiB body and no payload.",
        min=1e-3, unit="s",
    )
    max_inflight_per_client: int = key(
        1024,
        "Most engine operations (writes, scatters, barriers, sends) one client connection "
        "may have in flight at once, of the engine worker's 4,096 slots shared by all: its "
        "next submit waits (holding back that connection's later frames) until one of its "
        "own finishes, so one client's writes to a silent peer cannot take every slot.",
        min=1, max=4096,
    )
    max_recv_pools: int = key(
        64,
        "Most SUBMIT_RECVS one client connection may have posted (each is a pool of count "
        "receives of one length; post fewer, larger ones); one more is refused with "
        "TOO_LARGE. Every arriving message looks through the posted pools, so they are "
        "bounded.",
        min=1, max=65536,
    )
    max_expectations: int = key(
        65536,
        "Most EXPECT_IMM_COUNTs one client connection may have waiting at once; one more "
        "is refused with TOO_LARGE. They go when they fire or the connection closes.",
        min=1,
    )

    def has_secret(self) -> bool:
        return bool(self.secret_file or self.secret)


def _rail_problems(e: EngineConfig) -> list[str]:
    """Without a secret, rails on loopback only unless insecure is set."""
    if e.has_secret() or e.insecure:
        return []
    out = []
    for host in e.host_rails:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            out.append(
                f"engine.host_rails: {host} is not a loopback address, and without a cluster "
                "secret peers are not authenticated: set engine.secret_file (the same on "
                "every daemon), or engine.insecure = true to accept the risk")
    return out


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


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def problems(self) -> list[str]:
        """Every problem of this configuration (per-key bounds, then across keys)."""
        out: list[str] = []
        for name, _f, value in self.items():
            out += _check_value(name, _f.metadata, value)
        if not 1 <= max(1, len(self.engine.host_rails)) <= 4:
            out.append("engine.host_rails: a domain group holds 1 to 4 rails")
        eng = self.engine
        if eng.domain == "verbs" and len(eng.rdma_devices) != max(1, len(eng.host_rails)):
            out.append(
                f"engine.rdma_devices: domain verbs needs one RDMA device per rail "
                f"({max(1, len(eng.host_rails))}), got {len(eng.rdma_devices)} "
                "(`transferd devices` lists them)"
            )
        out += _listen_problems(self.server)
        e = self.engine
        if e.secret_file and e.secret:
            out.append("engine.secret: set engine.secret_file or engine.secret "
                       "(TRANSFERD_ENGINE_SECRET), not both")
        out += _rail_problems(e)
        mem = self.memory
        if mem.max_buffer_mib > mem.host_limit_mib:
            out.append(
                f"memory.max_buffer_mib: {mem.max_buffer_mib} MiB is over "
                f"memory.host_limit_mib ({mem.host_limit_mib} MiB)"
            )
        for dev in self.gpu.devices:
            kind, _, idx = dev.partition(":")
            if kind != "cuda" or not idx.isdigit():
                out.append(f"gpu.devices: {dev!r} is not a CUDA device name (cuda:N)")
        if len(set(self.gpu.devices)) != len(self.gpu.devices):
            out.append("gpu.devices: a device is listed twice")
        return out

    def validate(self) -> Config:
        problems = self.problems()
        if problems:
            raise ConfigError(problems)
        return self

    def items(self) -> Iterator[tuple[str, dataclasses.Field[Any], Any]]:
        """``("section.key", field, value)`` for every key, in schema order."""
        for sec in dataclasses.fields(self):
            table = getattr(self, sec.name)
            for f in dataclasses.fields(table):
                yield f"{sec.name}.{f.name}", f, getattr(table, f.name)

    def get(self, dotted: str) -> Any:
        section, _, name = dotted.partition(".")
        return getattr(getattr(self, section), name)

    @property
    def host_limit(self) -> int:
        return self.memory.host_limit_mib << 20

    @property
    def max_buffer(self) -> int:
        return (self.memory.max_buffer_mib << 20) or self.host_limit

    def devices(self) -> list[DeviceSpec]:  # and memory.max_buffers, for BufferTable
        """The devices buffers are served from, each under its own limit."""
        cap = (self.memory.max_buffer_mib << 20) or None
        devs = [DeviceSpec("cpu", self.host_limit, cap)]
        if self.memory.shm_limit_mib:
            devs.append(DeviceSpec("shm", self.memory.shm_limit_mib << 20, cap))
        return devs


def schema() -> Iterator[tuple[str, type, dataclasses.Field[Any]]]:
    """``(section name, section class, key field)`` for every key of the schema."""
    for sec in dataclasses.fields(Config):
        cls = sec.default_factory
        assert isinstance(cls, type)
        for f in dataclasses.fields(cls):
            yield sec.name, cls, f


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, _c, f in schema()]


def env_name(dotted: str) -> str:
    return ENV_PREFIX + dotted.replace(".", "_").upper()


def _check_value(name: str, meta: Mapping[str, Any], value: Any) -> list[str]:
    lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices") or ()
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{name}: must be a finite number, got {value}"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if name.endswith("port") and not 0 <= value <= 65535:
            return [f"{name}: {value} is not a TCP port (0-65535)"]
        if lo is not None and hi is not None and not lo <= value <= hi:
            return [f"{name}: must be {_num(lo)} to {_num(hi)}, got {value}"]
        if lo is not None and value < lo:
            return [f"{name}: must be at least {_num(lo)}, got {value}"]
        if hi is not None and value > hi:
            return [f"{name}: must be at most {_num(hi)}, got {value}"]
    if choices and value not in choices:
        return [f"{name}: must be one of {', '.join(choices)}, got {value!r}"]
    return []


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _coerce(name: str, f: dataclasses.Field[Any], default: Any, value: Any,
            *, from_text: bool) -> Any:
    """Give ``value`` the type of ``default`` or raise ConfigError naming ``name``."""
    kind = type(default)
    if from_text:
        text = str(value).strip()
        if kind is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{name}: expected a boolean, got {text!r}")
        if kind is list:
            return [p.strip() for p in text.split(",") if p.strip()]
        if kind is str:
            value = text
        else:
            try:
                return kind(text)
            except ValueError:
                raise ConfigError(f"{name}: expected {kind.__name__}, got {text!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}: expected a list of strings")
        return list(value)
    if type(value) is not kind:
        raise ConfigError(
            f"{name}: expected {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    if kind is str and f.metadata.get("choices"):
        return value.lower()
    return value


def _unknown(name: str, candidates: list[str]) -> str:
    near = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {near[0]}?)" if near else ""


class _Loader:
    """Applies one source after another, collecting every problem."""

    def __init__(self) -> None:
        self.cfg = Config()
        self.sources = dict.fromkeys(all_keys(), "default")
        self.errors: list[str] = []
        self.sections = [f.name for f in dataclasses.fields(Config)]

    def apply(self, section: str, name: str, value: Any, *, from_text: bool,
              source: str) -> None:
        dotted = f"{section}.{name}"
        sec = getattr(self.cfg, section, None) if section in self.sections else None
        if sec is None:
            self.errors.append(
                f"{dotted}: unknown section {section!r}{_unknown(section, self.sections)}"
            )
            return
        fields = {f.name: f for f in dataclasses.fields(sec)}
        if name not in fields:
            self.errors.append(f"{dotted}: unknown key{_unknown(dotted, all_keys())}")
            return
        try:
            setattr(sec, name, _coerce(dotted, fields[name], getattr(sec, name), value,
                                       from_text=from_text))
        except ConfigError as exc:
            self.errors += exc.errors
            return
        self.sources[dotted] = source

    def file(self, path: str | Path) -> None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            self.errors.append(f"{path}: cannot read: {exc.strerror}")
            return
        except tomllib.TOMLDecodeError as exc:
            self.errors.append(f"{path}: not valid TOML: {exc}")
            return
        for section, table in data.items():
            if section not in self.sections:
                self.errors.append(
                    f"{section}: unknown section [{section}]{_unknown(section, self.sections)}"
                )
                continue
            if not isinstance(table, dict):
                self.errors.append(f"{section}: expected a [{section}] table")
                continue
            for name, value in table.items():
                self.apply(section, name, value, from_text=False, source=f"file {path}")

    def environment(self, environ: Mapping[str, str]) -> None:
        for var, value in environ.items():
            if not var.startswith(ENV_PREFIX):
                continue
            rest = var[len(ENV_PREFIX):].lower()
            section, _, name = rest.partition("_")
            # Variables whose first word is not a section are not the daemon's:
            # the client library's switches share the prefix.
            if section in self.sections and name:
                self.apply(section, name, value, from_text=True, source=f"env {var}")

    def flags(self, overrides: Mapping[str, Any]) -> None:
        for dotted, value in overrides.items():
            if value is None:
                continue
            section, _, name = dotted.partition(".")
            current = getattr(getattr(self.cfg, section, None), name, "")
            self.apply(section, name, value, source="flag",
                       from_text=isinstance(value, str) and not isinstance(current, str))


def load_with_sources(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[Config, dict[str, str]]:
    """Like :func:`load`, also returning where each key's value came from
    (``"default"``, ``"file PATH"``, ``"env VAR"`` or ``"flag"``)."""
    ld = _Loader()
    if path is not None:
        ld.file(path)
    ld.environment(os.environ if env is None else env)
    ld.flags(overrides or {})
    # Values that failed to parse kept their default; report bounds only for the rest.
    bad = {e.split(":", 1)[0] for e in ld.errors}
    problems = [p for p in ld.cfg.problems() if p.split(":", 1)[0] not in bad]
    if ld.errors or problems:
        raise ConfigError(ld.errors + problems)
    return ld.cfg, ld.sources


def load(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration; ``overrides`` maps ``section.key`` to flag values
    (``None`` = the flag was not given).  Raises ConfigError listing every problem."""
    return load_with_sources(path, env=env, overrides=overrides)[0]


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
    if s.token_file:
        try:
            with open(s.token_file, "rb") as f:
                if not f.read(4096).strip():
                    out.append(f"server.token_file: {s.token_file} is empty")
        except OSError as exc:
            out.append(f"server.token_file: cannot read {s.token_file}: {exc.strerror}")
    if not s.tcp_listener and not s.listen and not s.unix_socket:
        out.append("server.tcp_listener: false leaves nothing to listen on")
    return out
