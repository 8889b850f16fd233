"""Writes from GPU memory over verbs (#24.3): the source is copied into its group's
staging, which every NIC of the group registered, and the bytes land checksummed in the
peer.  Needs an RDMA device with an ACTIVE port, a CUDA device and GPUDirect RDMA
(nvidia-peermem: without it a GPU buffer cannot be registered on verbs, docs/rdma.md);
skipped with the reason where one is missing (``make rdma-check`` on such a machine)."""

from __future__ import annotations

import hashlib
import os

import pytest

from client import Client
from tests.gpu.gpu_common import COUNT, NO_GPU_REASON, gpu_daemon
from tests.helpers import DaemonProcess, async_test
from tests.integration.engine_cluster import HANDSHAKE_TIMEOUT_S, engine_env, secret_file
from transferd.rdma.devices import peer_memory_loaded

from .conftest import DEVICES, needs_rdma

pytestmark = [
    pytest.mark.rdma, pytest.mark.gpu, needs_rdma,
    pytest.mark.skipif(not COUNT, reason=NO_GPU_REASON),
    pytest.mark.skipif(peer_memory_loaded() is None,
                       reason="no GPUDirect RDMA: nvidia-peermem is not loaded"),
]

MiB = 1 << 20


def _verbs_env(host: str, device: str) -> dict[str, str | None]:
    env = engine_env([host], "verbs", rdma_devices=device, secret_file=secret_file(),
                     handshake_timeout_s=HANDSHAKE_TIMEOUT_S)
    return dict(env)


@async_test(timeout=180)
async def test_a_write_from_gpu_memory_over_verbs_lands_whole() -> None:
    dev_a, dev_b = (DEVICES * 2)[:2]
    a: DaemonProcess = gpu_daemon(env=_verbs_env("127.0.0.2", dev_a))
    b: DaemonProcess = gpu_daemon(device="cpu", env=_verbs_env("127.0.0.4", dev_b))
    with a, b:
        async with await Client.connect(a.url) as ca, await Client.connect(b.url) as cb:
            src = await ca.alloc_buffer(8 * MiB, device="cuda:0")
            dst = await cb.alloc_buffer(8 * MiB)
            data = os.urandom(8 * MiB)
            await ca.set_tensor(src.tensor(), data)
            mr, _ = await ca.reg_mr(src)  # the staging pool registered with the NIC
            _, desc = await cb.reg_mr(dst)
            for off in (0, 4 * MiB):  # one staging chunk per single write
                w = await ca.submit_single_write(4 * MiB, 91, (mr, off), (desc, off))
                await w.wait(60)  # was: no lkey for the staging chunk, always failed
            await cb.expect_imm_count(91, 2)
            got = await cb.get_tensor(dst.tensor())
            assert hashlib.sha256(got).hexdigest() == hashlib.sha256(data).hexdigest()
