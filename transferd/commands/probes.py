"""What this machine has, for ``transferd devices`` and ``transferd doctor``.

A probe is a function ``probe(config) -> Section`` registered by name with
:func:`register`: NUMA nodes, NICs, GPUs and RDMA devices are built in; a helper
with a better discovery (the GPU or RDMA code) registers its own under the same
name, replacing the built-in one.  ``config`` is the configuration being checked
(or None): a probe adds a ``needed`` problem when that configuration needs
something the machine lacks, which makes ``doctor`` exit 1.

Probes read /sys and /proc and never fail: what they cannot tell they say.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transferd.config import Config


@dataclass
class Section:
    name: str
    items: list[dict[str, Any]] = field(default_factory=list)
    # Why the section is empty, or what it could not tell.
    note: str = ""
    # Things the configuration needs that are missing (doctor fails on these).
    needed: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"items": self.items, "note": self.note, "needed": self.needed}


Probe = Callable[[Config | None], Section]
PROBES: dict[str, Probe] = {}


def register(name: str) -> Callable[[Probe], Probe]:
    """``@register("gpus")``: add (or replace) the probe of that name."""

    def deco(fn: Probe) -> Probe:
        PROBES[name] = fn
        return fn

    return deco


def run_all(config: Config | None) -> list[Section]:
    out = []
    for name, fn in PROBES.items():
        try:
            out.append(fn(config))
        except Exception as exc:  # a probe's bug must not hide the others
            out.append(Section(name, note=f"the probe failed: {type(exc).__name__}: {exc}"))
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


# -- NUMA -------------------------------------------------------------------------------


@register("numa")
def numa(config: Config | None) -> Section:
    sec = Section("numa")
    base = Path("/sys/devices/system/node")
    nodes = sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    if not nodes:
        sec.note = f"{base} lists no NUMA nodes (one node, or /sys not mounted)"
    for n in nodes:
        mem = 0
        for line in _read(n / "meminfo").splitlines():
            if "MemTotal:" in line:
                mem = int(line.split()[-2]) << 10
        sec.items.append({"node": int(n.name[4:]), "cpus": _read(n / "cpulist"),
                          "memory": mem})
    return sec


# -- NICs -------------------------------------------------------------------------------


def _ip_addr() -> list[dict[str, Any]]:
    """`ip -j addr`, parsed (empty where there is no ip)."""
    ip = shutil.which("ip")
    if ip is None:
        return []
    try:
        out = subprocess.run([ip, "-j", "addr"], capture_output=True, text=True, timeout=5)
        data = json.loads(out.stdout or "[]")
    except (OSError, subprocess.SubprocessError, ValueError):
        return []
    return [i for i in data if isinstance(i, dict) and "ifname" in i]


def _addresses(data: list[dict[str, Any]] | None = None) -> dict[str, list[str]]:
    """Interface name -> its IP addresses."""
    return {i["ifname"]: [a["local"] for a in i.get("addr_info", []) if "local" in a]
            for i in (_ip_addr() if data is None else data)}


def _interface_of(host: str, data: list[dict[str, Any]]) -> str | None:
    """The interface ``host`` is on: one that has it, else one whose network holds it on
    a loopback interface (all of 127.0.0.0/8 is lo's, though `ip` lists 127.0.0.1/8)."""
    try:
        want = ipaddress.ip_address(host)
    except ValueError:
        return None
    for i in data:
        for a in i.get("addr_info", []):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                if ipaddress.ip_address(a["local"]) == want:
                    return str(i["ifname"])
    for i in data:
        if "LOOPBACK" not in i.get("flags", []):
            continue
        for a in i.get("addr_info", []):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                if want in ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False):
                    return str(i["ifname"])
    return None


