"""Fuzz target: the peer plane's WRITE, ACK and SEND headers (transferd/protocol/peer.py).

The first byte picks the kind, the rest is a msgpack body (a seed: a captured frame's).
A body that is not a map is skipped (the frame decoder refuses it first); a map parses
into a header whose every field is in range, or is BAD_REQUEST."""

from __future__ import annotations

from fuzzing.driver import Data, instrumented, run

with instrumented():
    import msgpack

    from transferd.protocol.errors import BadRequest
    from transferd.protocol.peer import MAX_PAGES_PER_FRAME, WriteHeader, parse_ref

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1


def test_one_input(raw: bytes) -> None:
    data = Data(raw)
    kind = data.number() % 3
    try:
        body = msgpack.unpackb(data.rest(), raw=False, strict_map_key=True)
    except Exception:
        return  # BAD_FRAME before any header is parsed
    if not isinstance(body, dict):
        return
    try:
        if kind == 0:
            h = WriteHeader.parse(body)
        else:
            op, part = parse_ref(body)
            assert type(op) is int and 0 <= op <= U64 and type(part) is int and 0 <= part <= U32
            return
    except BadRequest:
        return
    assert 0 <= h.op <= U64 and 0 <= h.part <= U32 and 0 <= h.rkey <= U64
    assert len(h.addrs) == len(h.lens) <= MAX_PAGES_PER_FRAME
    assert all(type(v) is int and 0 <= v <= U64 for v in (*h.addrs, *h.lens))
    assert h.imm is None or 0 <= h.imm <= U32
    if h.span is not None:
        assert h.span[0] <= h.addrs[0] and h.addrs[0] + h.lens[0] <= h.span[0] + h.span[1]
    assert WriteHeader.parse(h.to_body()) == h


def main() -> None:
    run(test_one_input)


if __name__ == "__main__":
    main()
