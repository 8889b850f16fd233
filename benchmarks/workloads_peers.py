"""The workloads on NIXL: the same pattern through another engine, where it has the pieces.

Run in the benchmark-only venv (``$TRANSFERD_BENCH_VENV`` or ``.bench-venv``) as roles of
:mod:`benchmarks.workloads_common`; NIXL is never a dependency of transferd.  A
``nixl_agent`` with the UCX backend (``UCX_TLS=tcp`` on ``lo``, set by the caller, as
:mod:`benchmarks.engine_peers` does), memory registered as ``DRAM``, agents' metadata
handed over by the benchmark.  NIXL's notification carries a transfer's completion to its
target (it arrives once the transfer's data is in place), which is what an immediate and
a barrier do here:

- KV (``nixl-prefill`` / ``nixl-decode``): per layer one WRITE of the layer's 64 pages
  (descriptor lists prepared before the request, as a NIXL user prepares them), posted at
  the layer's bump with the layer's number as its notification; the prefill polls its
  transfers between bumps; the decode polls notifications from a thread of its own and
  counts a layer usable when its notification is seen.  ``UCX_RNDV_THRESH=inf`` (set by
  the benchmark): otherwise each 16 KiB page takes a rendezvous of its own.
- RL (``nixl-trainer`` / ``nixl-receiver``): per node one WRITE of every shard (prepared
  once, reposted per update) with a notification, all nodes' posted at once, polled to the
  end; a node's update is in when its notification is seen (the barrier).  One UCX
  endpoint per node pair (no rails of its own).

The pages, shards and checksums are the examples' (``examples/kv_cache.py``,
``weight_update.py``), so every byte is checked the same way as on the other arms.
"""

from __future__ import annotations

import random
import threading
import time
import zlib
from typing import Any

from .engine_peers import Buffer

WAIT_S = 120.0
POLL_S = 1e-3  # a target's progress loop while nothing is expected (links, handshakes)
EXPECT_POLL_S = 20e-6  # ... and while a transfer is expected (a sleep: UCX has threads too)


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    # Not NIXL's own progress thread: it spins (most of a CPU per agent here, idle or not,
    # measured), which on this 2-CPU machine starves the agent's own work and every other
    # arm's.  A node progresses in :class:`_Progress` instead (UCX over TCP needs the
    # target to), and the initiator while it polls its transfers.
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise RuntimeError(f"no UCX backend (plugins: {agent.get_plugin_list()})")
    return agent


class _Node:
    """An agent and its registered memory; a target's progresses in a thread of its own
    (an initiator's only in the calls it makes: the agent is not called from two threads)."""

    def __init__(self, name: str, size: int, target: bool) -> None:
        self.agent = _agent(f"{name}-{random.getrandbits(32):08x}")
        self.buf = Buffer(size, False)
        self.agent.register_memory([(self.buf.ptr, size, 0, "")], "DRAM")
        self.progress = _Progress(self.agent) if target else None

    def expect(self) -> None:
        assert self.progress is not None
        self.progress.expecting = True

    def take(self, n: int) -> dict[bytes, int]:
        assert self.progress is not None
        return self.progress.take(n)

    def ready(self) -> dict[str, Any]:
        return {"meta": self.agent.get_agent_metadata().hex(), "addr": self.buf.ptr}

    def xfer(self, remote: str, pairs: list[tuple[int, int, int]], notif: bytes) -> Any:
        """A WRITE of (local offset, remote address, length) pieces."""
        local = self.agent.get_xfer_descs([(self.buf.ptr + o, n, 0) for o, _, n in pairs],
                                          "DRAM")
        far = self.agent.get_xfer_descs([(a, n, 0) for _, a, n in pairs], "DRAM")
        return self.agent.initialize_xfer("WRITE", local, far, remote, notif)

    def finish(self, handles: list[Any], deadline: float) -> list[int]:
        """Poll every transfer to DONE; when each was seen done (monotonic ns)."""
        done = [0] * len(handles)
        while not all(done):
            for i, h in enumerate(handles):
                if not done[i]:
                    state = self.agent.check_xfer_state(h)
                    if state == "DONE":
                        done[i] = time.monotonic_ns()
                    elif state != "PROC":
                        raise RuntimeError(f"NIXL transfer ended in state {state}")
            if time.monotonic() > deadline:
                raise TimeoutError("NIXL transfers not done in time")
        return done


