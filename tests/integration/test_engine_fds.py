"""File descriptors under abuse (issue 11): a forged ADD_PEER_GROUP of 600 addresses cannot
take the descriptors clients need, its links are reclaimed and not redialled hot, and an
accept loop out of descriptors backs off (bounded log, no spin) and accepts again.

Each daemon here runs with a low RLIMIT_NOFILE, set before it starts (the budget of peer
links is derived from it, transferd/fds.py).  The peers the forged addresses name are a
"tarpit": one listening socket on loopback that never accepts, so every dial of it
completes in the kernel's backlog and then waits for a handshake that never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import sys
import time
from collections.abc import Iterator

import pytest

from client import Client, NetAddr
from tests.helpers import DaemonProcess, async_test, digest
from tests.integration.engine_cluster import RAILS, WAIT, engine_env, nodes, settle
from transferd.protocol.errors import PeerUnreachable, TooLarge, TransferdError
from transferd.protocol.values import tcp_rail

# Runs the daemon with RLIMIT_NOFILE = argv[1] (soft and hard), then execs it.
LIMITED = ("import os, resource, sys; n = int(sys.argv[1]); "
           "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
           "os.execv(sys.executable, [sys.executable, '-m', 'rpc_server.cli', *sys.argv[2:]])")


def limited(nofile: int) -> list[str]:
    return [sys.executable, "-c", LIMITED, str(nofile), "-H", "127.0.0.1", "-p", "0",
            "--metrics-port", "0"]


def open_fds(d: DaemonProcess) -> int:
    assert d.proc is not None
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def cpu_seconds(d: DaemonProcess) -> float:
    assert d.proc is not None
    with open(f"/proc/{d.proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def own_daemons() -> Iterator[list[DaemonProcess]]:
    started: list[DaemonProcess] = []
    yield started
    for d in started:
        d.stop()
    for d in started:
        assert "Traceback" not in d.stderr, d.output()


@contextlib.contextmanager
def tarpit() -> Iterator[int]:
    """A loopback port whose connections complete in the backlog and are never accepted."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4096)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def forged(n: int, port: int) -> list[NetAddr]:
    """``n`` NetAddrs of made-up peers, both rails at the tarpit."""
    rng = random.Random(port)
    rail = tcp_rail("127.0.0.1", port)
    return [NetAddr(rng.getrandbits(63) | 1, 0, (rail, rail)) for _ in range(n)]


