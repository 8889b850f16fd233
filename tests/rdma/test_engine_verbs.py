"""The engine integration suite over real verbs: two-rail daemons whose rails are
VerbsDomains on RDMA devices (real NICs or soft-RoCE; ``make rdma-check``).

The tests are the tcp/chaos suite's own (tests/integration/test_engine_writes.py,
test_engine_peers.py, the checksummed reads of test_engine_reads.py), collected here
with a ``cluster`` of verbs daemons: the same checksums, counts and refusals, over RC
queue pairs.  Skipped, with the reason, where there is no RDMA device with an ACTIVE
port.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import async_test
from tests.integration import engine_cluster
from tests.integration.engine_cluster import WAIT, Cluster, nodes, start_cluster
from tests.integration.test_engine_peers import (  # noqa: F401 - collected here
    test_barrier_to_two_peers,
    test_receive_buffers_return_to_the_pool,
    test_scatter_to_two_peers,
    test_send_and_recv,
)
from tests.integration.test_engine_reads import (  # noqa: F401 - collected here
    region,
    sha,
    test_paged_reads_checksums,
    test_single_read_checksums_and_edges,
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
from transferd.protocol.errors import NotFound

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


@async_test(timeout=60)
async def test_rdma_read_rights_are_the_nic_s(cluster: Cluster) -> None:
    """A region registered "w" has no IBV_ACCESS_REMOTE_READ: its READ is refused by the
    responder's NIC (REM_ACCESS_ERR at the reader: NOT_FOUND, as on tcp) and nothing
    lands; the broken link is replaced: one registered "r" reads byte for byte after it."""
    async with nodes(cluster.a, cluster.b) as (a, b):
        wonly = await region(b, 64 * 1024, seed=1)
        ronly = await region(b, 64 * 1024, seed=2, access="r")
        dst = await region(a, 64 * 1024, seed=9)
        r = await a.client.submit_single_read(4096, (dst.mr, 0), (wonly.desc, 0))
        with pytest.raises(NotFound):
            await r.wait(WAIT)
        assert sha(await a.read(dst)) == sha(dst.data)
        r = await a.client.submit_single_read(64 * 1024, (dst.mr, 0), (ronly.desc, 0))
        await r.wait(WAIT)
        assert sha(await a.read(dst)) == sha(ronly.data)
