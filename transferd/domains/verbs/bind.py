"""The verbs Domain's registry entry: its factory, and the checks before a device opens.

The registry calls :func:`create` once per rail on the group's worker, as it makes tcp
rails; the devices come from the Domain's own settings (``DomainOptions.of("verbs")``,
filled from engine.rdma_devices / rdma_port / rdma_gid_index).  Raises
:class:`~.loader.VerbsUnavailable` naming what is missing (pyverbs, a device, an active
port, the memlock limit) before anything listens, so a daemon asked for verbs where
there is none stops at start with that message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transferd.rdma.loader import VerbsUnavailable, load_pyverbs, memlock_problem

from . import NAME

if TYPE_CHECKING:
    from transferd.domains.base import Domain, DomainOptions, Port


def preflight(devices: list[str]) -> None:
    """Everything that can be checked before opening a device, with its reason."""
    load_pyverbs()
    if not devices:
        raise VerbsUnavailable('engine.domain = "verbs" needs engine.rdma_devices '
                               "(`transferd devices` lists them)")
    if (p := memlock_problem()) is not None:
        raise VerbsUnavailable(p)


class _Create:
    """The registry's factory for ``verbs`` (a callable that also says what the Domains
    it makes can do, without a device)."""

    @property
    def capabilities(self) -> Any:
        from transferd.domains.base import Capabilities

        # The NIC places writes, counts immediates and serves READs (reads.py);
        # no device memory yet.
        return Capabilities(sees_writes=False, counts_immediates=True, device_memory=False,
                            reads=True, rdma=True)

    def __call__(self, port: Port, rail: int, host: str, port_number: int,
                 options: DomainOptions) -> Domain:
        """Rail ``rail`` listens for set-up on ``host`` and uses
        ``options.of("verbs")["devices"][rail]`` (engine.rdma_devices), its port
        ``port`` (engine.rdma_port) and GID index ``gid_index`` (-1 or absent: one is
        picked)."""
        settings = options.of(NAME)
        devices = [str(d) for d in settings.get("devices", ())]
        preflight(devices)
        if rail >= len(devices):
            raise VerbsUnavailable(f"engine.rdma_devices names {len(devices)} device(s); "
                                   f"rail {rail} has none")
        from .domain import VerbsDomain

        gid = int(settings.get("gid_index", -1))
        return VerbsDomain(port, rail, host, port_number, device=devices[rail],
                           ib_port=int(settings.get("port", 1)),
                           gid_index=None if gid < 0 else gid)


    @staticmethod
    def config_problems(engine: Any) -> list[str]:
        """The [engine] keys of verbs, checked against each other (no device touched)."""
        rails = max(1, len(engine.host_rails))
        if len(engine.rdma_devices) != rails:
            return [f"engine.rdma_devices: domain verbs needs one RDMA device per rail "
                    f"({rails}), got {len(engine.rdma_devices)} "
                    "(`transferd devices` lists them)"]
        return []

    @staticmethod
    def machine_problems(engine: Any) -> list[tuple[str, str]]:
        return machine_problems(list(engine.rdma_devices), engine.rdma_port)


create = _Create()


def machine_problems(devices: list[str], port: int) -> list[tuple[str, str]]:
    """(config key, message) for each reason this machine cannot run the verbs Domain
    as configured: what ``transferd serve`` and ``check-config`` report before start."""
    from transferd.rdma.devices import discover

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
