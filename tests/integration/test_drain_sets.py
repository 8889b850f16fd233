"""SIGTERM while large SETs are in flight (issue 23, item 5).

docs/operations.md: "a SET whose payload had begun to land runs to its end".  A SET
whose payload is arriving when the signal comes is answered as done; one that begins
after it is answered CANCELLED once its payload is read; no client sees its connection
cut under a payload ("Broken pipe").
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

from client import Client
from tests.helpers import DaemonProcess, RawConn, async_test, wait_until
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import Cancelled
from transferd.protocol.frames import encode_frame

MiB = 1 << 20


def test_a_set_whose_payload_is_landing_runs_to_its_end() -> None:
    with DaemonProcess(["-m", "256"]) as d:
        assert d.proc is not None
        with RawConn.to(d, timeout=30) as raw:
            assert not raw.hello().is_error
            buf = raw.request(Command.ALLOC_BUFFER, {"size": 64 * MiB, "device": "cpu"})
            assert not buf.is_error, buf.body
            tensor = [buf.body["buffer"], 0, 64 * MiB]
            raw.send_raw(encode_frame(Command.SET_TENSOR, 0, 99, {"tensor": tensor},
                                      64 * MiB))
            raw.send_raw(b"\x01" * (8 * MiB))  # it has begun to land
            time.sleep(0.3)
            d.proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: "stopping" in d.stderr, 5), d.stderr
            time.sleep(0.3)  # the drain is on; the rest of the payload comes after
            raw.send_raw(b"\x02" * (56 * MiB))
            reply = raw.recv()
            assert reply.seq == 99 and reply.flags == Flag.REPLY, reply.body  # done
            assert raw.closed_by_peer(10)
        assert d.proc.wait(30) == 0
    assert "drained in" in d.stderr


def test_a_request_on_the_wire_as_the_drain_begins_is_answered_not_cut() -> None:
    """A client between two requests when SIGTERM comes: its next request arrives after
    the drain began, on a connection that had nothing in flight.  It is answered
    CANCELLED (the connection lingers for it), never met by a closed socket."""
    with DaemonProcess(["-m", "64"]) as d:
        assert d.proc is not None
        with RawConn.to(d, timeout=10) as raw:
            assert not raw.hello().is_error
            answers: list[str] = []
            deadline = time.monotonic() + 20
            signalled = False
            while time.monotonic() < deadline:
                try:
                    reply = raw.request(Command.STATS, {})
                except (ConnectionError, OSError) as exc:
                    answers.append(f"cut: {exc!r}")
                    break
                if not reply.is_error:
                    answers.append("ok")
                else:
                    answers.append(str(reply.body.get("message", reply.body)))
                    break
                if len(answers) == 10 and not signalled:
                    d.proc.send_signal(signal.SIGTERM)
                    signalled = True
                time.sleep(0.02)  # think time: the signal lands between two requests
            assert signalled, answers
            assert answers[-1].startswith("the daemon is stopping"), answers
            assert raw.closed_by_peer(10)
        assert d.proc.wait(30) == 0


@async_test(timeout=90)
async def test_large_sets_at_sigterm_are_done_or_cancelled_never_cut() -> None:
    d = DaemonProcess(["-m", "1024"]).start().wait_ready()
    try:
        assert d.proc is not None
        outcomes: list[str] = []
        started = threading.Event()

        async def writer(size: int) -> None:
            async with await Client.connect(d.url) as c:
                buf = await c.alloc_buffer(size)
                data = b"\x5a" * size
                while True:
                    try:
                        await c.set_tensor(buf.tensor(), data)
                    except Cancelled as exc:
                        outcomes.append(f"cancelled: {exc.message}")
                        return
                    except Exception as exc:
                        outcomes.append(f"{type(exc).__name__}: {exc}")
                        return
                    outcomes.append("done")
                    started.set()

        tasks = [asyncio.ensure_future(writer(n)) for n in (16 * MiB, 64 * MiB, 64 * MiB)]
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
        await asyncio.sleep(0.2)
        d.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        ends = [o for o in outcomes if o != "done"]
        assert len(ends) == 3, outcomes
        assert all(o.startswith("cancelled: the daemon is stopping") for o in ends), ends
        assert d.proc.wait(30) == 0
    finally:
        d.stop()
