"""A name's key in etcd squatted with JSON nested past the stack, then published here.

Whoever can write to etcd can put anything at a name's key.  A record read by the
snapshot or the watch that is not JSON (nested past the stack included) is ignored and
counted; but the put that publishes a name first reads who holds its key, and that
read caught only ValueError: 20,000 nested arrays there (40 KB) raised RecursionError
out of the name's sync, which the session took for etcd lost.  It registered again
and failed again, ten times a second for as long as the name stayed published, and
none of this daemon's other names reached etcd (no other daemon could look them up).
Now the squatted name is dropped here with a warning (held by node '?'), the session
stays up, and the other names are written.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import SyncClient
from tests.etcd_server import EtcdServer
from tests.helpers import DaemonProcess, wait_until
from tests.integration.test_discovery_etcd import disc_env


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path) as server:
        yield server


def test_a_squatted_name_nested_past_the_stack_does_not_stop_discovery(
        etcd: EtcdServer) -> None:
    etcd.put("/transferd/names/squat", ("[" * 20_000 + "]" * 20_000).encode())
    with DaemonProcess(env=disc_env(etcd)) as d, SyncClient(d.url, timeout=10) as c:
        c.publish("squat", b"mine")
        c.publish("fine", b"v")
        end = time.monotonic() + 10
        while time.monotonic() < end and "/transferd/names/fine" not in etcd.stored():
            time.sleep(0.2)
        stored = etcd.stored()
        assert "/transferd/names/fine" in stored, d.output()
        assert stored["/transferd/names/squat"].startswith("[[["), "the squatter's key moved"
        assert wait_until(lambda: "name 'squat' is published through node '?'" in d.stderr,
                          10), d.stderr[-2000:]
        time.sleep(0.5)
        err = d.stderr
        # (Before: "etcd lost (RecursionError ...)" and a registration again, ten a second.)
        assert "RecursionError" not in err, err[-2000:]
        assert err.count("registered as") <= 2, err[-2000:]
        assert "Traceback" not in err, err[-2000:]
        assert c.lookup("fine") == b"v"
