"""Putting verbs Domains into a domain group: one per rail, from the engine's config.

Called on the group's worker (after it was pinned), like the tcp rails' bind.  Raises
:class:`~.loader.VerbsUnavailable` naming what is missing (pyverbs, a device, an active
port, the memlock limit) before anything listens, so a daemon asked for verbs where
there is none stops at start with that message.
"""

from __future__ import annotations

from typing import Any

from .loader import VerbsUnavailable, load_pyverbs, memlock_problem


def preflight(devices: list[str]) -> None:
    """Everything that can be checked before opening a device, with its reason."""
    load_pyverbs()
    if not devices:
        raise VerbsUnavailable('engine.domain = "verbs" needs engine.rdma_devices '
                               "(`transferd devices` lists them)")
    if (p := memlock_problem()) is not None:
        raise VerbsUnavailable(p)


def bind_verbs(group: Any, hosts: list[str], port: int, config: Any) -> None:
    """One VerbsDomain per rail: rail i listens for set-up on hosts[i] and uses
    config.rdma_devices[i]."""
    devices = list(config.rdma_devices)
    preflight(devices)
    if len(devices) != len(hosts):
        raise VerbsUnavailable(f"engine.rdma_devices names {len(devices)} device(s) for "
                               f"{len(hosts)} rail(s)")
    from .domain import VerbsDomain

    gid = None if config.rdma_gid_index < 0 else config.rdma_gid_index
    try:
        for i, (host, dev) in enumerate(zip(hosts, devices, strict=True)):
            group.domains.append(VerbsDomain(group, i, host, port if i == 0 else 0,
                                             device=dev, ib_port=config.rdma_port,
                                             gid_index=gid))
    except BaseException:
        for d in group.domains:
            d.close()
        group.domains.clear()
        raise


def machine_problems(devices: list[str], port: int) -> list[tuple[str, str]]:
    """(config key, message) for each reason this machine cannot run the verbs Domain
    as configured: what ``transferd serve`` and ``check-config`` report before start."""
    from .devices import discover

    report = discover()
    out: list[tuple[str, str]] = []
    by_name = {d.name: d for d in report.devices}
    if not report.devices:
        out.append(("engine.domain", f"verbs: {report.reason}"))
    else:
        for i, name in enumerate(devices):
            dev = by_name.get(name)
            if dev is None:
                out.append((f"engine.rdma_devices[{i}]", f"no RDMA device {name!r} here "
                            f"(there are: {', '.join(sorted(by_name))})"))
                continue
            p = next((p for p in dev.ports if p.port == port), None)
            if p is None or not p.active:
                state = "absent" if p is None else p.state
                out.append((f"engine.rdma_devices[{i}]", f"{name} port {port} is {state}, "
                            "not ACTIVE"))
    out += [("engine.domain", f"verbs: {p}") for p in report.problems]
    return out


def register_region(worker: Any, group: Any, region: Any) -> tuple[int, ...]:
    """Register a region with every rail's NIC (on the group's worker): the rkeys, one
    per rail, that its MrDesc carries.  The NIC checks rkey and bounds of every write
    that arrives; nothing of the region table's own rkeys is used on verbs."""
    device = getattr(getattr(region.buffer, "memory", None), "kind", "cpu")

    def reg() -> tuple[int, ...]:
        done: list[Any] = []
        try:
            for d in group.domains:
                done.append(d)
                d.register(region.ptr, region.size, str(device))
        except BaseException:
            for d in done[:-1]:
                d.deregister(region.ptr)
            raise
        return tuple(d.nic.mrs.find(region.ptr, region.size).rkey for d in group.domains)

    return tuple(worker.run_sync(reg))


def deregister_region(worker: Any, group: Any, region: Any) -> None:
    """ibv_dereg_mr on every rail: from its return no remote write lands in the region
    (one in flight fails at its initiator with a remote access error)."""
    import contextlib

    from transferd.protocol.errors import TransferdError

    def dereg() -> None:
        for d in group.domains:
            with contextlib.suppress(TransferdError):
                d.deregister(region.ptr)

    worker.run_sync(dereg)


def rdma_problem(url: str) -> str | None:
    """Why an ``rdma://HOST:PORT`` listener or connection cannot open here, or None."""
    from .devices import discover

    report = discover()
    if not report.usable:
        return f"{url}: no RDMA device with an ACTIVE port: {report.reason}"
    if (p := memlock_problem()) is not None:
        return f"{url}: {p}"
    return None