@async_test(timeout=120)
async def test_forged_peer_group_cannot_take_the_descriptors_of_clients(
    own_daemons: list[DaemonProcess],
) -> None:
    nofile, reserve = 200, 64
    a_d = DaemonProcess(command=limited(nofile), env=engine_env(
        RAILS["a"], fd_reserve=reserve, handshake_timeout_s=1, max_peer_groups=3))
    b_d = DaemonProcess(env=engine_env(RAILS["b"]))
    for d in (a_d, b_d):
        own_daemons.append(d.start())
    for d in (a_d, b_d):
        d.wait_ready()
    with tarpit() as port:
        async with nodes(a_d, b_d) as (a, b):
            src = await a.region(1 << 16, seed=20)
            dst = await b.region(1 << 16)
            base = open_fds(a_d)
            # Over the cap on addresses per group: refused whole, nothing dialled.
            with pytest.raises(TooLarge, match="max_group_peers"):
                await a.client.add_peer_group(forged(1025, port))
            t0 = time.monotonic()
            await a.client.add_peer_group(forged(600, port))  # 1,200 links wanted
            await asyncio.sleep(0.3)
            held = open_fds(a_d)
            print(f"fds: {base} before, {held} with the forged group (limit {nofile})")
            # The reserve stays free, less what was opened after the engine made its
            # budget (it counts what was open then): the listeners, the metrics
            # endpoint, this test's clients and buffers -- about a dozen.
            assert nofile - held >= reserve - 16, held
            # A new client is accepted and served meanwhile.
            late = await Client.connect(a_d.url, timeout=WAIT)
            buf = await late.alloc_buffer(4096)
            await late.set_tensor(buf.tensor(), b"\x5a" * 4096)
            assert bytes(await late.get_tensor(buf.tensor())) == b"\x5a" * 4096
            # A write that needs a new link while every link is taken: a typed error, at once.
            w = await a.client.submit_single_write(4096, None, (src.mr, 0), (dst.desc, 0))
            (err,) = await settle([w], WAIT)
            assert isinstance(err, TooLarge) and "max_links" in str(err), err
            # Every forged link fails its handshake (1 s) and gives its descriptor back.
            for _ in range(100):  # 10 s at most
                if open_fds(a_d) <= base + 4:
                    break
                await asyncio.sleep(0.1)
            assert open_fds(a_d) <= base + 4, (open_fds(a_d), base)
            print(f"reclaimed in {time.monotonic() - t0:.2f} s")
            # A forged address that just failed is not dialled again at once.
            bad = forged(1, port)[0]
            fake = (await b.client.reg_mr(dst.buf))[1]
            desc = type(fake)(fake.ptr, [(bad.rail(i), k) for i, (_, k) in
                                         enumerate(fake.rkeys)], fake.size)
            w = await a.client.submit_single_write(64, None, (src.mr, 0), (desc, 0))
            (err,) = await settle([w], WAIT)
            assert isinstance(err, PeerUnreachable) and "not dialling" in str(err), err
            # The real peer is served again, bytes checked.
            w = await a.client.submit_single_write(1 << 16, None, (src.mr, 0), (dst.desc, 0))
            await w.wait(WAIT)
            assert digest(await b.read(dst)) == digest(bytes(src.data))
            # Groups per connection are capped too (3 here; one made above).
            await a.client.add_peer_group(forged(1, port + 1))
            await a.client.add_peer_group(forged(1, port + 2))
            with pytest.raises(TooLarge, match="max_peer_groups"):
                await a.client.add_peer_group(forged(1, port + 3))
            await late.close()
    lines = a_d.stderr.splitlines()
    print(f"{len(lines)} log lines")
    assert len(lines) < 200, "\n".join(lines[-50:])


@async_test(timeout=120)
async def test_accept_out_of_descriptors_backs_off_and_accepts_again(
    own_daemons: list[DaemonProcess],
) -> None:
    """Clients take every descriptor: the tcp and unix accept loops back off (no spin, a
    bounded log), and accept the connections that waited once descriptors are free."""
    sock_path = f"/tmp/td-fds-{os.getpid()}.sock"
    d = DaemonProcess(command=limited(64), args=["--listen", f"unix://{sock_path}"],
                      env=engine_env(RAILS["a"], fd_reserve=16))
    own_daemons.append(d.start())
    d.wait_ready()
    fillers: list[Client] = []
    try:
        for _ in range(80):  # bounded: the daemon has 64 descriptors
            try:
                fillers.append(await asyncio.wait_for(Client.connect(d.url, timeout=1.0), 1.5))
            except (TimeoutError, OSError, TransferdError):
                break
        else:
            raise AssertionError("80 clients and the daemon never ran out of descriptors")
        print(f"{len(fillers)} clients took every descriptor ({open_fds(d)} open)")
        mark = len(d.stderr.splitlines())
        cpu0 = cpu_seconds(d)
        # Two more wait in the backlogs meanwhile (their HELLO goes unanswered for now).
        waiting = [asyncio.ensure_future(Client.connect(url, timeout=WAIT))
                   for url in (d.url, f"unix://{sock_path}")]
        await asyncio.sleep(2.0)
        spent = cpu_seconds(d) - cpu0
        new = d.stderr.splitlines()[mark:]
        print(f"out of descriptors for 2 s: {spent:.2f} s of CPU, {len(new)} log lines")
        assert spent < 0.5, spent  # a spinning accept loop takes the whole 2 s
        assert 1 <= len([ln for ln in new if "accept failed" in ln]) <= 4, new
        assert not any(w.done() for w in waiting)
        for c in fillers[:6]:
            await c.close()
        del fillers[:6]
        late = [await asyncio.wait_for(w, WAIT) for w in waiting]
        for c in late:
            assert (await c.main_address()).node
            await c.close()
    finally:
        for c in fillers:
            with contextlib.suppress(Exception):
                await c.close()
