"""transferd/protocol/integers.py: the one check of an in-process caller's integers the
engine (immediates) and the Service (lengths, offsets, counts) share: a plain or numpy
integer is taken, a bool, a float or a string is BadRequest, and a bound is inclusive."""

from __future__ import annotations

import math

import numpy as np
import pytest

from transferd.engine.engine import _imm
from transferd.protocol.errors import BadRequest
from transferd.protocol.integers import integer, unsigned

U32 = 0xFFFFFFFF


@pytest.mark.parametrize("v", [0, 7, -3, 1 << 70, np.int64(-5), np.uint32(9)])
def test_integers_are_taken_as_ints(v: object) -> None:
    got = integer(v, "a length")
    assert type(got) is int and got == int(v)  # type: ignore[call-overload]


@pytest.mark.parametrize("v", [True, False, 1.0, 1.5, math.nan, "7", None, [1]])
def test_anything_else_is_bad_request_naming_what(v: object) -> None:
    with pytest.raises(BadRequest, match="a length must be an integer"):
        integer(v, "a length")
    with pytest.raises(BadRequest, match="a count must be an unsigned integer"):
        unsigned(v, "a count", U32)


def test_the_bound_is_inclusive_at_both_ends() -> None:
    assert unsigned(0, "imm", U32) == 0
    assert unsigned(U32, "imm", U32) == U32
    assert unsigned(np.uint64(U32), "imm", U32) == U32
    for bad in (-1, U32 + 1, np.int64(-1)):
        with pytest.raises(BadRequest, match=r"imm = -?\d+ is out of range 0\.\.4294967295"):
            unsigned(bad, "imm", U32)


def test_the_engines_immediate_is_the_same_check() -> None:
    assert _imm(None) is None
    assert _imm(np.uint32(5)) == 5 and _imm(U32) == U32
    for bad in (1.5, "7", True, -1, U32 + 1):
        with pytest.raises(BadRequest, match="immediate"):
            _imm(bad)  # type: ignore[arg-type]
