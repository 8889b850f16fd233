"""Fuzz target: the frame decoder (transferd/protocol/frames.py).

Any bytes, cut at read boundaries the input chooses, with the limits it chooses: frames
that are whole and within the limits, or a ProtocolError (BAD_FRAME, TOO_LARGE); never
another exception, never a frame from fewer bytes than a header."""

from __future__ import annotations

import itertools

from fuzzing.driver import Data, instrumented, run

with instrumented():
    from transferd.protocol.constants import HEADER_SIZE
    from transferd.protocol.errors import ProtocolError
    from transferd.protocol.frames import DISCARD, Frame, FrameDecoder, Sink


def test_one_input(raw: bytes) -> None:
    data = Data(raw)
    max_body = data.pick([0, 64, 4096, 1 << 22])
    # As every decoder of the daemon and the client does, a payload over a message's size
    # goes to a sink (memory set up for it, or DISCARD), never collected at the size the
    # other side announced: without a sink the limit is small.
    sinks = data.number()
    max_payload = data.pick([0, 64, 1 << 20, 1 << 34]) if sinks & 1 else data.pick([0, 64,
                                                                                  1 << 20])
    tensor = memoryview(bytearray(4096))

    def sink(frame: Frame) -> Sink:
        if frame.payload_len == len(tensor) and sinks & 2:
            return [tensor[:1000], tensor[1000:]]
        return DISCARD if frame.payload_len > 1 << 20 else None

    cuts = sorted(data.number(2) for _ in range(data.number() % 5))
    stream = data.rest()
    dec = FrameDecoder(max_body=max_body, max_payload=max_payload, exact=bool(sinks & 4),
                       payload_sink=sink if sinks & 1 else None)
    frames = []
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    try:
        for a, b in itertools.pairwise(points):
            frames += dec.feed(stream[a:b])
    except ProtocolError as exc:
        assert exc.code.value in ("BAD_FRAME", "TOO_LARGE"), exc
        return
    assert len(frames) <= len(stream) // HEADER_SIZE
    used = sum(f.wire_len for f in frames)
    assert used <= len(stream)
    for f in frames:
        assert f.body_len <= max_body and f.payload_len <= max_payload
        assert isinstance(f.body, dict) and all(isinstance(k, str) for k in f.body)
        assert f.payload is None or len(f.payload) == f.payload_len
        assert f.payload is not None or f.discarded or f.payload_len in (0, len(tensor))


def main() -> None:
    run(test_one_input)


if __name__ == "__main__":
    main()
