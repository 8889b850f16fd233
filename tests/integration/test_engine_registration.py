"""Registering one buffer twice: two regions, each with its own rkeys, each revoked on
its own (issue 24, item 8: on verbs a second registration raised an uncaught ValueError
where tcp accepted it).  Run here over the tcp trio; tests/rdma/test_engine_verbs.py
collects the same test over real verbs (``make rdma-check``)."""

from __future__ import annotations

import pytest

from tests.helpers import async_test, digest
from tests.integration.engine_cluster import WAIT, Cluster, fresh_imm, nodes
from transferd.protocol.errors import TransferdError


@async_test(timeout=60)
async def test_a_buffer_registered_twice_takes_writes_through_both_and_each_goes_alone(
        tcp_cluster: Cluster) -> None:
    await _registered_twice(tcp_cluster)


async def _registered_twice(cluster: Cluster) -> None:
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(8192, seed=11)
        dst = await b.region(8192)
        mr2, desc2 = await b.client.reg_mr(dst.buf)  # the same buffer again
        assert [k for _, k in desc2.rkeys] != [k for _, k in dst.desc.rkeys]
        imm = fresh_imm()
        w1 = await a.client.submit_single_write(4096, imm, (src.mr, 0), (dst.desc, 0))
        w2 = await a.client.submit_single_write(4096, imm, (src.mr, 4096), (desc2, 4096))
        await w1.wait(WAIT)
        await w2.wait(WAIT)
        assert digest(await b.read(dst)) == digest(bytes(src.data))
        # The first registration goes; the second still takes writes, the first none.
        await b.client.dereg_mr(dst.mr)
        gone = await a.client.submit_single_write(16, None, (src.mr, 0), (dst.desc, 0))
        with pytest.raises(TransferdError):
            await gone.wait(WAIT)
        w3 = await a.client.submit_single_write(8192, imm, (src.mr, 0), (desc2, 0))
        await w3.wait(WAIT)
        assert await b.client.imm_count(imm) == 3
        assert digest(await b.read(dst)) == digest(bytes(src.data))
        await b.client.dereg_mr(mr2)
