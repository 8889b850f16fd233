"""A transfer through device memory refused for its staging names what it is.

plan_staging's refusals (a page larger than a chunk, more chunks than the pool has)
said "a write from cuda:0 memory ..." for reads into device memory too."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from transferd.engine.device_source import plan_staging
from transferd.protocol.errors import BadRequest

CHUNK, CHUNKS, PTR = 4096, 4, 1 << 20


def _region() -> Any:
    pool = SimpleNamespace(chunk_size=CHUNK, capacity=CHUNKS)
    return SimpleNamespace(staging=SimpleNamespace(pool=pool), ptr=PTR, size=64 * CHUNK,
                           device_address=lambda off, n: 0x7000_0000 + off,
                           buffer=SimpleNamespace(device="cuda:0"))


@pytest.mark.parametrize("what", ["a write from", "a read into"])
def test_a_staging_refusal_names_the_transfer(what: str) -> None:
    r = _region()
    said = f"^BAD_REQUEST: {what} cuda:0 memory"
    with pytest.raises(BadRequest, match=f"{said}: a page of {CHUNK + 1} bytes is larger "
                                         "than a staging chunk"):
        plan_staging(r, [(PTR, CHUNK + 1)], what)
    with pytest.raises(BadRequest, match=f"{said} needs {CHUNKS + 1} staging chunks, its "
                                         f"pool has {CHUNKS}"):
        plan_staging(r, [(PTR + i * CHUNK, CHUNK) for i in range(CHUNKS + 1)], what)
    # The pool's worth fits.
    _, _, places, need = plan_staging(r, [(PTR + i * CHUNK, CHUNK) for i in range(CHUNKS)],
                                      what)
    assert need == CHUNKS and places == [(i, 0) for i in range(CHUNKS)]
