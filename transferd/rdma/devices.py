"""RDMA device discovery: devices, ports, state, GIDs, NUMA nodes, or why there are none.

:func:`discover` returns a :class:`DevicesReport` (structured, for ``--json`` and for
the Domain's start-up checks) whose :meth:`~DevicesReport.text` is what
``transferd devices`` prints.  When nothing can be used it says why, most basic cause
first: pyverbs missing, no RDMA device in the kernel (and whether soft-RoCE could
provide one), devices without a userspace provider, the memlock limit too low.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .loader import MIN_MEMLOCK, VerbsUnavailable, load_pyverbs, memlock_limit, memlock_problem

SYSFS = Path("/sys/class/infiniband")
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
LINK_LAYERS = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}
GID_TYPES = {0: "IB/RoCE v1", 1: "RoCE v2"}
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


@dataclass
class GidInfo:
    index: int
    gid: str
    type: str


@dataclass
class PortInfo:
    port: int
    state: str
    link_layer: str
    lid: int
    active_mtu: int  # bytes
    max_msg: int
    gids: list[GidInfo] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


@dataclass
class DeviceInfo:
    name: str
    numa_node: int | None
    node_guid: str
    fw: str
    ports: list[PortInfo] = field(default_factory=list)
    netdevs: list[str] = field(default_factory=list)


@dataclass
class DevicesReport:
    devices: list[DeviceInfo] = field(default_factory=list)
    # Why there is nothing usable (None when some port is active).
    reason: str | None = None
    # Things that will break use even though devices exist (memlock, ...).
    problems: list[str] = field(default_factory=list)
    memlock: int | None = None  # bytes; None = unlimited
    # How a verbs rail reaches GPU memory here, in words (gpu_memory_path()).
    gpu_memory: str = ""
    # How the completion-queue loop waits with this pyverbs (chanfd.expected_wakeup).
    cq_wakeup: str = ""

    @property
    def usable(self) -> bool:
        return self.reason is None and any(p.active for d in self.devices for p in d.ports)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"usable": self.usable}

    def text(self) -> str:
        lines: list[str] = []
        for d in self.devices:
            numa = "?" if d.numa_node is None else str(d.numa_node)
            nd = f", netdev {','.join(d.netdevs)}" if d.netdevs else ""
            lines.append(f"{d.name}: NUMA node {numa}, fw {d.fw}, GUID {d.node_guid}{nd}")
            for p in d.ports:
                lines.append(f"  port {p.port}: {p.state}, {p.link_layer}, LID {p.lid}, "
                             f"MTU {p.active_mtu}, max message {p.max_msg}")
                for g in p.gids:
                    lines.append(f"    GID[{g.index}] {g.gid} ({g.type})")
        if not self.devices:
            lines.append("no RDMA devices")
        if self.reason:
            lines.append(f"why: {self.reason}")
        lines += [f"problem: {p}" for p in self.problems]
        lim = "unlimited" if self.memlock is None else f"{self.memlock >> 10} KiB"
        lines.append(f"memlock limit: {lim}")
        if self.cq_wakeup:
            lines.append(f"completion queue: {self.cq_wakeup}")
        if self.gpu_memory:
            lines.append(f"GPU memory: {self.gpu_memory}")
        return "\n".join(lines)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _numa(sysfs: Path, name: str) -> int | None:
    v = _read(sysfs / name / "device" / "numa_node")
    try:
        n = int(v) if v is not None else -1
    except ValueError:
        return None
    return n if n >= 0 else None


PEER_MEMORY_MODULES = ("nvidia_peermem", "nv_peer_mem")


def peer_memory_loaded(sys_module: Path = Path("/sys/module")) -> str | None:
    """The loaded module that lets ibv_reg_mr take CUDA addresses (GPUDirect RDMA):
    nvidia-peermem, or the older nv_peer_mem; None without one."""
    return next((m for m in PEER_MEMORY_MODULES if (sys_module / m).exists()), None)


def gpu_memory_path(sys_module: Path = Path("/sys/module")) -> str:
    """How a verbs rail reaches GPU buffers on this machine (``transferd devices`` and
    ``doctor`` say it; docs/rdma.md "GPU memory")."""
    staged = ("writes from GPU buffers are copied into the group's pinned staging, "
              "registered with every NIC of the group")
    module = peer_memory_loaded(sys_module)
    if module is not None:
        return (f"GPUDirect RDMA ({module} loaded): GPU buffers are registered with the "
                f"NIC by their device address and writes into them land in GPU memory; "
                f"{staged}")
    return ("no GPUDirect RDMA (nvidia-peermem is not loaded): GPU buffers cannot be "
            "registered on a verbs rail (dma-buf is not used: pyverbs registers it at iova "
            f"= offset); once it is loaded, {staged}")


def rxe_available() -> str:
    """Whether soft-RoCE could give this machine a device, in words."""
    if Path("/sys/module/rdma_rxe").exists():
        return "rdma_rxe is loaded but no rxe link exists (rdma link add rxe0 type rxe " \
               "netdev IFACE)"
    release = platform.release()
    mod = Path(f"/lib/modules/{release}/kernel/drivers/infiniband/sw/rxe")
    if mod.exists():
        return f"rdma_rxe exists for kernel {release} but is not loaded (modprobe rdma_rxe)"
    return (f"kernel {release} has neither rdma_rxe (soft-RoCE) nor siw loaded or "
            "installed")


def sysfs_devices(sysfs: Path = SYSFS) -> list[str]:
    try:
        return sorted(p.name for p in sysfs.iterdir())
    except OSError:
        return []


def discover(sysfs: Path = SYSFS, need_memlock: int = MIN_MEMLOCK) -> DevicesReport:
    report = DevicesReport(memlock=memlock_limit(), gpu_memory=gpu_memory_path())
    if (p := memlock_problem(need_memlock)) is not None:
        report.problems.append(p)
    kernel = sysfs_devices(sysfs)
    try:
        load_pyverbs()
    except VerbsUnavailable as exc:
        report.reason = exc.message
        if not kernel:
            report.reason += f"; and no RDMA device in the kernel ({sysfs} is empty or " \
                             f"absent: {rxe_available()})"
        return report
    import pyverbs.cq
    import pyverbs.device as d
    from pyverbs.pyverbs_error import PyverbsError

    from .chanfd import expected_wakeup

    report.cq_wakeup = expected_wakeup(pyverbs.cq.CompChannel)
    try:
        listed = d.get_device_list()
    except PyverbsError:
        listed = []
    if not listed:
        if kernel:
            report.reason = (f"the kernel has RDMA device(s) {', '.join(kernel)} but "
                             "libibverbs lists none: no userspace provider for them "
                             "(install rdma-core's ibverbs-providers)")
        else:
            report.reason = (f"no RDMA devices: {sysfs} is empty or absent (no NIC with "
                             f"an RDMA driver; {rxe_available()})")
        return report
    for dev in listed:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        report.devices.append(_describe(d, name, sysfs))
    if not report.usable and report.reason is None:
        report.reason = "no port is ACTIVE (check the link and, on InfiniBand, the subnet manager)"
    return report


def _describe(d: Any, name: str, sysfs: Path) -> DeviceInfo:
    from pyverbs.pyverbs_error import PyverbsError

    netdevs = sorted(os.listdir(sysfs / name / "device" / "net")) if (
        sysfs / name / "device" / "net").is_dir() else []
    info = DeviceInfo(name, _numa(sysfs, name), "?", "?", netdevs=netdevs)
    from .chanfd import EVENT_FILES_LOCK

    try:
        with EVENT_FILES_LOCK:  # its async-event file: see chanfd
            ctx = d.Context(name=name)
        with ctx:
            attr = ctx.query_device()
            info.fw = str(attr.fw_version)
            info.node_guid = str(attr.node_guid)
            for port in range(1, attr.phys_port_cnt + 1):
                pa = ctx.query_port(port)
                p = PortInfo(port, PORT_STATES.get(pa.state, str(pa.state)),
                             LINK_LAYERS.get(pa.link_layer, str(pa.link_layer)), pa.lid,
                             128 << pa.active_mtu, pa.max_msg_sz)
                for i in range(pa.gid_tbl_len):
                    try:
                        gid = ctx.query_gid(port, i).gid
                    except PyverbsError:
                        continue
                    if gid == ZERO_GID:
                        continue
                    try:
                        kind = GID_TYPES.get(ctx.query_gid_type(port, i), "?")
                    except PyverbsError:
                        kind = "?"
                    p.gids.append(GidInfo(i, gid, kind))
                info.ports.append(p)
    except PyverbsError as exc:
        info.fw = f"cannot open: {exc}"
    return info


def rdma_problem(url: str) -> str | None:
    """Why an ``rdma://HOST:PORT`` listener or connection cannot open here, or None."""
    report = discover()
    if not report.usable:
        return f"{url}: no RDMA device with an ACTIVE port: {report.reason}"
    if (p := memlock_problem()) is not None:
        return f"{url}: {p}"
    return None
