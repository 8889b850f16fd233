"""The rdma:// protocol suite over real verbs: a daemon listening on rdma://HOST:0 and
clients connecting to it over an RC queue pair (set-up over TCP at HOST:PORT).

The tests are the protocol suite's own (tests/integration/test_hello.py,
test_tensors.py, test_batching.py), collected here with a ``url`` that is the daemon's
rdma:// address: the same checksums, batching and refusals, each frame one message,
payloads in max_message continuations.  Skipped, with the reason, where there is no RDMA
device with an ACTIVE port.  TRANSFERD_RDMA_HOST picks the address (127.0.0.1 unless
given): a RoCE GID of that address picks its device, else the first ACTIVE port.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.helpers import DaemonProcess, start_daemon
from tests.integration.test_batching import (  # noqa: F401 - collected here
    test_pipelined_read_then_write_of_a_large_tensor,
    test_read_sees_writes_queued_before_it_and_not_after,
    test_synchronous_calls_are_flush_points,
)
from tests.integration.test_hello import (  # noqa: F401 - collected here
    test_client_as_async_context_manager,
    test_hello_reports_version_features_and_limits,
    test_server_stats_names_every_command,
)
from tests.integration.test_tensors import (  # noqa: F401 - collected here
    test_64_mib_round_trip,
    test_alloc_free_clear,
    test_copy_tensor_between_buffers,
    test_data_of_many_kinds,
    test_set_get_round_trip,
    test_set_tensors_with_one_bad_tensor_writes_nothing,
)

from .conftest import needs_rdma

pytestmark = [pytest.mark.rdma, needs_rdma]

HOST = os.environ.get("TRANSFERD_RDMA_HOST", "127.0.0.1")


@pytest.fixture(scope="module")
def rdma_daemon() -> Iterator[DaemonProcess]:
    d = start_daemon(["--listen", f"rdma://{HOST}:0"])
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def url(rdma_daemon: DaemonProcess) -> str:
    assert rdma_daemon.alive(), rdma_daemon.output()
    return rdma_daemon.url_for("rdma")
