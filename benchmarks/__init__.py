"""transferd's benchmarks: every figure measured side by side with its baseline.

Run ``python -m benchmarks`` (or ``make bench``); see docs/benchmarks.md.  Each
benchmark is a module of this package with ``NAME``, ``TITLE``, ``SECTION`` and
``run(opts) -> BenchResult``; list it in :data:`BENCHMARKS` to include it.
The shared pieces (server processes, pinning, percentiles, tables, targets)
live in :mod:`benchmarks.harness`.
"""

# Module names, in the order `python -m benchmarks` runs them.
BENCHMARKS = [
    # Protocol (issue 2)
    "latency",
    "batching",
    "throughput",
    # Transfer engine (issue 3)
    "engine_bulk",
    "engine_paged",
    "engine_rails",
    "engine_latency",
    # The 4 KiB write's steps and domain groups (issue 12)
    "engine_steps",
    "engine_groups",
    # The engine in the caller's process (issue 21)
    "engine_inproc",
    # The small write's CPU and rate (issue 17)
    "engine_small",
    # Checksums (issue 20)
    "engine_verify",
    # One-sided READ against WRITE (issue 19)
    "engine_reads",
    # Memory (issue 7)
    "shm_read",
    # The RDMA completion-queue loop (issue 24)
    "cq_idle",
    # Connections (issue 6)
    "transports",
    # How cost grows (issue 12)
    "scale_clients",
    "scale_pages",
    "scale_peers",
    "scale_handoff",
    "copies",
    # Security (issue 16)
    "watchers",
    # The article's three systems, end to end (issue 25)
    "workloads_kv",
    "workloads_rl",
    "workloads_moe",
]

# Names that stand for several benchmarks in ``--only`` (``--only engine``).
GROUPS = {
    "engine": ["engine_bulk", "engine_paged", "engine_rails", "engine_latency", "engine_steps",
               "engine_groups", "engine_small", "engine_verify",
               "engine_reads"],
    "memory": ["shm_read"],
    "scale": ["scale_clients", "scale_pages", "scale_peers", "scale_handoff", "copies"],
    "workloads": ["workloads_kv", "workloads_rl", "workloads_moe"],
}
