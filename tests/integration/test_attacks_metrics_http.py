"""The metrics endpoint (unauthenticated, any local process or scraper reaches it)
attacked with requests no Prometheus sends: each gets a clear 4xx answer, nothing is
logged at ERROR, no header of the answer is the requester's text, and a scrape is
served afterwards."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from tests.helpers import DaemonProcess


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess() as d:
        yield d


def _ask(d: DaemonProcess, request: bytes, limit_s: float = 5.0) -> bytes:
    """Send one request, read the whole answer (the endpoint closes after it)."""
    assert d.metrics_url is not None
    host, _, rest = d.metrics_url.removeprefix("http://").partition(":")
    with socket.create_connection((host, int(rest.partition("/")[0])), timeout=limit_s) as s:
        s.sendall(request)
        out = bytearray()
        end = time.monotonic() + limit_s
        while time.monotonic() < end and len(out) < 1 << 20:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return bytes(out)


def _scrape_works(d: DaemonProcess) -> None:
    assert d.metrics_url is not None
    with urllib.request.urlopen(d.metrics_url, timeout=5) as r:
        assert r.status == 200
        assert b"transferd_" in r.read()


@pytest.mark.parametrize("target", [b"//[/metrics", b"http://[::1/metrics",
                                    b"http://[zz]/metrics"])
def test_a_request_target_urlsplit_refuses_is_answered_400_not_a_traceback(
        daemon: DaemonProcess, target: bytes) -> None:
    """A target with an unclosed IPv6 bracket: ``urlsplit`` raises ValueError. Before,
    that escaped ``data_received``: the connection was dropped unanswered and asyncio
    logged a 12-line ERROR traceback per request, which any process reaching the port
    could repeat to flood the journal."""
    before = daemon.stderr.count("Traceback")
    answer = _ask(daemon, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"request target" in answer, answer
    time.sleep(0.2)  # what the endpoint's thread would log, logged
    assert daemon.stderr.count("Traceback") == before, daemon.stderr[-3000:]
    assert "data_received" not in daemon.stderr, daemon.stderr[-3000:]
    _scrape_works(daemon)


@pytest.mark.parametrize("accept", [
    b"application/openmetrics-text; version=1.0.0.\nSet-Cookie: session=attacker",
    b"application/openmetrics-text; version=1.0.0.\rSet-Cookie: session=attacker",
    b"text/plain\x00; version=0.0.4",
])
def test_a_bare_lf_cr_or_control_byte_in_a_header_cannot_reach_the_answers_headers(
        daemon: DaemonProcess, accept: bytes) -> None:
    """prometheus_client echoes an OpenMetrics ``version=`` of the Accept header into
    the answer's Content-Type. Lines are split at CRLF only, so before, a bare LF in it
    put a line of the requester's choosing among the answer's headers (a
    ``Set-Cookie`` for any cache or browser in between: response splitting). A header
    with a control byte other than tab is now refused whole (400), as HTTP requires."""
    answer = _ask(daemon, b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: " + accept
                  + b"\r\n\r\n")
    head = answer.partition(b"\r\n\r\n")[0]
    assert b"Set-Cookie" not in head and b"session=attacker" not in head, head
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"control" in answer, answer
    _scrape_works(daemon)


def test_an_accept_header_prometheus_client_cannot_parse_is_400_not_500(
        daemon: DaemonProcess) -> None:
    """``version=abc`` made prometheus_client's encoder chooser raise TypeError: the
    requester's mistake was answered as the server's (500, the exception's text)."""
    answer = _ask(daemon, b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;"
                  b" version=abc\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"Accept" in answer, answer
    _scrape_works(daemon)


def test_ordinary_scrapes_still_choose_their_format(daemon: DaemonProcess) -> None:
    """What Prometheus really sends keeps working: OpenMetrics with a version, plain
    text, gzip, a tab in a header value."""
    om = _ask(daemon, b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;"
              b"version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1\r\n"
              b"X-Tab:\ta\tb\r\n\r\n")
    assert om.startswith(b"HTTP/1.1 200 "), om[:200]
    assert b"Content-Type: application/openmetrics-text; version=1.0.0" in om, om[:300]
    gz = _ask(daemon, b"GET /metrics HTTP/1.1\r\nAccept-Encoding: gzip\r\n\r\n")
    assert gz.startswith(b"HTTP/1.1 200 ") and b"Content-Encoding: gzip" in gz, gz[:300]


def _cpu_s(pid: int) -> float:
    """The process's CPU time, all threads (schedstat: nanoseconds on a CPU)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def test_a_flood_of_scrapes_takes_a_bounded_share_of_the_daemons_cpu() -> None:
    """Eight scrapers asking page after page for 2 s. Before: every page made at once,
    some 1,000 a second, the daemon at 96 % of a CPU (the collectors run under the GIL
    the daemon's loop needs: another client's round trip 0.16 -> 0.27 ms p50, 17 ms at
    worst). Now the pages are made one at a time, at most DUTY (10 %) of the time: the
    flood gets few pages, the daemon spends a fraction of a CPU on it, every scrape is
    still answered (none waits past its connection's timeout), and a scrape after it is
    served at once."""
    with DaemonProcess() as d:
        assert d.metrics_url is not None
        url = d.metrics_url
        _scrape_works(d)
        stop = time.monotonic() + 2.0
        pages: list[int] = []
        failed: list[BaseException] = []

        def flood() -> None:
            try:
                while time.monotonic() < stop:
                    with urllib.request.urlopen(url, timeout=10) as r:
                        pages.append(len(r.read()))
            except BaseException as e:  # reported below, not lost in the thread
                failed.append(e)

        threads = [threading.Thread(target=flood) for _ in range(8)]
        began, cpu = time.monotonic(), _cpu_s(d.proc.pid)
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        used = _cpu_s(d.proc.pid) - cpu
        wall = time.monotonic() - began
        assert not failed, failed
        assert pages and all(n > 1000 for n in pages)
        # DUTY is 10 %; the accepts and parsing are not paced, hence the margin. Before
        # this, used / wall was 0.9 and more.
        assert used / wall < 0.35, (used, wall, len(pages))
        t0 = time.monotonic()
        _scrape_works(d)
        assert time.monotonic() - t0 < 2.0
