"""Fixtures shared by every test: real daemons as subprocesses, and their teardown.

``daemon`` is one plain daemon shared by a test module (tests that only need
"a server" use it; each checks that the daemon is still alive afterwards).
``daemon_factory(args, env)`` starts a fresh one with its own flags; every
daemon it started is stopped when the test ends, and a failing test gets the
daemons' stdout and stderr printed into its report.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

from tests.helpers import DaemonProcess, start_daemon

DaemonFactory = Callable[..., DaemonProcess]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    # Fixtures look at this to decide whether to surface daemon output.
    setattr(item, f"rep_{rep.when}", rep)
    return rep


def _failed(request: pytest.FixtureRequest) -> bool:
    node = request.node
    return any(
        getattr(getattr(node, f"rep_{when}", None), "failed", False)
        for when in ("setup", "call")
    )


# The client transports the protocol suites run over (``url`` fixture).
TRANSPORTS = ("tcp", "unix", "seqpacket")


@pytest.fixture(scope="module")
def _module_daemon() -> Iterator[DaemonProcess]:
    where = tempfile.mkdtemp(prefix="td-", dir="/tmp")  # short: AF_UNIX paths are < 108
    d = start_daemon(["--unix", f"{where}/u.sock", "--listen", f"seqpacket://{where}/s.sock"])
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def daemon(
    _module_daemon: DaemonProcess, request: pytest.FixtureRequest
) -> Iterator[DaemonProcess]:
    """A default daemon (shared by the module); must survive every test that uses it."""
    d = _module_daemon
    assert d.alive(), f"the shared daemon died before this test\n{d.output()}"
    yield d
    if _failed(request):
        print(d.output())
    assert d.alive(), f"the daemon died during this test\n{d.output()}"


@pytest.fixture(params=TRANSPORTS)
def url(daemon: DaemonProcess, request: pytest.FixtureRequest) -> str:
    """The shared daemon's URL, once for each of TRANSPORTS."""
    return daemon.url_for(request.param)


@pytest.fixture
def daemon_factory(request: pytest.FixtureRequest) -> Iterator[DaemonFactory]:
    """Start daemons with extra flags/env: ``daemon_factory(["--token", "x"], env={...})``."""
    started: list[DaemonProcess] = []

    def factory(
        args: Sequence[str] = (), env: Mapping[str, str | None] | None = None, **kw: Any
    ) -> DaemonProcess:
        d = DaemonProcess(args, env, **kw)
        started.append(d)
        d.start()
        return d.wait_ready()

    yield factory
    failed = _failed(request)
    for d in started:
        d.stop()
        if failed:
            print(d.output())
