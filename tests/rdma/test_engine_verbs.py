"""The engine integration suite over real verbs: two-rail daemons whose rails are
VerbsDomains on RDMA devices (real NICs or soft-RoCE; ``make rdma-check``).

The tests are the tcp/chaos suite's own (tests/integration/test_engine_writes.py and
test_engine_peers.py), collected here with a ``cluster`` of verbs daemons: the same
checksums, counts and refusals, over RC queue pairs.  Skipped, with the reason, where
there is no RDMA device with an ACTIVE port.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import async_test
from tests.integration import engine_cluster
from tests.integration.engine_cluster import Cluster, start_cluster
from tests.integration.test_engine_peers import (  # noqa: F401 - collected here
    test_barrier_to_two_peers,
    test_receive_buffers_return_to_the_pool,
    test_scatter_to_two_peers,
    test_send_and_recv,
)
from tests.integration.test_engine_registration import _registered_twice
from tests.integration.test_engine_writes import (  # noqa: F401 - collected here
    test_expectations_before_and_after_landing,
    test_imm_count_under_reordering,
    test_paged_writes_of_4k_pages,
    test_paged_writes_random_indices,
    test_single_write_small,
    test_single_write_split_over_rails,
    test_write_without_immediate,
    test_writes_both_ways_at_once,
)

from .conftest import DEVICES, needs_rdma

pytestmark = [pytest.mark.rdma, needs_rdma]

_VERBS: list[Cluster] = []


@pytest.fixture(scope="module")
def verbs_trio() -> Iterator[Cluster]:
    # Two rails per daemon: on one device, both rails use it; on two, one each.
    devs = (DEVICES * 2)[:2]
    cl = start_cluster("verbs", rdma_devices=",".join(devs))
    yield cl
    for d in cl.daemons:
        d.stop()


@pytest.fixture
def cluster(verbs_trio: Cluster, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    yield from engine_cluster._watch(verbs_trio, request)


@async_test(timeout=60)
async def test_a_buffer_registered_twice_over_verbs(cluster: Cluster) -> None:
    """Two ibv_reg_mr of one buffer, each rkey revoked on its own (#24.8)."""
    await _registered_twice(cluster)
