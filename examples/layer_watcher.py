#!/usr/bin/env python3
"""The TransferEngine article's layer-by-layer KV-cache transfer, with a UVM watcher.

A prefill node computes a model layer by layer.  After each layer it bumps a
watcher word (on a GPU: a kernel stores the number of finished layers into
the mapped word, also from inside a CUDA graph); the watcher's callback
submits that layer's pages as one paged write to the decode node, with one
immediate per layer, while later layers are still being computed.  The
decode node learns that a layer is complete from its ImmCounter.

Run it from the checkout (it starts two daemons itself, on loopback)::

    python3 examples/layer_watcher.py [--layers 8] [--pages 16] [--page-kib 16] [--cuda]

``--cuda`` makes a CUDA kernel do the bump through ``UvmWatcher.device_pointer()``
(needs CuPy and a device); without it a host store stands in for the kernel.
It prints, per layer, the time from the bump to the decode node having the
layer's pages counted, and checks every byte with a checksum.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from client import Client, Pages  # noqa: E402
from client.watchers import BUMP_KERNEL  # noqa: E402
from examples.local_daemons import local_daemons  # noqa: E402

IMM0 = 0x1A7E0000


class KernelBump:
    """The bump a GPU kernel does: one volatile store and a system-wide fence."""

    def __init__(self, device_ptr: int) -> None:
        import cupy

        self.cupy = cupy
        self.kernel = cupy.RawKernel(BUMP_KERNEL, "transferd_bump")
        self.ptr = device_ptr
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def __call__(self, value: int) -> None:
        import numpy as np

        with self.stream:
            self.kernel((1,), (1,), (np.uint64(self.ptr), np.uint64(value)))


async def run(layers: int, pages: int, page_len: int, use_cuda: bool) -> dict[str, object]:
    layer_bytes = pages * page_len
    with local_daemons(2) as (url_a, url_b):
        a = await Client.connect(url_a)       # the prefill node's engine client
        b = await Client.connect(url_b)       # the decode node's
        model = await Client.connect(url_a)   # the "model": writes each layer's KV
        kv_a = await a.alloc_buffer(layers * layer_bytes)
        kv_b = await b.alloc_buffer(layers * layer_bytes)
        mr_a, _ = await a.reg_mr(kv_a)
        _, desc_b = await b.reg_mr(kv_b)
        bumped: dict[int, float] = {}
        submits = []

        def layer_done(old: int, new: int) -> None:
            # The word counts finished layers; a change may cover several.
            for layer in range(old, new):
                idx = [layer * pages + k for k in range(pages)]
                submits.append(asyncio.ensure_future(a.submit_paged_writes(
                    page_len, IMM0 + layer, (mr_a, Pages(idx, page_len)),
                    (desc_b, Pages(idx, page_len)))))

        watcher = await a.alloc_uvm_watcher(layer_done)
        bump = KernelBump(watcher.device_pointer()) if use_cuda else watcher.set
        arrived: dict[int, float] = {}
        waits = []
        for layer in range(layers):
            c = await b.expect_imm_count(IMM0 + layer, pages, wait=False)
            c.add_done_callback(lambda _c, n=layer: arrived.setdefault(n, time.monotonic()))
            waits.append(c)
        digests = []
        for layer in range(layers):
            data = os.urandom(layer_bytes)  # this layer's KV, "computed"
            digests.append(hashlib.sha256(data).hexdigest())
            await model.set_tensor(kv_a.tensor(layer * layer_bytes, layer_bytes), data)
            bumped[layer] = time.monotonic()
            bump(layer + 1)
            await asyncio.sleep(0.005)  # the next layer's compute
        for c in waits:
            await asyncio.wait_for(c.wait(), 30)
        for s in submits:
            await asyncio.wait_for((await s).wait(), 30)
        got = [hashlib.sha256(await b.get_tensor(kv_b.tensor(n * layer_bytes, layer_bytes)))
               .hexdigest() for n in range(layers)]
        for c in (a, b, model):
            await c.close()
    lat_ms = [(arrived[n] - bumped[n]) * 1000 for n in range(layers)]
    return {"layers": layers, "pages": pages, "page_len": page_len,
            "bump": "cuda kernel" if use_cuda else "host store",
            "ok": got == digests, "bump_to_counted_ms": lat_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument("--cuda", action="store_true", help="bump from a CUDA kernel")
    args = ap.parse_args()
    r = asyncio.run(run(args.layers, args.pages, args.page_kib * 1024, args.cuda))
    for n, ms in enumerate(r["bump_to_counted_ms"]):  # type: ignore[arg-type]
        print(f"layer {n}: bump -> {r['pages']} pages counted on the decode node in {ms:.2f} ms")
    print("checksums:", "all layers match" if r["ok"] else "MISMATCH")
    sys.exit(0 if r["ok"] else 1)


if __name__ == "__main__":
    main()
