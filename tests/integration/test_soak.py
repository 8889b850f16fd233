"""A short soak in the suite (``make soak`` runs the long one): 6 clients, 3 daemons, ~8 s.

Real daemons (subprocesses, two loopback rails each, a cluster secret), the real
client library over tcp, unix, seqpacket and tls, every operation kind of
:mod:`benchmarks.soak`.  The checks run twice: once as the soak left things
(everything must match: no byte, message or immediate lost or duplicated), then
after a tamper behind the soak's back (one byte changed in a region, one message
sent twice, one barrier not accounted for), which the same checks must catch.
"""

from __future__ import annotations

import asyncio
import shutil
import struct
import zlib
from typing import Any

from benchmarks import soak as soak_mod
from benchmarks.soak_report import summary

SECONDS = 8.0


def test_soak_loses_and_duplicates_nothing(tmp_path: Any) -> None:
    clean: dict[str, Any] = {}

    async def check_then_tamper(s: soak_mod.Soak) -> None:
        clean.update(await s.check())
        clean["errors"] = list(s.errors)
        a, b = s.members[0], s.members[1]
        assert b.dst is not None and b.writer is a and a.target_addr is not None
        # One byte of b's region (a's target) changed behind a's mirror.
        old = bytes(await b.client.get_tensor(b.dst.buf.tensor(100, 1)))
        await b.client.set_tensor(b.dst.buf.tensor(100, 1), bytes([old[0] ^ 0xFF]))
        # A barrier a does not account for: its immediate counts once too often.
        await (await a.client.submit_barrier(None, a.imm, [b.dst.desc])).wait(20)
        # A message a already sent, sent again: received twice.
        seq = max(q for (sender, q) in s.sent if sender == a.idx)
        body = b"again"
        msg = struct.pack("<IIII", a.idx, seq, len(body), zlib.crc32(body)) + body
        await (await a.client.submit_send(a.target_addr, msg)).wait(20)
        for _ in range(200):  # the acknowledgement can pass the receiver's event
            if s.received[(a.idx, seq)] == 2:
                break
            await asyncio.sleep(0.01)

    opts = soak_mod.Options(seconds=SECONDS, clients=6, warmup_s=3.0, rss_bound_mib=32,
                            out=str(tmp_path / "soak.json"), plot=str(tmp_path / "soak.png"),
                            before_check=check_then_tamper)
    record = asyncio.run(soak_mod.run(opts))
    print(summary(record))

    # As the soak left it: every byte, message and immediate accounted for.
    assert clean["errors"] == [], clean["errors"]
    assert clean["checksums"]["regions"] == 18
    assert clean["checksums"]["equal"] == 18
    m = clean["messages"]
    assert m["sent"] > 0 and m["lost"] == 0 and m["duplicated"] == 0 and m["corrupt"] == 0
    assert m["received"] == m["sent"]
    i = clean["imm"]
    assert i["expected"] > 0 and i["counted"] == i["expected"]
    # Every transport and every kind ran, and the daemons' memory stayed flat after warm-up.
    want = {"tcp", "unix", "seqpacket"} | ({"tls"} if shutil.which("openssl") else set())
    assert set(record["transports"]) == want, record["transports"]
    assert set(record["ops"]) == set(soak_mod.MIX), record["ops"]
    assert all(r["count"] > 0 and r["p99_us"] > 0 for r in record["ops"].values())
    for name, r in record["memory"].items():
        assert r["passed"], (name, r)
    assert all(v["exit"] == 0 and not v["problems"]
               for v in record["daemons_stopped"].values()), record["daemons_stopped"]

    # After the tamper, the same checks catch each change, and only those.
    c = record["checks"]
    assert c["checksums"]["equal"] == 17
    assert c["messages"]["duplicated"] == 1 and c["messages"]["lost"] == 0
    assert c["imm"]["duplicated"] == 1 and c["imm"]["lost"] == 0
    assert record["error_count"] == 1 and "dst region's checksum differs" in record["errors"][0]
    assert "first differing byte at 100" in record["errors"][0]
    assert not record["passed"]
    # The record and the plot (or the reason there is none) are written.
    assert (tmp_path / "soak.json").exists()
    assert record["plot"] == str(tmp_path / "soak.png") or "matplotlib" in record["plot"]
