"""Paged writes of many tiny pages (scatters of many destinations) to a peer that has
stopped: the plans they hold.

A PAGED_WRITES (or PAGED_READS) plans a view and an address per page when it is
submitted and holds them until it ends: about 256 bytes a page, whatever the size of
the memory it moves, charged to nothing. 100 PAGED_WRITES of 65,536 one-byte pages from
a 64 KiB buffer to a SIGSTOPped peer took the sender +1,638 MiB; one connection may have
1,024 in flight (engine.max_inflight_per_client), and a client may open many. 100
SCATTERs of 4,096 one-byte destinations: +395 MiB.
"""

from __future__ import annotations

import os
import signal
import threading

from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, rss, wait_until
from tests.integration.engine_cluster import engine_env, secret_file
from transferd.protocol.constants import Command, Flag
from transferd.protocol.frames import encode_frame

PAGES = 65536
CAP = 150_000  # two such writes, not three


def _rss_mib(d: DaemonProcess) -> float:
    return rss(d) / (1 << 20)


def test_pages_in_flight_are_capped_over_every_transfer(daemon_factory: DaemonFactory) -> None:
    env = engine_env(["127.0.0.1"], "tcp", secret_file=secret_file(), peer_timeout_s=30)
    a = daemon_factory(env={**env, "TRANSFERD_ENGINE_MAX_PAGES_IN_FLIGHT": str(CAP)})
    b = daemon_factory(env=env)
    assert b.proc is not None
    rb = RawConn.to(b, timeout=10)
    rb.hello()
    bbuf = rb.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": PAGES}).body["buffer"]
    desc = rb.request(Command.REG_MR, {"buffer": bbuf, "access": "rw"}).body["desc"]
    ra = RawConn.to(a, timeout=60)
    ra.hello()
    abuf = ra.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": PAGES}).body["buffer"]
    mr = ra.request(Command.REG_MR, {"buffer": abuf}).body["mr"]
    idx = list(range(PAGES))
    write = {"page_len": 1, "imm": None, "src": [mr, [idx, 1, 0]], "dst": [desc, [idx, 1, 0]]}
    assert not ra.request(Command.PAGED_WRITES, write).is_error  # linked
    assert ra.recv().body == {"ok": True}
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        before = _rss_mib(a)
        n = 40
        wire = [encode_frame(Command.PAGED_WRITES, Flag.NO_REPLY, 100 + i, write)
                for i in range(n)]
        t = threading.Thread(target=lambda: [ra.send_raw(x) for x in wire], daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive()
        sync = ra.send(Command.IMM_COUNT, {"imm": 1}, seq=99)  # answered after the 40
        refused = []
        while True:
            f = ra.recv()
            if f.seq == sync and not f.is_event:
                break
            assert f.is_error, f
            refused.append(f"{f.body['code']}: {f.body['message']}")
        assert len(refused) == n - 2, (len(refused), refused[:2])
        assert all(r.startswith("TOO_LARGE") and "engine.max_pages_in_flight" in r
                   for r in refused), refused[:2]
        # A PAGED_READS counts too.
        read = {"page_len": 1, "dst": [mr, [idx, 1, 0]], "src": [desc, [idx, 1, 0]]}
        f = ra.request(Command.PAGED_READS, read)
        assert f.is_error and "engine.max_pages_in_flight" in f.body["message"], f
        # So do a SCATTER's destinations: 4 of 4,096 fit under the cap beside the two
        # writes (147,456), the fifth does not.
        dsts = [[1, i, desc, i] for i in range(4096)]
        for i in range(5):
            ra.send(Command.SCATTER, {"group": None, "imm": None, "mr": mr, "dsts": dsts},
                    flags=Flag.NO_REPLY, seq=200 + i)
        sync = ra.send(Command.IMM_COUNT, {"imm": 1}, seq=98)
        f = ra.recv()
        assert f.is_error and f.seq == 204 and "engine.max_pages_in_flight" in \
            f.body["message"] and "SCATTER of 4096 destinations" in f.body["message"], f
        assert ra.recv().seq == sync
        grew = _rss_mib(a) - before
        assert grew < 160, f"the sender grew {grew:.0f} MiB (40 writes: about 650 before)"
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    # The two writes and four scatters in flight land and end: their pages and
    # destinations are counted out, a write fits again.
    done = 0
    while done < 6:
        f = ra.recv()
        assert f.is_event and f.body == {"ok": True}, f
        done += 1

    def fits() -> bool:
        f = ra.request(Command.PAGED_WRITES, write)
        if f.is_error:
            return False
        assert ra.recv().body == {"ok": True}
        return True

    assert wait_until(fits, 20, interval=0.2)
