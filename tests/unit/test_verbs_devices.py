"""RDMA discovery and the verbs Domain's start-up checks, on this machine as it is.

No machine here has an RDMA device: these tests check that the daemon, ``transferd
devices`` and ``check-config`` say so plainly, naming what is missing.  On a machine
with devices, the tests of the "none" case skip (tests/rdma/ runs there).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from transferd.domains.verbs import bind
from transferd.rdma.devices import DeviceInfo, DevicesReport, PortInfo, discover
from transferd.rdma.loader import VerbsUnavailable, memlock_problem, pyverbs_missing

REPORT = discover()
NONE_HERE = pytest.mark.skipif(bool(REPORT.devices), reason="this machine has RDMA devices")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "transferd.cli", *args], capture_output=True,
                          text=True, timeout=60)


@NONE_HERE
def test_discover_says_why_there_are_none() -> None:
    assert not REPORT.usable and REPORT.devices == []
    assert REPORT.reason is not None
    if pyverbs_missing() is None:
        assert "no RDMA devices" in REPORT.reason and "/sys/class/infiniband" in REPORT.reason
    else:
        assert "pyverbs" in REPORT.reason
    assert "rdma_rxe" in REPORT.reason  # and whether soft-RoCE could give one
    assert "no RDMA devices" in REPORT.text()


def test_a_kernel_device_without_a_provider_is_named(tmp_path: Path) -> None:
    """/sys/class/infiniband lists a device, libibverbs none: the provider is missing."""
    if pyverbs_missing() is not None or REPORT.devices:
        pytest.skip(pyverbs_missing() or "this machine's libibverbs lists devices")
    (tmp_path / "mlx5_0").mkdir()
    r = discover(sysfs=tmp_path)
    assert r.reason is not None and "mlx5_0" in r.reason and "provider" in r.reason


def test_memlock_problem_names_the_limit() -> None:
    msg = memlock_problem(need=1 << 62)
    import resource

    if resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY:
        assert msg is None
    else:
        assert msg is not None and "RLIMIT_MEMLOCK" in msg and "LimitMEMLOCK" in msg


def test_report_text_and_json_of_a_device() -> None:
    r = DevicesReport([DeviceInfo("mlx5_0", 1, "0x1", "28.39", [PortInfo(
        1, "ACTIVE", "Ethernet", 0, 4096, 1 << 30)], ["eth0"])], memlock=None)
    assert r.usable and r.reason is None
    assert "mlx5_0: NUMA node 1" in r.text() and "port 1: ACTIVE, Ethernet" in r.text()
    assert json.loads(json.dumps(r.to_dict()))["usable"] is True


@NONE_HERE
def test_transferd_devices_exits_1_and_says_why() -> None:
    p = run("devices")
    assert p.returncode == 1, p.stderr
    assert "no RDMA devices" in p.stdout and "why:" in p.stdout
    j = json.loads(run("devices", "--json").stdout)
    assert j["usable"] is False and j["devices"] == [] and j["reason"]


def test_preflight_refuses_verbs_without_devices_list() -> None:
    with pytest.raises(VerbsUnavailable, match=r"rdma_devices|pyverbs"):
        bind.preflight([])


@NONE_HERE
def test_serve_with_verbs_and_no_device_stops_at_start_naming_it(tmp_path: Path) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text('[server]\nport = 0\n[metrics]\nenabled = false\n'
                   '[engine]\ndomain = "verbs"\nrdma_devices = ["mlx5_0"]\n')
    p = run("serve", "-c", str(cfg))
    assert p.returncode == 3, (p.stdout, p.stderr)  # Exit.CONFIG: nothing started
    assert "cannot start: engine.domain: verbs:" in p.stderr
    assert ("no RDMA devices" in p.stderr) or ("pyverbs" in p.stderr)
    assert "listening" not in p.stdout
    c = run("check-config", str(cfg))
    assert c.returncode == 3 and "engine.domain: verbs:" in c.stderr


def test_verbs_needs_one_device_per_rail(tmp_path: Path) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text('[engine]\ndomain = "verbs"\nhost_rails = ["127.0.0.1", "127.0.0.2"]\n'
                   'rdma_devices = ["mlx5_0"]\n')
    c = run("check-config", "--other-node", str(cfg))
    assert c.returncode == 3 and "engine.rdma_devices: domain verbs needs one RDMA device " \
        "per rail (2), got 1" in c.stderr


def test_rdma_is_a_registered_message_transport() -> None:
    from transferd import transports

    assert "rdma" in transports.schemes()
    kind = transports.get("rdma://127.0.0.1:1")
    assert kind.kind == "message" and kind.fds is False
    assert transports.parse("rdma://[::1]:7").host == "::1"


@NONE_HERE
def test_an_rdma_listener_without_a_device_stops_the_daemon_naming_it() -> None:
    p = subprocess.run([sys.executable, "-m", "rpc_server.cli", "-H", "127.0.0.1", "-p", "0",
                        "--metrics-port", "0", "--listen", "rdma://127.0.0.1:0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, (p.stdout, p.stderr)
    assert "cannot start: server.listen[0]: rdma://127.0.0.1:0: no RDMA device" in p.stderr
    assert "Traceback" not in p.stderr


@NONE_HERE
def test_an_rdma_client_without_a_device_is_refused_before_any_connection() -> None:
    import asyncio

    from client import Client
    from transferd.protocol.errors import BadRequest

    async def go() -> None:
        # Nothing listens on port 9: the refusal comes before any connection is tried.
        with pytest.raises(BadRequest, match=r"no RDMA device|pyverbs is not importable"):
            await Client.connect("rdma://127.0.0.1:9")

    asyncio.run(go())


def test_verbs_is_a_registry_entry_and_a_domain() -> None:
    """verbs is made by the registry like tcp; where pyverbs or a device is missing,
    asking for it fails naming what, before anything listens."""
    import asyncio

    from transferd.domains import registry
    from transferd.domains.base import Domain, DomainOptions

    assert "verbs" in registry.names() and not registry.is_wrapper("verbs")
    assert registry.parse("verbs") == ["verbs"]
    if pyverbs_missing() is None:
        from transferd.domains.verbs.domain import VerbsDomain

        assert issubclass(VerbsDomain, Domain) and VerbsDomain.name == "verbs"
    if REPORT.usable:
        return
    loop = asyncio.new_event_loop()
    try:
        class Group:  # only the loop is read before the device is opened
            pass

        g = Group()
        g.loop = loop  # type: ignore[attr-defined]
        with pytest.raises(VerbsUnavailable, match=r"rdma_devices|pyverbs"):
            registry.create("verbs", g, 0, "127.0.0.1", 0, DomainOptions())  # type: ignore[arg-type]
        opts = DomainOptions(settings={"verbs": {"devices": ["mlx5_0"]}})
        with pytest.raises(VerbsUnavailable, match=r"RDMA|pyverbs|device|mlx5_0|MEMLOCK"):
            registry.create("verbs", g, 0, "127.0.0.1", 0, opts)  # type: ignore[arg-type]
    finally:
        loop.close()


def test_devices_say_how_a_verbs_rail_reaches_gpu_memory() -> None:
    from transferd.rdma.devices import discover, gpu_memory_path, peer_memory_loaded

    report = discover()
    path = gpu_memory_path()
    assert report.gpu_memory == path and f"GPU memory: {path}" in report.text()
    assert report.to_dict()["gpu_memory"] == path
    if peer_memory_loaded() is None:  # this project's machines
        assert path.startswith("no GPUDirect RDMA") and "staging" in path
    else:
        assert path.startswith("GPUDirect RDMA") and "registered with every NIC" in path
