"""SENDs to a peer that has stopped: what the sending daemon holds for them.

A SEND's message (up to 1 MiB) is copied into the sending daemon when it is submitted and
held there until the peer acknowledges it or its deadline passes. Nothing counted it: a
client's connection with 1,024 SENDs of 1 MiB in flight to a SIGSTOPped peer took the
sender +808 MiB, three such connections +2,062 MiB (they only wait for room, holding
their messages, past engine.max_inflight_per_client and the worker's slots), and a client
may open as many connections as it likes. Now a message in flight is charged to the host
memory limit (memory.host_limit_mib) as a buffer is, as the receiving side already
charges the messages waiting for a receive: past it a SEND is OUT_OF_MEMORY at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, rss, wait_until
from tests.integration.engine_cluster import engine_env, secret_file
from transferd.protocol.constants import Command, Flag
from transferd.protocol.frames import encode_frame

MiB = 1 << 20
LIMIT_MIB = 96


def _rss_mib(d: DaemonProcess) -> float:
    return rss(d) / (1 << 20)


def test_sends_held_for_a_stopped_peer_are_charged_to_the_memory_limit(
        daemon_factory: DaemonFactory) -> None:
    env = engine_env(["127.0.0.1"], "tcp", secret_file=secret_file(), peer_timeout_s=30)
    a = daemon_factory(["-m", str(LIMIT_MIB)], env=env)
    # (B drops what waits for its one receive after 1 s, not 5: A's charge back sooner)
    b = daemon_factory(env={**env, "TRANSFERD_ENGINE_RECV_WAIT_S": "1"})
    assert b.proc is not None
    rb = RawConn.to(b, timeout=10)
    rb.hello()
    baddr = rb.request(Command.MAIN_ADDRESS, {}).body["addr"]
    assert not rb.request(Command.SUBMIT_RECVS, {"len": MiB, "count": 1}).is_error
    ra = RawConn.to(a, timeout=10)
    ra.hello()
    assert not ra.request(Command.SEND, {"addr": baddr}, b"link").is_error  # linked
    assert ra.recv().body == {"ok": True}
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        before = _rss_mib(a)
        msg = b"m" * MiB
        refused: list[str] = []
        senders = []
        for _ in range(3):
            c = RawConn.to(a, timeout=60)
            c.hello()
            wire = [encode_frame(Command.SEND, Flag.NO_REPLY, 10 + i, {"addr": baddr},
                                 len(msg)) + msg for i in range(100)]
            t = threading.Thread(target=lambda c=c, w=wire: [c.send_raw(x) for x in w],
                                 daemon=True)
            t.start()
            senders.append((c, t))
        for c, t in senders:
            t.join(60)
            assert not t.is_alive(), "the daemon stopped reading a client's SENDs"
            c.sock.settimeout(0.5)
            while True:  # the refusals so far (EVENT|ERROR; completions come later)
                try:
                    f = c.recv()
                except (TimeoutError, OSError):
                    break
                if f.is_error:
                    refused.append(f"{f.body['code']}: {f.body['message']}")
        grew = _rss_mib(a) - before
        assert grew < LIMIT_MIB + 48, f"the sender grew {grew:.0f} MiB (limit {LIMIT_MIB})"
        assert refused and all(r.startswith("OUT_OF_MEMORY") for r in refused), refused[:3]
        assert "SEND" in refused[0], refused[0]
        # Another client of A is served meanwhile.
        other = RawConn.to(a, timeout=10)
        other.hello()
        assert not other.request(Command.GET_DEVICES, {}).is_error
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    # Once the peer acknowledges (or the SENDs end), the charge goes back: a buffer of
    # nearly the whole limit can be allocated again.
    for c, _ in senders:
        c.close()

    def room() -> bool:
        f = other.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": (LIMIT_MIB - 8) * MiB})
        if f.is_error:
            return False
        other.request(Command.FREE_BUFFER, {"buffer": f.body["buffer"]})
        return True

    assert wait_until(room, 45, interval=0.5), "the SENDs' charge never came back"
    time.sleep(0)