@register("nics")
def nics(config: Config | None) -> Section:
    sec = Section("nics")
    data = _ip_addr()
    addrs = _addresses(data)
    base = Path("/sys/class/net")
    for dev in sorted(base.iterdir()) if base.is_dir() else []:
        speed = _read(dev / "speed")
        sec.items.append({
            "name": dev.name,
            "state": _read(dev / "operstate") or "?",
            "mtu": int(_read(dev / "mtu") or 0),
            "speed_mbps": int(speed) if speed.lstrip("-").isdigit() and int(speed) > 0 else None,
            "numa_node": _numa_of(dev),
            "addresses": addrs.get(dev.name, []),
        })
    if not sec.items:
        sec.note = f"{base} lists no network interfaces"
    if not addrs:
        sec.note = (sec.note + "; " if sec.note else "") + "addresses unknown (no `ip`)"
    if config is not None:
        e = config.engine
        if e.enabled:
            from transferd.preflight import is_local_address

            rails = list(e.host_rails) or [config.server.host]
            for i, host in enumerate(rails):
                key = f"engine.host_rails[{i}]" if e.host_rails else "server.host"
                nic = _interface_of(host, data)
                if nic is not None:
                    sec.items.append({"config": key, "address": host, "nic": nic})
                elif not _wildcard(host) and _is_ip(host):
                    # The same test as the start-up check's: can this machine bind it?
                    if is_local_address(host):
                        sec.items.append({"config": key, "address": host,
                                          "nic": "(a local address no interface lists: an "
                                                 "AnyIP route or ip_nonlocal_bind)"})
                    else:
                        sec.needed.append(f"{key}: {host} is not an address of this machine")
    return sec


def _numa_of(dev: Path) -> int | None:
    text = _read(dev / "device" / "numa_node")
    with contextlib.suppress(ValueError):
        n = int(text)
        return n if n >= 0 else None
    return None


def _is_ip(host: str) -> bool:
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return True
    return False


def _wildcard(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_unspecified
    return False


# -- GPUs -------------------------------------------------------------------------------


@register("gpus")
def gpus(config: Config | None) -> Section:
    """NVIDIA GPUs from the driver's /proc entries (the GPU code may register a better probe)."""
    sec = Section("gpus")
    base = Path("/proc/driver/nvidia/gpus")
    for g in sorted(base.iterdir()) if base.is_dir() else []:
        info = dict(line.split(":", 1) for line in _read(g / "information").splitlines()
                    if ":" in line)
        sec.items.append({"pci": g.name, "model": info.get("Model", "?").strip(),
                          "numa_node": _numa_of(Path("/sys/bus/pci/devices") / g.name)})
    if not sec.items:
        sec.note = ("no NVIDIA GPU: the driver is not loaded (no /proc/driver/nvidia/gpus)"
                    if not base.exists() else "the NVIDIA driver lists no GPU")
    if config is not None and not sec.items:
        for name, _f, value in config.items():
            if isinstance(value, str) and value.startswith("cuda"):
                sec.needed.append(f"{name} = {value!r} needs a GPU: {sec.note}")
    return sec


# -- RDMA -------------------------------------------------------------------------------


@register("rdma")
def rdma(config: Config | None) -> Section:
    from transferd.rdma.devices import discover

    report = discover()
    sec = Section("rdma", items=[d for d in report.to_dict()["devices"]],
                  note="; ".join([report.reason or "; ".join(report.problems),
                                  f"GPU memory: {report.gpu_memory}"]).lstrip("; "))
    if config is not None and needs_rdma(config) and not report.usable:
        sec.needed.append(f"engine.domain = {config.engine.domain!r} needs an RDMA port: "
                          f"{report.reason or 'none is ACTIVE'}")
    return sec


def needs_rdma(config: Config) -> bool:
    """Whether the configured engine's Domain runs on RDMA ports (its capability)."""
    from transferd.domains import registry

    return config.engine.enabled and registry.capabilities(config.engine.domain).rdma


def text(sections: list[Section]) -> str:
    lines: list[str] = []
    for s in sections:
        lines.append(f"{s.name}:")
        for it in s.items:
            lines.append("  " + ", ".join(f"{k} {v}" for k, v in it.items()
                                          if v not in (None, "", [])))
        if s.note:
            lines.append(f"  ({s.note})")
        for n in s.needed:
            lines.append(f"  MISSING: {n}")
    return "\n".join(lines)


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK soft limit in bytes; None = unlimited."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)



def env_secret_files(cfg: Config) -> list[tuple[str, str]]:
    """(key, path) of every configured file holding a secret or a private key."""
    out = []
    for name, _f, value in cfg.items():
        if isinstance(value, str) and value and (name.endswith("_file") or
                                                 name.endswith("tls_key")):
            out.append((name, value))
    return out


def mode_problem(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror}"
    if not os.access(path, os.R_OK):
        return f"{path} is not readable by this user"
    if st.st_mode & 0o077:
        return f"{path} is readable by others (mode {st.st_mode & 0o777:o}): chmod 600 it"
    return None
