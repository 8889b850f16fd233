"""Two "hosts" on one machine: network namespaces, veth rails, tc rate limits.

Shared by the multi-host test (``tests/netns/test_multihost.py``) and the rails
benchmark (:mod:`benchmarks.engine_rails`), so both build the same topology::

            root namespace (the test or benchmark process: the RPC client)
               | tdm<tag>a                          | tdm<tag>b
               | 198.19.X.1/30  (management)        | 198.19.X.5/30
               | mgmt 198.19.X.2/30                 | mgmt 198.19.X.6/30
         +-----+--------------+              +------+-------------+
         |  netns  ...-a      | rail0 ------ |  netns  ...-b      |
         |  198.18.0.1/30     |  (veth, tc)  |  198.18.0.2/30     |
         |  198.18.1.1/30     | rail1 ------ |  198.18.1.2/30     |
         |  ...               |   ...        |  ...               |
         +--------------------+              +--------------------+

Each rail is one veth pair between the two namespaces (addresses from
198.18.0.0/15, rail ``r`` is 198.18.r.1 <-> 198.18.r.2), limited by a ``tbf``
qdisc to the same rate on both ends.  The daemons' client RPC port listens on
the namespace's end of a management veth (a random /30 in 198.19.0.0/16, not
rate limited), so the caller talks to both daemons from the root namespace
while all peer traffic crosses the rails.  Names carry the creating PID and a
random tag; :meth:`Topology.close` deletes both namespaces (which deletes
every veth), and :func:`sweep_stale` removes those left by a process that no
longer exists.  Nothing here leaves the machine.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "transferd-"
MGMT_NET = ipaddress.ip_network("198.19.0.0/16")
MAX_RAILS = 4
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-[0-9a-f]+-[ab]$")


class NetnsUnavailable(RuntimeError):
    """This machine (or this user) cannot build the topology; the message says why."""


def _run(argv: Sequence[str], timeout: float = 10.0) -> str:
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{' '.join(argv)}: {exc}") from None
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None when they can (tries one for real)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or the test is skipped)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-a"
    try:
        _run(["ip", "netns", "add", name])
    except RuntimeError as exc:
        return f"`ip netns add` fails here: {exc}"
    try:
        _run(["ip", "-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"])
        _run(["tc", "-n", name, "qdisc", "add", "dev", "probe0", "root", "tbf", "rate", "100mbit",
              "burst", "128kb", "latency", "50ms"])
    except RuntimeError as exc:
        return f"veth pairs or tc qdiscs cannot be made in a namespace: {exc}"
    finally:
        with contextlib.suppress(RuntimeError):
            _run(["ip", "netns", "del", name])
    return None


def sweep_stale() -> list[str]:
    """Delete namespaces this module made in a process that is gone; returns their names."""
    removed = []
    with contextlib.suppress(RuntimeError):
        for line in _run(["ip", "netns", "list"]).splitlines():
            name = line.split()[0] if line.strip() else ""
            m = _NAME.match(name)
            if m and not Path(f"/proc/{m.group(1)}").exists():
                with contextlib.suppress(RuntimeError):
                    _run(["ip", "netns", "del", name])
                    removed.append(name)
    return removed


@dataclass
class Host:
    """One side: a namespace, its rail addresses and its management address."""

    ns: str
    rails: list[str]
    mgmt: str

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def engine_config(self, rails: int, directory: str | os.PathLike[str],
                      extra: str = "") -> Path:
        """A daemon config whose host domain group uses the first ``rails`` rails."""
        if not 1 <= rails <= len(self.rails):
            raise ValueError(f"{rails} rails asked of a host with {len(self.rails)}")
        path = Path(directory) / f"{self.ns}-{rails}rails.toml"
        listed = ", ".join(f'"{a}"' for a in self.rails[:rails])
        # Rails beyond loopback need the cluster secret: one file for the topology.
        secret = Path(directory) / "cluster.secret"
        if not secret.exists():
            secret.write_text("netns benchmark secret\n")
            secret.chmod(0o600)
        path.write_text(f"[engine]\nhost_rails = [{listed}]\nsecret_file = \"{secret}\"\n"
                        f"{extra}")
        return path

    def daemon_argv(self, config: str | os.PathLike[str], *args: str,
                    command: Sequence[str] | None = None) -> list[str]:
        """``rpc-server`` in this namespace, its RPC port on the management address.

        ``command`` is how to start it (default: the ``rpc-server`` beside this
        Python, else ``python -m rpc_server.cli``).
        """
        if command is None:
            exe = Path(sys.executable).parent / "rpc-server"
            command = [str(exe)] if exe.exists() else [sys.executable, "-m", "rpc_server.cli"]
        return self.exec_argv([*command, "-c", str(config), "-H", self.mgmt, "-p", "0",
                               "--metrics-port", "-1", *args])


@dataclass
class Topology:
    """Two namespaces joined by ``rails`` rate-limited veth rails (see the module doc).

    ``with Topology(rails=2, rate_mbit=300) as topo:`` builds it, and deletes
    it on the way out whatever happened; ``rate_mbit=None`` leaves rails
    unlimited.  ``topo.a`` and ``topo.b`` are the two :class:`Host` s.
    """

    rails: int = 2
    rate_mbit: float | None = 300.0
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    a: Host = field(init=False)
    b: Host = field(init=False)
    workdir: str = field(init=False, default="")
    _made: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.rails <= MAX_RAILS:
            raise ValueError(f"1 to {MAX_RAILS} rails, not {self.rails}")
        base = f"{PREFIX}{os.getpid()}-{self.tag}"
        self.a = Host(f"{base}-a", [f"198.18.{r}.1" for r in range(self.rails)], "")
        self.b = Host(f"{base}-b", [f"198.18.{r}.2" for r in range(self.rails)], "")

    # -- building -------------------------------------------------------------------

    def create(self) -> Topology:
        sweep_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix=f"{PREFIX}{self.tag}-")
        for h in (self.a, self.b):
            try:
                _run(["ip", "netns", "add", h.ns])
            except RuntimeError as exc:
                raise NetnsUnavailable(str(exc)) from None
            self._made.append(h.ns)
            _run(["ip", "-n", h.ns, "link", "set", "lo", "up"])
        for r in range(self.rails):
            dev = f"rail{r}"
            _run(["ip", "link", "add", dev, "netns", self.a.ns, "type", "veth",
                  "peer", "name", dev, "netns", self.b.ns])
            for h in (self.a, self.b):
                _run(["ip", "-n", h.ns, "addr", "add", f"{h.rails[r]}/30", "dev", dev])
                _run(["ip", "-n", h.ns, "link", "set", dev, "up"])
                if self.rate_mbit is not None:
                    self._limit(h.ns, dev, self.rate_mbit)
        self._management()

    @staticmethod
    def _limit(ns: str, dev: str, mbit: float) -> None:
        # The bucket must hold a whole GSO segment (64 KiB) and a couple of ms at rate.
        burst = max(128 * 1024, int(mbit * 1e6 / 8 * 0.002))
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
              "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "50ms"])

    def _management(self) -> None:
        """A veth from the root namespace to each host, on a /30 nobody here uses."""
        used = _run(["ip", "-4", "-o", "addr", "show"])
        rng = random.Random(secrets.randbits(64))
        for _ in range(64):
            block = rng.randrange(MGMT_NET.num_addresses // 8) * 8
            base = MGMT_NET.network_address + block
            if any(str(base + k) in used for k in range(8)):
                continue
            for h, off, side in ((self.a, 0, "a"), (self.b, 4, "b")):
                root_dev = f"tdm{self.tag}{side}"
                _run(["ip", "link", "add", root_dev, "type", "veth",
                      "peer", "name", "mgmt", "netns", h.ns])
                _run(["ip", "addr", "add", f"{base + off + 1}/30", "dev", root_dev])
                _run(["ip", "link", "set", root_dev, "up"])
                h.mgmt = str(base + off + 2)
                _run(["ip", "-n", h.ns, "addr", "add", f"{h.mgmt}/30", "dev", "mgmt"])
                _run(["ip", "-n", h.ns, "link", "set", "mgmt", "up"])
            return
        raise RuntimeError("no free management subnet in 198.19.0.0/16")

    # -- reading ----------------------------------------------------------------------

    def tc_stats(self, host: Host, rail: int) -> str:
        return _run(["tc", "-n", host.ns, "-s", "qdisc", "show", "dev", f"rail{rail}"])

    def rail_bytes(self, host: Host, rail: int) -> int:
        """Bytes sent by ``host`` on ``rail`` (the veth's tx counter)."""
        out = _run(["ip", "-n", host.ns, "-s", "link", "show", f"rail{rail}"])
        lines = out.splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("TX:") and i + 1 < len(lines):
                return int(lines[i + 1].split()[0])
        raise RuntimeError(f"no TX counter in: {out}")

    # -- teardown ---------------------------------------------------------------------

    def close(self) -> None:
        """Delete both namespaces (their veths go with them) and the config folder."""
        for ns in self._made:
            with contextlib.suppress(RuntimeError):
                _run(["ip", "netns", "del", ns])
        self._made.clear()
        # A root-side management veth whose peer namespace is gone is gone too; be sure.
        for side in "ab":
            with contextlib.suppress(RuntimeError):
                _run(["ip", "link", "del", f"tdm{self.tag}{side}"])
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = ""

    def __enter__(self) -> Topology:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()
