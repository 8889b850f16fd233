"""A read's tag at the engine's submit (issue 20): verify refused where no code of ours
sees a read's bytes (verbs), engine.verify as its default, the traceparent checked."""

from __future__ import annotations

import dataclasses
import secrets

import pytest

from transferd.config import EngineConfig
from transferd.engine.engine import TransferEngine
from transferd.memory import BufferTable
from transferd.protocol import trace
from transferd.protocol.errors import BadRequest
from transferd.protocol.values import MrDesc, Pages


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
