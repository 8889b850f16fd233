"""An integer an in-process caller hands over, checked as the wire's fields are.

The wire's decoder gives plain ints; an inproc caller may pass a numpy integer (taken,
through ``operator.index``), or a bool, a float, a string (refused: ``int()`` would
truncate 1.5 into another offset, and the peer wire packs these as unsigned ints).
One pair of checks for the engine and the Service, so the two cannot drift apart.
"""

from __future__ import annotations

import operator
from typing import Any

from .errors import BadRequest

__all__ = ["integer", "unsigned"]


def integer(v: Any, what: str) -> int:
    """``v`` as an int (a numpy integer too): BadRequest for a bool, a float, a string."""
    if type(v) is int:
        return v
    if not isinstance(v, bool):
        try:
            return operator.index(v)
        except TypeError:
            pass
    raise BadRequest(f"{what} must be an integer, not {v!r}")


def unsigned(v: Any, what: str, limit: int) -> int:
    """``v`` as an int in 0..limit, an integer as :func:`integer` takes one."""
    if type(v) is int and 0 <= v <= limit:  # the usual case, in one test
        return v
    try:
        n = integer(v, what)
    except BadRequest:
        raise BadRequest(f"{what} must be an unsigned integer, not {v!r}") from None
    if not 0 <= n <= limit:
        raise BadRequest(f"{what} = {n} is out of range 0..{limit}")
    return n