class _Progress:
    """A node's progress loop: polls the agent (which progresses UCX) and times each
    notification seen, every ``EXPECT_POLL_S`` while a transfer is expected (a spin would
    starve UCX's own thread on the node's one CPU: 50-80 ms a layer, measured) and every
    ``POLL_S`` otherwise; ``take`` waits for ``n`` notifications and consumes them."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.cond = threading.Condition()
        self.seen: list[tuple[bytes, int]] = []
        self.expecting = False
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while True:
            got = self.agent.get_new_notifs()
            if got:
                t = time.monotonic_ns()
                with self.cond:
                    self.seen += [(bytes(m), t) for msgs in got.values() for m in msgs]
                    self.cond.notify_all()
            time.sleep(EXPECT_POLL_S if self.expecting else POLL_S)

    def take(self, n: int) -> dict[bytes, int]:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.seen) >= n, WAIT_S):
                raise TimeoutError(f"{len(self.seen)} of {n} notifications")
            got, self.seen = self.seen[:n], self.seen[n:]
            self.expecting = False
        return dict(got)


def _connect(node: _Node, meta: str, addr: int) -> Any:
    """Add the remote agent and open the connection with one small write."""
    remote = node.agent.add_remote_agent(bytes.fromhex(meta))
    h = node.xfer(remote, [(0, addr, 4096)], b"")
    node.agent.transfer(h)
    node.finish([h], time.monotonic() + 30)
    return remote


# -- (1) KV --------------------------------------------------------------------------------


def _kv_shape(shape: dict[str, int]) -> Any:
    from examples.kv_cache import KvShape

    return KvShape(**shape)


class NixlDecode:
    def __init__(self, shape: dict[str, int]) -> None:
        self.shape = _kv_shape(shape)

    def setup(self) -> dict[str, Any]:
        self.node = _Node("kv-decode", self.shape.pool_bytes, target=True)
        return self.node.ready()

    def expect(self, seed: int) -> None:
        from examples.kv_cache import plan_request

        self.plan = plan_request(self.shape, seed)
        self.node.expect()

    def wait(self, check: bool) -> dict[str, Any]:
        from examples.kv_cache import layer_digests

        seen = self.node.take(self.shape.layers)
        usable = [seen[str(layer).encode()] for layer in range(self.shape.layers)]
        digests = (layer_digests(self.node.buf.view, self.plan.dst, self.shape.page_len)
                   if check else None)
        return {"usable": usable, "digests": digests}


class NixlPrefill:
    def __init__(self, shape: dict[str, int], meta: str, addr: int) -> None:
        self.shape, self.meta, self.addr = _kv_shape(shape), meta, addr

    def setup(self) -> None:
        self.node = _Node("kv-prefill", self.shape.pool_bytes, target=False)
        self.remote = _connect(self.node, self.meta, self.addr)

    def request(self, seed: int, compute_s: float, check: bool) -> dict[str, Any]:
        from examples.kv_cache import layer_digests, plan_request

        plan = plan_request(self.shape, seed)
        view, page, n = self.node.buf.view, self.shape.page_len, self.shape.layers
        if check:
            view[: self.shape.pool_bytes] = random.Random(seed).randbytes(self.shape.pool_bytes)
        handles = [self.node.xfer(self.remote, [(s * page, self.addr + d * page, page)
                                                for s, d in zip(plan.src[layer], plan.dst[layer],
                                                                strict=True)],
                                  str(layer).encode()) for layer in range(n)]
        agent = self.node.agent
        bump, acked = [], [0] * n
        start = time.monotonic_ns()
        for layer in range(n):
            due = start + round((layer + 1) * compute_s * 1e9)
            while time.monotonic_ns() < due:  # the layer computes; earlier writes progress
                for i in range(layer):
                    if not acked[i] and agent.check_xfer_state(handles[i]) == "DONE":
                        acked[i] = time.monotonic_ns()
            bump.append(time.monotonic_ns())
            if agent.transfer(handles[layer]) == "ERR":
                raise RuntimeError(f"NIXL transfer of layer {layer} failed")
        rest = [i for i in range(n) if not acked[i]]
        for i, t in zip(rest, self.node.finish([handles[i] for i in rest],
                                               time.monotonic() + WAIT_S), strict=True):
            acked[i] = t
        for h in handles:
            agent.release_xfer_handle(h)
        digests = layer_digests(view, plan.src, page) if check else None
        return {"start": start, "bump": bump, "event": bump, "issued": bump, "submitted": bump,
                "acked": acked, "digests": digests}


# -- (2) RL --------------------------------------------------------------------------------


def _rl_shape(shape: dict[str, int]) -> Any:
    from examples.weight_update import WeightShape

    return WeightShape(**shape)


class NixlReceiver:
    def __init__(self, shape: dict[str, int]) -> None:
        self.shape = _rl_shape(shape)

    def setup(self) -> dict[str, Any]:
        self.node = _Node("rl-receiver", self.shape.size, target=True)
        return self.node.ready()

    def expect(self) -> None:
        self.node.expect()

    def wait(self) -> dict[str, Any]:
        return {"arrived": min(self.node.take(1).values())}

    def digests(self) -> dict[str, Any]:
        n, view = self.shape.shard_len, self.node.buf.view
        return {"crcs": [zlib.crc32(view[s * n:(s + 1) * n]) for s in range(self.shape.shards)]}


class NixlTrainer:
    def __init__(self, shape: dict[str, int], metas: list[str], addrs: list[int]) -> None:
        self.shape, self.metas, self.addrs = _rl_shape(shape), metas, addrs

    def setup(self) -> None:
        self.node = _Node("rl-trainer", self.shape.size, target=False)
        n = self.shape.shard_len
        self.handles = []
        for meta, addr in zip(self.metas, self.addrs, strict=True):
            remote = _connect(self.node, meta, addr)
            self.handles.append(self.node.xfer(
                remote, [(s * n, addr + s * n, n) for s in range(self.shape.shards)], b"done"))

    def fill(self, seed: int) -> dict[str, Any]:
        from .workloads_rl import fill_shards

        return {"crcs": fill_shards(self.node.buf.view, self.shape, seed)}

    def update(self, n: int) -> dict[str, Any]:
        start = time.monotonic_ns()
        for h in self.handles[:n]:
            if self.node.agent.transfer(h, b"done") == "ERR":
                raise RuntimeError("NIXL transfer failed")
        done = self.node.finish(self.handles[:n], time.monotonic() + WAIT_S)
        return {"start": start, "written": max(done), "barrier": max(done)}


ROLES = {"nixl-decode": NixlDecode, "nixl-prefill": NixlPrefill,
         "nixl-receiver": NixlReceiver, "nixl-trainer": NixlTrainer}
