"""A read's tag at the engine's submit (issue 20): verify refused where no code of ours
sees a read's bytes (verbs), engine.verify as its default, the traceparent checked, a
verified single read planned in parts of VERIFY_PART."""

from __future__ import annotations

import dataclasses
import secrets

import pytest

from transferd.config import EngineConfig
from transferd.engine.engine import TransferEngine
from transferd.engine.plan import VERIFY_PART
from transferd.engine.reads import MAX_VERIFY_PARTS, plan_single_read, verify_parts
from transferd.memory import BufferTable
from transferd.protocol import trace
from transferd.protocol.errors import BadRequest
from transferd.protocol.values import MrDesc, NetAddr, Pages


def _engine(domain: str, verify: bool = False) -> TransferEngine:
    cfg = dataclasses.replace(EngineConfig(), domain=domain, insecure=True, verify=verify)
    return TransferEngine(cfg, BufferTable(1), None)


def test_verify_on_a_domain_that_cannot_see_the_bytes_is_refused() -> None:
    """verbs: the NIC places a READ's answer, no code of ours sees it (as for writes);
    refused at the submit, before anything is looked up or sent."""
    e = _engine("verbs")
    desc = MrDesc(0x1000, [], 4096)
    for submit in (lambda: e.submit_single_read(10, (1, 0), (desc, 0), verify=True),
                   lambda: e.submit_paged_reads(10, (1, Pages([0], 10, 0)),
                                                (desc, Pages([0], 10, 0)), verify=True),
                   lambda: e.submit_gather(1, [(10, 0, desc, 0)], verify=True)):
        with pytest.raises(BadRequest, match="verify needs a Domain"):
            submit()


def test_a_reads_tag_follows_engine_verify_and_the_traceparent() -> None:
    tp = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    plain = _engine("tcp")
    assert plain._read_tag(None, None) == (False, None)
    assert plain._read_tag(True, tp) == (True, trace.parse(tp))
    with pytest.raises(BadRequest, match="traceparent"):
        plain._read_tag(None, "00-xyz")
    checked = _engine("tcp", verify=True)
    assert checked._read_tag(None, None) == (True, None)
    assert checked._read_tag(False, None) == (False, None)


def test_a_verified_single_read_goes_in_parts_of_verify_part() -> None:
    """As a verified write: each part's checksum taken (and checked) while the others
    are on the wire, not one of a whole gigabyte before its first byte goes; at most
    MAX_VERIFY_PARTS parts; unverified or small, planned as before."""
    addr = NetAddr(1, 0, (b"127.0.0.1:1",))
    desc = MrDesc(0x10000, [(addr, 5)], 0)
    into = memoryview(bytearray(40 << 20))
    assert verify_parts(40 << 20, (False, None)) is None
    assert verify_parts(VERIFY_PART, (True, None)) is None
    parts = plan_single_read(1, 40 << 20, into, desc, 0, 1,
                             max_parts=verify_parts(40 << 20, (True, None)))
    assert len(parts) == 5 and all(p.nbytes == VERIFY_PART for p in parts)
    assert [p.addrs[0] for p in parts] == [0x10000 + k * VERIFY_PART for k in range(5)]
    assert sum(len(p.into[0]) for p in parts) == 40 << 20
    assert verify_parts(1 << 40, (True, None)) == MAX_VERIFY_PARTS
    assert len(plan_single_read(1, 40 << 20, into, desc, 0, 1)) == 1
