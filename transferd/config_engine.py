"""The configuration schema's ``[engine]`` section: the peer plane between daemons.

Split from :mod:`transferd.config_sections` (the other sections and the
``key()`` helper) for size; every name here is also importable from
:mod:`transferd.config`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from transferd.config_sections import key
from transferd.domains import registry as domain_registry


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
    worker: str = key(
        "auto",
        'Where the host domain groups run: "loop" on the daemon\'s own event loop (a '
        "submit's parts go to the socket from the handler, its completion comes back "
        'without a thread hand-off), "thread" on a worker thread of their own pinned '
        '(engine.pin_workers) to a core, or "auto", which is "loop": on the measurements '
        "in docs/benchmarks.md (issue 12) the two hand-offs per transfer of a thread cost "
        "more than it buys a host group. GPU groups always have a pinned thread of their "
        "own for their copies.",
        choices=("auto", "loop", "thread"),
    )
    host_groups: int = key(
        1,
        "How many host domain groups the engine runs, each with its own worker and its "
        "own rails (every rail of engine.host_rails, one port each); registered regions "
        "are dealt to the groups in turn and a write runs on its source region's group. "
        'More than one only helps with engine.worker = "thread", where each group has a '
        "thread (docs/benchmarks.md, issue 12, says by how much the interpreter lock "
        "lets them).",
        min=1, max=8,
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
        choices=domain_registry.choices(),
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
    chaos_corrupt: float = key(
        0.0,
        'With domain = "chaos": the probability that a piece sent goes from a copy of its '
        "bytes with one byte flipped (never the source), to prove the checksums "
        '(docs/integrity.md). Ignored by every other Domain.',
        min=0.0, max=1.0,
    )
    verify: bool = key(
        False,
        "Checksums by default: every one-sided write this daemon sends carries a CRC32C "
        "per part taken from its source memory (a submit's verify=False opts out), and "
        "every write it receives must carry one (a write without is refused). The "
        "receiver checks the bytes it placed before they count; a mismatch is re-sent "
        "once, a second fails the transfer. Set it on every daemon of a cluster alike. "
        "Needs a Domain whose receiver sees each write (tcp, chaos). docs/integrity.md.",
    )
    stall_warn_s: float = key(
        0.0,
        "A transfer (or expectation) in one stage longer than this is logged at WARNING "
        "once, with its peer, rail, bytes, trace id and owner, and counted "
        "(transferd_engine_stalls_total); 0 = never. Well below engine.peer_timeout_s "
        "to hear of a stall before it times out. `transferd inflight URL` lists what is "
        "in flight now.",
        min=0.0, unit="s",
    )
    secret_file: str = key(
        "",
        "A file holding the cluster secret (its contents, whitespace stripped), the same "
        "on every daemon, readable by the daemon's user only: every peer link proves it "
        "in both directions (HMAC-SHA256 over fresh nonces) before any byte or rkey "
        'crosses. "" (and no engine.secret): links are not authenticated, the rails bind '
        "to loopback only, and a non-loopback rail is refused unless engine.insecure is "
        "set. Never a command-line flag. Refused when another user could read or rewrite "
        "it (chmod 600; server.insecure_secret_files). SIGHUP re-reads it: new links "
        "prove the new contents, open links stay.",
        reload=True,
    )
    secret: str = key(
        "",
        "The cluster secret itself, for a service manager that injects secrets into the "
        "environment (TRANSFERD_ENGINE_SECRET); prefer engine.secret_file. Not both.",
        secret=True, reload=True,
    )
    previous_secret_file: str = key(
        "",
        "During a rotation of the cluster secret: a file holding the secret in use "
        "before. Links proving either are accepted, and this daemon proves both, so "
        "daemons that have the new secret and daemons that still have the old one link "
        "while the fleet is reloaded one by one; then empty the file (or the key) and "
        "reload again (docs/security.md, Rotating a secret). An empty file: no rotation "
        "in progress. Same rules as engine.secret_file otherwise.",
        reload=True,
    )
    insecure: bool = key(
        False,
        "Without a cluster secret, allow rails beyond loopback anyway: any host that "
        "reaches a rail port can then act as a peer. Only on a network you trust.",
    )
    max_watchers: int = key(
        4096,
        "Most UVM watchers (ALLOC_UVM_WATCHER) the daemon holds, all connections together; "
        "one more is refused with OUT_OF_MEMORY.",
        min=1, max=1 << 16,
    )
    max_watchers_per_connection: int = key(
        64,
        "Most UVM watchers one client connection may hold; one more is refused with "
        "OUT_OF_MEMORY. Each connection's page holds 512 words.",
        min=1, max=512,
    )
    max_armed_writes_per_connection: int = key(
        256,
        "Most paged writes one client connection may hold armed on its UVM watchers "
        "(ARM_PAGED_WRITES), all its watchers together; one more is refused with "
        "TOO_LARGE. An armed write leaves the count when it fires or is dropped.",
        min=1, max=1 << 16,
    )
    max_armed_writes_per_watcher: int = key(
        128,
        "Most paged writes armed on one UVM watcher at once (a layer's write per value "
        "the word reaches: a model's layers, a few requests ahead); one more is refused "
        "with TOO_LARGE.",
        min=1, max=1 << 16,
    )
    max_armed_pages_per_connection: int = key(
        1 << 18,
        "Most pages (source page indices) the armed writes of one connection hold "
        "together, the memory an arm keeps until it fires; an arm that would pass it is "
        "refused with TOO_LARGE.",
        min=1, max=1 << 24,
    )
    watcher_idle_poll_ms: float = key(
        10.0,
        "Longest sleep of the thread that polls UVM watchers once their words stop "
        "changing (it polls every 50 us while they change and for 40 polls after): the "
        "first change after a quiet spell is seen within this, and an idle daemon's "
        "watchers wake it 1000/this times a second, however many there are. Lower it for "
        "a quicker first change at more CPU (1 ms: about 3% of a core).",
        min=0.05, max=1000, unit="ms",
    )
    handshake_timeout_s: float = key(
        5.0,
        "Seconds a peer link may take to finish its handshake before it is closed. Until "
        "then it takes a 4 KiB body and no payload.",
        min=1e-3, unit="s",
    )
    max_armed_pages_total: int = key(
        1 << 20,
        "Most pages the armed writes of all connections together hold; an arm that would "
        "pass it is refused with TOO_LARGE. An arm keeps its page lists until it fires "
        "(about 21 MiB for one connection at engine.max_armed_pages_per_connection), and "
        "one client may open a connection per watcher.",
        min=1, max=1 << 26,
    )
    max_inflight_per_client: int = key(
        1024,
        "Most engine operations (writes, scatters, barriers, sends) one client connection "
        "may have in flight at once, of the engine worker's 4,096 slots shared by all: its "
        "next submit waits (holding back that connection's later frames) until one of its "
        "own finishes, so one client's writes to a silent peer cannot take every slot.",
        min=1, max=4096,
    )
    max_inflight_per_peer: int = key(
        1024,
        "Most engine operations in flight at once to one destination peer (a domain group), "
        "from all clients together. One more waits in that peer's queue, holding no worker "
        "slot and holding back nothing else: the submitting connection's later frames, "
        "writes to other peers included, go on at once. A transfer that waited "
        "engine.peer_timeout_s without starting fails with TIMEOUT (not sent). So one dead "
        "or stopped peer holds at most this many of the worker's 4,096 slots.",
        min=1, max=4096,
    )
    max_peers: int = key(
        16384,
        "Peer domain groups (node id and group) each host group remembers with the rail "
        "addresses they proved in the handshake (a link claiming a known one at other "
        "addresses is refused, as is a client's address naming it elsewhere). Past it the "
        "least recently bound is forgotten, and a binding not renewed by a handshake for "
        "an hour goes; a forgotten peer binds again at its next handshake, proving itself "
        "again (without a cluster secret its node id is its addresses').",
        min=1, max=1 << 20,
    )
    max_links: int = key(
        4096,
        "Most peer links (one file descriptor each, outbound and inbound, every rail "
        "together) the engine holds. Never more than RLIMIT_NOFILE less engine.fd_reserve. "
        "At the cap an idle link (nothing in flight) is closed to make room, else the "
        "oldest inbound link of the source address holding the most (a local process "
        "that keeps its links cannot hold them all); with none of either a transfer that "
        "needs a new link fails with TOO_LARGE and an inbound link is closed at once.",
        min=1, max=1 << 20,
    )
    fd_reserve: int = key(
        256,
        "File descriptors below RLIMIT_NOFILE that peer links never take: they stay for "
        "client connections, listeners and files, so a flood of peer addresses cannot stop "
        "the daemon from accepting its clients.",
        min=0, max=1 << 20,
    )
    link_idle_s: float = key(
        300.0,
        "Seconds an outbound peer link may go unused (nothing sent, nothing in flight) "
        "before it is closed and its descriptor freed; it is dialled again on next use. "
        "0: never.",
        min=0.0, unit="s",
    )
    rail_timeout_s: float = key(
        10.0,
        "Seconds a peer link's bytes may go unacknowledged (a cut cable, a dead NIC; also a "
        "peer that reads nothing) before the link is given up (TCP_USER_TIMEOUT, and "
        "keepalives while idle); also the most a dial may take. With more than one rail "
        "the parts it carried are re-sent on the others (rail failover) and the rail is "
        "tried again after a back-off.",
        min=0.1, unit="s",
    )
    max_group_peers: int = key(
        1024,
        "Most addresses one ADD_PEER_GROUP may name; more is refused with TOO_LARGE.",
        min=1, max=65536,
    )
    max_regions: int = key(
        65536,
        "Most registered regions (REG_MR) the daemon holds, all buffers and clients "
        "together; one more is refused with OUT_OF_MEMORY. A region is not charged to a "
        "memory limit (about 2.3 KiB of the daemon's own each) and one buffer can be "
        "registered again and again: 100,000 REG_MRs of one 4 KiB buffer took 228 MiB.",
        min=1, max=1 << 22,
    )
    max_scatter_dsts: int = key(
        4096,
        "Most destinations one SCATTER or BARRIER, or sources one GATHER, may name; more "
        "is refused whole with "
        "TOO_LARGE (the connection goes on) before any is read: each costs the daemon's "
        "loop its checks and its plan.",
        min=1, max=1 << 20,
    )
    max_paged_pages: int = key(
        65536,
        "Most pages one PAGED_WRITES, PAGED_READS or ARM_PAGED_WRITES may name on either "
        "side; more is refused whole with TOO_LARGE (the connection goes on) before any "
        "is read: each costs the daemon's loop its checks and its plan (350,000 pages, "
        "what a 4 MiB body holds, took 0.65 s).",
        min=1, max=1 << 22,
    )
    max_pages_in_flight: int = key(
        1 << 20,
        "Most pages the paged writes and reads in flight on this daemon name, with the "
        "destinations of its SCATTERs and BARRIERs and the sources of its GATHERs, all "
        "connections together, from submit to end; one that would pass it is refused "
        "with TOO_LARGE. Each costs the daemon its plan until the transfer ends, whatever "
        "the size of the memory it moves (100 PAGED_WRITES of 65,536 pages to a stopped "
        "peer: +1.6 GiB; 100 SCATTERs of 4,096 destinations: +395 MiB).",
        min=1, max=1 << 26,
    )
    max_peer_groups: int = key(
        64,
        "Most peer groups one client connection may have made (ADD_PEER_GROUP); one more "
        "is refused with TOO_LARGE. A connection's groups go when it closes.",
        min=1, max=65536,
    )
    max_group_peers_total: int = key(
        262144,
        "Most addresses the peer groups of all connections together name (each group "
        "counts its addresses); an ADD_PEER_GROUP that would pass it is refused with "
        "TOO_LARGE. engine.max_peer_groups and engine.max_group_peers bound one "
        "connection (65,536 addresses, a few MiB), and a client may open many.",
        min=1, max=1 << 24,
    )
    max_recv_pools: int = key(
        64,
        "Most SUBMIT_RECVS one client connection may have posted (each is a pool of count "
        "receives of one length; post fewer, larger ones); one more is refused with "
        "TOO_LARGE. Pools are found by length (no scan), and bounded so that one "
        "connection cannot take every pool of engine.max_recv_pools_total.",
        min=1, max=65536,
    )
    max_recv_pools_total: int = key(
        4096,
        "Most SUBMIT_RECVS posted on this daemon, all connections together; one more is "
        "refused with TOO_LARGE.",
        min=1, max=1 << 20,
    )
    recv_waiting_max: int = key(
        1024,
        "Most peer messages that may wait here at once for a busy receive (or for the "
        "receiving connection's write buffer to drain); one more is refused, its sender's "
        "SEND failing with TOO_LARGE. Their bytes are charged to memory.host_limit_mib "
        "too, like a buffer.",
        min=1, max=1 << 20,
    )
    recv_wait_s: float = key(
        5.0,
        "Seconds a peer message may wait for one of the busy receives it was queued on; "
        "then it is dropped and its sender's SEND fails with CANCELLED. At most half of "
        "engine.peer_timeout_s is used (a sender with the same timeout is told rather "
        "than timing out).",
        min=1e-3, unit="s",
    )
    write_id_window: int = key(
        16384,
        "Write ids (SINGLE_WRITE / PAGED_WRITES `wid`) a receiver remembers as applied, "
        "per initiating peer, one per WRITE frame, oldest forgotten first (all peers "
        "together: 4 windows; about 200 bytes each): a retry whose frames are still "
        "remembered is acknowledged without being placed or counted again.",
        min=1, max=1 << 24,
    )
    write_id_ttl_s: float = key(
        600.0,
        "Seconds a receiver remembers an applied write id: retry a write that timed out "
        "within this (and within engine.write_id_window writes) for it to count once.",
        min=1e-3, unit="s",
    )
    max_expectations: int = key(
        65536,
        "Most EXPECT_IMM_COUNTs one client connection may have waiting at once; one more "
        "is refused with TOO_LARGE. They go when they fire, time out (expect_timeout_s), "
        "are cancelled, or the connection closes.",
        min=1,
    )
    max_expectations_total: int = key(
        131072,
        "Most EXPECT_IMM_COUNTs waiting on this daemon, all connections together; one more "
        "is refused with TOO_LARGE. Each costs the daemon about 4 KiB (65,536 on immediates "
        "of their own: 270 MiB), and one client may open many connections.",
        min=1, max=1 << 24,
    )
    max_counters: int = key(
        1 << 20,
        "Most immediates this daemon holds a count of that no expectation has consumed "
        "yet (the writes that landed with them, waiting for an EXPECT_IMM_COUNT). Each "
        "costs about 70 bytes and a write may name any of 2^32: past this, a peer's "
        "write with an immediate that has no count yet is refused with OUT_OF_MEMORY "
        "before a byte of it lands (one whose immediate has a count or an expectation "
        "waiting still lands). On verbs the NIC places such a write before the daemon "
        "sees it: its count is not held, its link is closed (the initiator's next writes "
        "fail) and it is logged. Counts go when expectations consume them.",
        min=1, max=1 << 26,
    )
    expect_timeout_s: float = key(
        300.0,
        "The deadline of an EXPECT_IMM_COUNT that names none (timeout_ms): not reached by "
        "then, it ends with TIMEOUT (nothing consumed). Nothing waits forever.",
        min=1e-3, unit="s",
    )
    max_expect_timeout_s: float = key(
        3600.0,
        "The longest deadline an EXPECT_IMM_COUNT may ask for (timeout_ms); a longer one is "
        "BAD_REQUEST. At least expect_timeout_s.",
        min=1e-3, unit="s",
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
