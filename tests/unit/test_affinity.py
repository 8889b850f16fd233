"""Worker placement: cpulists, NUMA nodes from a fake sysfs, the allowed CPU set, and
pinning that never fails the caller."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from transferd.workers import affinity
from transferd.workers.affinity import (
    allowed_cpus,
    choose_cpu,
    cpus_of_node,
    numa_node_of_netdev,
    numa_node_of_pci,
    parse_cpulist,
    pin_current_thread,
)


@pytest.mark.parametrize(
    "text, cpus",
    [
        ("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}),
        ("0", {0}),
        ("5\n", {5}),
        ("", set()),
        ("\n", set()),
        ("0-0", {0}),
        ("2,2,1-2", {1, 2}),
        ("0-63", set(range(64))),
        ("1,", {1}),
    ],
)
def test_parse_cpulist(text: str, cpus: set[int]) -> None:
    assert parse_cpulist(text) == cpus


def make_sysfs(root: Path) -> Path:
    """A sysfs with two NUMA nodes, two NICs and a GPU (some with unknown nodes)."""
    for node, cpulist in ((0, "0-3\n"), (1, "4-7,12\n")):
        d = root / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist)
    for ifname, node in (("eth0", "1\n"), ("eth1", "-1\n"), ("eth2", "garbage")):
        d = root / "class/net" / ifname / "device"
        d.mkdir(parents=True)
        (d / "numa_node").write_text(node)
    (root / "class/net/lo").mkdir(parents=True)  # a virtual interface: no device
    d = root / "bus/pci/devices/0000:3b:00.0"
    d.mkdir(parents=True)
    (d / "numa_node").write_text("0\n")
    return root


def test_numa_nodes_from_sysfs(tmp_path: Path) -> None:
    sysfs = make_sysfs(tmp_path)
    assert numa_node_of_netdev("eth0", sysfs) == 1
    assert numa_node_of_netdev("eth1", sysfs) is None  # -1: no NUMA affinity
    assert numa_node_of_netdev("eth2", sysfs) is None  # unreadable value
    assert numa_node_of_netdev("lo", sysfs) is None
    assert numa_node_of_netdev("nope", sysfs) is None
    assert numa_node_of_pci("0000:3b:00.0", sysfs) == 0
    assert numa_node_of_pci("0000:ff:00.0", sysfs) is None
    assert cpus_of_node(0, sysfs) == {0, 1, 2, 3}
    assert cpus_of_node(1, sysfs) == {4, 5, 6, 7, 12}
    assert cpus_of_node(2, sysfs) == set()


def test_choose_cpu_within_node_and_allowed_set(tmp_path: Path) -> None:
    sysfs = make_sysfs(tmp_path)
    node = numa_node_of_netdev("eth0", sysfs)
    assert node is not None
    node_cpus = cpus_of_node(node, sysfs)  # {4, 5, 6, 7, 12}
    # Ties go to the highest allowed core of the node.
    assert choose_cpu(node_cpus, set(range(16)), Counter()) == 12
    # Only cores we may use (a cgroup or taskset narrowed us to 0-5).
    assert choose_cpu(node_cpus, set(range(6)), Counter()) == 5
    # Least used first.
    assert choose_cpu(node_cpus, set(range(6)), Counter({5: 1})) == 4
    assert choose_cpu(node_cpus, {4, 5}, Counter({5: 2, 4: 1})) == 4
    assert choose_cpu(node_cpus, {4, 5}, Counter({5: 1, 4: 1})) == 5


def test_choose_cpu_spreads_workers() -> None:
    taken: Counter[int] = Counter()
    picks = []
    for _ in range(6):
        cpu = choose_cpu({0, 1, 2}, {0, 1, 2, 3}, taken)
        assert cpu is not None
        taken[cpu] += 1
        picks.append(cpu)
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]


def test_choose_cpu_fallbacks() -> None:
    # The node's cores are all outside the allowed set: any allowed core.
    assert choose_cpu({4, 5}, {0, 1}, Counter()) == 1
    # No node known (host group): any allowed core, avoiding core 0 on a tie.
    assert choose_cpu((), {0, 1, 2, 3}, Counter()) == 3
    assert choose_cpu([], {0}, Counter()) == 0
    # Nothing allowed at all: no pinning.
    assert choose_cpu({1}, set(), Counter()) is None


def test_allowed_cpus() -> None:
    cpus = allowed_cpus()
    assert cpus and cpus <= set(range(max(cpus) + 1))
    if hasattr(os, "sched_getaffinity"):
        assert cpus == set(os.sched_getaffinity(0))


def test_allowed_cpus_without_sched_getaffinity(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(pid: int) -> set[int]:
        raise OSError("not supported here")

    monkeypatch.setattr(affinity.os, "sched_getaffinity", broken, raising=False)
    assert allowed_cpus() == set(range(os.cpu_count() or 1))


def _in_thread(fn: Callable[[], object]) -> list[object]:
    """Run ``fn`` on a thread of its own (pinning the test's thread would stick)."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    assert not t.is_alive()
    return out


def test_pin_failure_does_not_raise(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A core we may not use (or that does not exist): logged, False, no exception.
    assert _in_thread(lambda: pin_current_thread(1 << 20)) == [False]

    def refuse(pid: int, cpus: object) -> None:
        raise PermissionError("operation not permitted")

    monkeypatch.setattr(affinity.os, "sched_setaffinity", refuse, raising=False)
    with caplog.at_level("WARNING", logger="transferd.workers"):
        assert _in_thread(lambda: pin_current_thread(0)) == [False]
    assert "unpinned" in caplog.text
    monkeypatch.delattr(affinity.os, "sched_setaffinity", raising=False)
    assert _in_thread(lambda: pin_current_thread(0)) == [False]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity")
def test_pin_pins_only_the_calling_thread() -> None:
    before = os.sched_getaffinity(0)
    cpu = max(before)

    def pin_and_read() -> tuple[bool, set[int]]:
        return pin_current_thread(cpu), os.sched_getaffinity(0)

    assert _in_thread(pin_and_read) == [(True, {cpu})]
    assert os.sched_getaffinity(0) == before  # this thread is untouched
