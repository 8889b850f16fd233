"""What the daemon logs: client errors at INFO with the client's address, peer-plane
failures at WARNING with the peer's node and rail, JSON lines, and the flood guard."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator

import pytest

from client import MrDesc
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, async_test, wait_until
from tests.integration.engine_cluster import (
    RAILS,
    WAIT,
    engine_env,
    fresh_imm,
    nodes,
    settle,
    start_many,
    stopped,
)
from transferd.logs import JsonFormatter, RateLimit
from transferd.protocol.constants import Command

MiB = 1 << 20


def bad_gets(d: DaemonProcess, n: int) -> tuple[int, list[int]]:
    """``n`` GET_TENSOR of a buffer that does not exist; (our port, their seqs)."""
    with RawConn.to(d) as conn:
        conn.hello()
        seqs = []
        for _ in range(n):
            seqs.append(conn.send(Command.GET_TENSOR, {"tensor": [999999, 0, 8]}))
        for _ in range(n):
            conn.recv()
        return conn.sock.getsockname()[1], seqs


def test_a_client_error_is_logged_at_info_with_its_address(daemon_factory: DaemonFactory
                                                           ) -> None:
    d = daemon_factory(["--log-level", "INFO"])
    port, seqs = bad_gets(d, 1)
    want = re.compile(rf"INFO transferd.session: client 127\.0\.0\.1:{port}: NOT_FOUND on "
                      rf"GET_TENSOR seq {seqs[0]}: (.*)$", re.M)
    assert wait_until(lambda: want.search(d.stderr) is not None, 5), d.stderr
    m = want.search(d.stderr)
    assert m is not None and "seq" not in m.group(1), m.group(0)  # the seq once


def test_json_log_lines(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(["--log-format", "json"])
    port, seqs = bad_gets(d, 1)
    assert wait_until(lambda: '"NOT_FOUND"' in d.stderr, 5), d.stderr
    records = [json.loads(line) for line in d.stderr.splitlines() if line.strip()]
    err = [r for r in records if r.get("code") == "NOT_FOUND"]
    assert err, records
    r = err[0]
    assert r["level"] == "info" and r["logger"] == "transferd.session"
    assert r["client"] == f"127.0.0.1:{port}" and r["seq"] == seqs[0]
    assert r["command"] == "GET_TENSOR" and isinstance(r["ts"], float)


def test_a_flood_of_errors_is_rate_limited(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    bad_gets(d, 200)
    assert wait_until(lambda: d.stderr.count("NOT_FOUND on GET_TENSOR") >= 20, 5), d.stderr
    time.sleep(0.2)
    assert d.stderr.count("NOT_FOUND on GET_TENSOR") == RateLimit().burst


def test_the_rate_limit_says_how_many_it_dropped() -> None:
    rl = RateLimit(burst=3, window_s=0.05)

    def rec(i: int) -> logging.LogRecord:
        return logging.LogRecord("transferd.x", logging.INFO, __file__, 1, "bad %d", (i,), None)

    passed = [rl.filter(rec(i)) for i in range(10)]
    assert passed == [True] * 3 + [False] * 7
    # Another kind of record is not held back by the first kind's flood.
    other = logging.LogRecord("transferd.y", logging.INFO, __file__, 1, "other", (), None)
    assert rl.filter(other)
    time.sleep(0.06)
    r = rec(11)
    assert rl.filter(r)
    assert r.getMessage() == "bad 11 [7 more like this suppressed]"
    assert json.loads(JsonFormatter().format(r))["suppressed"] == 7


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    a, b = start_many([{"env": engine_env(RAILS["a"], peer_timeout_s=1)},
                       {"env": engine_env(RAILS["b"])}])
    yield a, b
    for d in (a, b):
        d.stop()
        if getattr(getattr(request.node, "rep_call", None), "failed", False):
            print(d.output())


@async_test(timeout=60)
async def test_peer_failures_are_warnings_naming_node_and_rail(
    pair: tuple[DaemonProcess, DaemonProcess],
) -> None:
    a_d, b_d = pair
    async with nodes(a_d, b_d) as (a, b):
        src = await a.region(MiB, seed=70)
        dst = await b.region(MiB)
        b_node = f"{(await b.client.main_address()).node:016x}"
        a_node = f"{(await a.client.main_address()).node:016x}"
        imm = fresh_imm()
        # A forged rkey: the receiver refuses, and says from whom.
        forged = MrDesc(dst.desc.ptr, [(ad, k ^ 0x5A5A) for ad, k in dst.desc.rkeys],
                        dst.desc.size)
        [err] = await settle([await a.client.submit_single_write(
            4096, imm, (src.mr, 0), (forged, 0))])
        assert err is not None
        refused = re.compile(rf"WARNING transferd.peer: peer write refused: node {a_node} rail "
                             r"\d \(127\.0\.0\.[23]:\d+\): NOT_FOUND: ")
        assert wait_until(lambda: refused.search(b_d.stderr) is not None, 5), b_d.stderr
        # A peer that does not answer: the transfer times out, named at the initiator.
        with stopped(b_d):
            [err] = await settle([await a.client.submit_single_write(
                4096, imm, (src.mr, 0), (dst.desc, 0))])
            assert err is not None
            timed_out = re.compile(rf"WARNING transferd.peer: transfer timed out: node {b_node} "
                                   r"rail \d \(127\.0\.0\.[45]:\d+\): TIMEOUT: ")
            assert wait_until(lambda: timed_out.search(a_d.stderr) is not None, 5), a_d.stderr
            b_d.kill()
        broken = re.compile(rf"WARNING transferd.peer: peer link broken: node {b_node} rail \d "
                            r"\(127\.0\.0\.[45]:\d+\): PEER_UNREACHABLE: ")
        assert wait_until(lambda: broken.search(a_d.stderr) is not None, WAIT), a_d.stderr
