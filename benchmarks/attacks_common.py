"""What every attack of :mod:`benchmarks.attacks` uses: its outcome record, daemons
with engine settings, a bystander client timing the daemon while it is attacked, and
raw pipelines of frames (counted by reply code)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.helpers import DaemonProcess, RawConn
from transferd.protocol.constants import Command, Flag
from transferd.protocol.frames import encode_frame

MiB = 1 << 20
GiB = 1 << 30
# The forged-peers attack's daemon gets fewer descriptors than it has forged peers.
FD_LIMIT = 512


@dataclass
class Outcome:
    name: str
    attack: str
    before: str
    now: str = ""
    rss_growth_mib: float | None = None
    bystander_p50_ms: float | None = None
    bystander_max_ms: float | None = None
    seconds: float = 0.0
    numbers: dict[str, Any] = field(default_factory=dict)


# -- plumbing -------------------------------------------------------------------------


def engine_env(rails: str, **engine: Any) -> dict[str, str]:
    env = {"TRANSFERD_ENGINE_HOST_RAILS": rails}
    env.update({f"TRANSFERD_ENGINE_{k.upper()}": str(v) for k, v in engine.items()})
    return env


@contextlib.contextmanager
def daemons(*specs: tuple[list[str], dict[str, str]]) -> Iterator[list[DaemonProcess]]:
    ds = [DaemonProcess(args, env) for args, env in specs]
    try:
        for d in ds:
            d.start()
        for d in ds:
            d.wait_ready()
        yield ds
    finally:
        for d in ds:
            if d.proc is not None and d.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(d.proc.pid, signal.SIGCONT)
            d.stop()


def mib(n: float) -> float:
    return round(n / MiB, 1)


def ok(f: Any) -> Any:
    if f.is_error:
        raise RuntimeError(f"{f.cmd:#x}: {f.body}")
    return f


class Bystander:
    """Another client: STATS round trips on its own connection, in a thread, for as long
    as the attack runs (bounded: 20,000 rounds)."""

    def __init__(self, d: DaemonProcess) -> None:
        self.conn = RawConn.to(d, timeout=30)
        self.conn.hello()
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.times) < 20000:
            t0 = time.perf_counter()
            try:
                ok(self.conn.request(Command.STATS))
            except (OSError, RuntimeError):
                return
            self.times.append(time.perf_counter() - t0)
            time.sleep(0.005)

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(35)
        self.conn.close()

    def fill(self, out: Outcome) -> None:
        if self.times:
            s = sorted(self.times)
            out.bystander_p50_ms = round(s[len(s) // 2] * 1000, 2)
            out.bystander_max_ms = round(s[-1] * 1000, 2)
            out.numbers["bystander_rounds"] = len(s)


def drain(conn: RawConn, until: float) -> list[Any]:
    """Frames ``conn`` receives until ``until`` (or its peer closes)."""
    got = []
    conn.sock.settimeout(0.2)
    while time.monotonic() < until:
        try:
            got.append(conn.recv())
        except TimeoutError:
            continue
        except (ConnectionError, OSError):
            break
    return got


def pipeline(conn: RawConn, data: list[bytes], timeout: float) -> list[Any]:
    """Send ``data`` (batches of frames) and then a STATS; every frame back up to its reply.

    A reader thread takes the daemon's answers meanwhile: the daemon stops reading while
    its answers wait unread, so a client that only wrote would wait for it for ever."""
    got: list[Any] = []
    probe = 0xFFFFFF00
    done = threading.Event()

    def read() -> None:
        conn.sock.settimeout(timeout)
        with contextlib.suppress(OSError, ConnectionError):
            while True:
                f = conn.recv()
                got.append(f)
                if f.seq == probe and f.cmd == Command.STATS:
                    break
        done.set()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    for chunk in data:
        conn.sock.sendall(chunk)
    conn.sock.sendall(encode_frame(Command.STATS, 0, probe, None))
    done.wait(timeout)
    t.join(1)
    return got


def codes(frames: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in frames:
        if f.flags & int(Flag.ERROR):
            out[f.body.get("code", "?")] = out.get(f.body.get("code", "?"), 0) + 1
    return out


# -- the attacks ------------------------------------------------------------------------
