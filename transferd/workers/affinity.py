"""Which core a worker runs on: the NUMA node of its device, within our CPU set.

The device's node comes from sysfs (``/sys/class/net/IF/device/numa_node``
for a NIC, ``/sys/bus/pci/devices/BDF/numa_node`` for a GPU); the node's cores
from ``/sys/devices/system/node/nodeN/cpulist``; the cores we may use from
``sched_getaffinity`` (containers, cgroups and taskset all narrow it).
Pinning is best effort: a failure is logged and the worker runs unpinned.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("transferd.workers")


def parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def numa_node_of_netdev(ifname: str, sysfs: Path = Path("/sys")) -> int | None:
    node = _read_int(sysfs / "class/net" / ifname / "device/numa_node")
    return node if node is not None and node >= 0 else None


def numa_node_of_pci(bdf: str, sysfs: Path = Path("/sys")) -> int | None:
    node = _read_int(sysfs / "bus/pci/devices" / bdf / "numa_node")
    return node if node is not None and node >= 0 else None


def cpus_of_node(node: int, sysfs: Path = Path("/sys")) -> set[int]:
    try:
        return parse_cpulist((sysfs / f"devices/system/node/node{node}/cpulist").read_text())
    except OSError:
        return set()


def allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def choose_cpu(
    node_cpus: Iterable[int], allowed: set[int], taken: Counter[int]
) -> int | None:
    """The least-used allowed core of the node (any allowed core if none is).

    Ties go to the highest core: core 0 is where the daemon's own loop and
    most interrupts tend to run.
    """
    candidates = set(node_cpus) & allowed or set(allowed)
    if not candidates:
        return None
    return min(candidates, key=lambda c: (taken[c], -c))


def pin_current_thread(cpu: int) -> bool:
    try:
        os.sched_setaffinity(0, {cpu})  # 0 = the calling thread on Linux
        return True
    except (AttributeError, OSError) as exc:
        log.warning("could not pin worker to cpu %d: %s (running unpinned)", cpu, exc)
        return False
