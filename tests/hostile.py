"""Hypothesis strategies for hostile input (issue 11): what a lying client, server or peer
can put in a msgpack body, and frames built from such bodies.

Values are chosen to break the usual assumptions of a handler: wrong types, bools where
ints are due (``True == 1``), ints at and past every boundary (u32, u64, negative),
floats that ``int()`` cannot take (inf, nan), nesting, and strings or bytes of any
length.  Every value is one msgpack can carry (ints in [-2**63, 2**64)).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from transferd.protocol.frames import encode_frame

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
I64_MIN = -(1 << 63)

# Ints that sit on a boundary somebody checks (or forgets to).
EDGE_INTS = [0, 1, 2, 3, 7, 8, 255, 256, 4095, 4096, 65535, 65536, U32, U32 + 1,
             (1 << 62), (1 << 63) - 1, 1 << 63, U64, -1, -2, I64_MIN]

ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(I64_MIN, U64), st.integers(0, 16))
floats = st.sampled_from([0.0, 1.5, -1.0, float("inf"), float("-inf"), float("nan"), 1e300])
scalars = st.one_of(
    st.none(), st.booleans(), ints, floats,
    st.text(max_size=12), st.binary(max_size=40),
)
values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
        st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)


def bodies(fields: dict[str, st.SearchStrategy[Any]] | None = None,
           optional: frozenset[str] = frozenset()) -> st.SearchStrategy[dict[str, Any]]:
    """A body built around ``fields`` (name -> plausible values): each field present or
    missing, holding a plausible value or any hostile one, plus extra keys.  Fields in
    ``optional`` are missing half of the time (the others one time in ten)."""
    fields = fields or {}

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        body: dict[str, Any] = {}
        for name, plausible in fields.items():
            how = draw(st.integers(0, 9))
            if how == 0 or (name in optional and draw(st.booleans())):
                continue  # missing
            body[name] = draw(values) if how <= 2 else draw(plausible)
        body.update(draw(st.dictionaries(st.text(min_size=1, max_size=8), values, max_size=2)))
        return body

    return build()


def frames(cmds: st.SearchStrategy[int], body: st.SearchStrategy[dict[str, Any]],
           flags: st.SearchStrategy[int] | None = None,
           payload: st.SearchStrategy[bytes] | None = None) -> st.SearchStrategy[bytes]:
    """Whole frames on the wire: header, msgpack body, payload."""
    flags = flags if flags is not None else st.sampled_from([0, 0, 0, 1, 2, 3, 4, 8, 9, 15])
    payload = payload if payload is not None else st.just(b"")

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        p = draw(payload)
        return encode_frame(draw(cmds), draw(flags), draw(st.integers(0, U32)), draw(body),
                            len(p)) + p

    return build()
