"""engine.max_paged_pages as service.few_pages judges it: a side of exactly the cap is
taken, one page more is TOO_LARGE (OverLimit, the connection goes on), in either form a
caller hands it over (the wire's ``[indices, stride, offset]``, counted before one index
is decoded, and an inproc caller's Pages); and the key's own range."""

from __future__ import annotations

from typing import Any

import pytest

from transferd.config import ConfigError, EngineConfig, load
from transferd.engine import TransferEngine
from transferd.memory import BufferTable
from transferd.protocol.errors import ErrorCode, OverLimit
from transferd.protocol.values import Pages
from transferd.service.service import few_pages

CAP = 7


def _engine(cap: int = CAP) -> TransferEngine:
    return TransferEngine(EngineConfig(max_paged_pages=cap), BufferTable(1 << 20), None)


def _forms(n: int) -> list[Any]:
    # The wire's form with indices that are not even integers: counted, never read.
    return [Pages(range(n), 4096), [list(range(n)), 4096, 0], (["x"] * n, 4096, 0)]


@pytest.mark.parametrize("form", range(3))
def test_exactly_the_cap_is_taken_and_one_more_refused(form: int) -> None:
    e = _engine()
    few_pages(e, _forms(CAP)[form], "PAGED_WRITES")
    with pytest.raises(OverLimit) as err:
        few_pages(e, _forms(CAP + 1)[form], "PAGED_WRITES")
    assert err.value.code is ErrorCode.TOO_LARGE and not err.value.fatal
    assert (f"a PAGED_WRITES of {CAP + 1} pages is over this daemon's cap of {CAP} "
            "(engine.max_paged_pages)") in str(err.value)


def test_a_form_that_is_not_pages_is_left_to_the_decoder() -> None:
    e = _engine(1)
    for v in (None, 5, "abc", [], {}, [5, 4096, 0], ["ab" * 10, 1, 0]):
        few_pages(e, v, "PAGED_READS")  # Pages.from_wire refuses them, BAD_REQUEST


def test_the_default_takes_the_largest_benchmark_and_the_range_is_checked() -> None:
    assert EngineConfig().max_paged_pages == 65536  # benchmarks/scale_pages.py's largest
    few_pages(_engine(65536), Pages(range(65536), 16), "PAGED_WRITES")
    for bad in (0, -1, (1 << 22) + 1):
        with pytest.raises(ConfigError, match="max_paged_pages"):
            load(env={}, overrides={"engine.max_paged_pages": bad})
