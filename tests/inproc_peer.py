"""A process that holds an inproc engine, for tests of what its end leaves behind.

``python -m tests.inproc_peer SECRET_FILE RAIL DESC_HEX IMM WRITES END`` starts an
engine in this process (engine.secret_file SECRET_FILE, one rail on RAIL), writes
WRITES times 64 KiB with immediate IMM into the region DESC_HEX names (an MrDesc's
bytes, hex), registers 1 MiB of its own memory, and prints one JSON line: its
address, that region's MrDesc (hex) and the sha256 of what it wrote.  Then it reads
stdin: on a line or EOF, END ``close`` closes the client and exits 0; END ``exit``
returns without closing it (the interpreter's end takes the sockets); END ``kill``
waits for the test to SIGKILL it; END ``flood`` writes on into that region (8 in
flight, printing ``flooding`` once they flow) until the test SIGKILLs it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys

import numpy as np

from client import Client, MrDesc


async def main(secret: str, rail: str, desc_hex: str, imm: int, writes: int, end: str) -> None:
    c = await Client.connect("inproc://", overrides={
        "engine.secret_file": secret, "engine.host_rails": rail,
        "engine.handshake_timeout_s": 2.0})
    src = np.frombuffer(bytearray(os.urandom(64 * 1024)), dtype=np.uint8)
    sbuf = await c.register_memory(src)  # type: ignore[attr-defined]
    smr, _ = await c.reg_mr(sbuf)
    dst = MrDesc.from_bytes(bytes.fromhex(desc_hex))
    done = [await c.submit_single_write(len(src), imm, (smr, 0), (dst, i * len(src)))
            for i in range(writes)]
    for w in done:
        await w.wait(20)
    mine = np.zeros(1 << 20, dtype=np.uint8)
    buf = await c.register_memory(mine)  # type: ignore[attr-defined]
    _, desc = await c.reg_mr(buf)
    print(json.dumps({"addr": (await c.main_address()).to_bytes().hex(),
                      "desc": desc.to_bytes().hex(),
                      "sha256": hashlib.sha256(src.tobytes()).hexdigest()}),
          flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if end == "close":
        await c.close()
    elif end == "kill":
        await asyncio.sleep(3600)
    elif end == "flood":
        # Writes without end (bounded: 100,000), 8 in flight, until the test kills it.
        window: list = []
        for i in range(100_000):
            window.append(await c.submit_single_write(
                len(src), imm, (smr, 0), (dst, (i % writes) * len(src))))
            if len(window) >= 8:
                await window.pop(0).wait(20)
            if i == 16:
                print("flooding", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], a[1], a[2], int(a[3]), int(a[4]), a[5]))
