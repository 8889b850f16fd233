"""Runs a fuzz target: under atheris (libFuzzer, coverage-guided) where it is installed,
else under a small driver of our own that feeds the corpus and random mutations of it.

A target is a module with ``test_one_input(data: bytes) -> None`` that raises only on a
bug, and ``main()`` calling :func:`run`.  Both drivers take libFuzzer's flags (the
fallback understands ``-max_total_time=S``, ``-runs=N``, ``-seed=N`` and
``-timeout=S`` (default 10: a slower input is a failure, ``timeout-<sha1>``) and
``-artifact_prefix=DIR/``; the rest it ignores) and corpus directories:

    python -m fuzzing.fuzz_decoder -max_total_time=30 .fuzz/corpus/decoder
    FUZZ_DRIVER=fallback python -m fuzzing.fuzz_decoder -runs=2000 .fuzz/corpus/decoder

The fallback driver is not coverage-guided: it mutates corpus entries blindly (bit
flips, interesting integers, cuts, splices, repeats), so it finds less than atheris does
in the same time; it exists so the targets run (and stay runnable: the suite runs each
over its seed corpus) where atheris cannot be installed.  A failing input is written to
``<artifact_prefix>crash-<sha1>`` and the driver exits 1 with the traceback, as
libFuzzer does; ``python -m fuzzing.fuzz_X crash-...`` replays it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

Target = Callable[[bytes], None]


def atheris_module() -> Any:
    """atheris, or None where it is not installed or FUZZ_DRIVER=fallback."""
    if os.environ.get("FUZZ_DRIVER") == "fallback":
        return None
    try:
        import atheris
    except ImportError:
        return None
    return atheris


@contextlib.contextmanager
def instrumented() -> Iterator[None]:
    """Wrap the target's imports: atheris adds coverage to the modules imported inside."""
    a = atheris_module()
    if a is None:
        yield
        return
    with a.instrument_imports():
        yield


class Data:
    """Consumes a fuzz input from the front (the fallback's FuzzedDataProvider): every
    target uses this, so an input means the same thing under either driver."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def number(self, nbytes: int = 1) -> int:
        chunk = self.data[self.pos : self.pos + nbytes]
        self.pos += len(chunk)
        return int.from_bytes(chunk.ljust(nbytes, b"\0"), "little")

    def pick(self, options: list[Any]) -> Any:
        return options[self.number() % len(options)]

    def take(self, n: int) -> bytes:
        chunk = self.data[self.pos : self.pos + n]
        self.pos += len(chunk)
        return chunk

    def rest(self) -> bytes:
        chunk = self.data[self.pos :]
        self.pos = len(self.data)
        return chunk


def frames_until_error(dec: Any, data: bytes) -> list[Any]:
    """The frames ``dec`` (a FrameDecoder) finds in ``data`` before its first error."""
    from transferd.protocol.errors import TransferdError

    out: list[Any] = []
    view = memoryview(data)
    while True:
        try:
            f = dec.next_frame()
        except TransferdError:
            return out
        if f is not None:
            out.append(f)
            continue
        if not view:
            return out
        buf = dec.get_buffer(len(view))
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        view = view[n:]
        dec.buffer_updated(n)


# -- the fallback driver ----------------------------------------------------------------

INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0x100, 0x1000, 0x7FFF, 0xFFFF, 0x10000,
               0x7FFFFFFF, 0xFFFFFFFF, 1 << 32, 1 << 62, (1 << 63) - 1, (1 << 64) - 1]


def mutate(rng: random.Random, data: bytes, corpus: list[bytes], max_len: int) -> bytes:
    """One blind mutation of ``data`` (several stacked, now and then)."""
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 4])):
        op = rng.randrange(9)
        if op == 0 and buf:  # flip a bit
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:  # a random byte
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif op == 2 and len(buf) >= 8:  # an interesting little-endian integer
            v = rng.choice(INTERESTING)
            w = rng.choice([1, 2, 4, 8])
            i = rng.randrange(len(buf) - w + 1)
            buf[i : i + w] = struct.pack("<Q", v & (1 << 64) - 1)[:w]
        elif op == 3 and buf:  # cut the end
            del buf[rng.randrange(len(buf)) :]
        elif op == 4 and buf:  # delete a range
            i = rng.randrange(len(buf))
            del buf[i : i + rng.randrange(1, 16)]
        elif op == 5:  # insert random bytes
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = rng.randbytes(rng.randrange(1, 16))
        elif op == 6 and corpus:  # splice with another entry
            other = rng.choice(corpus)
            i = rng.randrange(len(buf) + 1)
            j = rng.randrange(len(other) + 1)
            buf = buf[:i] + other[j:]
        elif op == 7 and buf:  # repeat a range
            i = rng.randrange(len(buf))
            buf[i:i] = buf[i : i + rng.randrange(1, 64)] * rng.randrange(1, 4)
        elif op == 8 and buf:  # a msgpack-ish marker
            buf[rng.randrange(len(buf))] = rng.choice(
                [0xC0, 0xC2, 0xC3, 0xC4, 0xCA, 0xCB, 0xCF, 0xD3, 0xDC, 0xDD, 0xDE, 0xDF,
                 0x80, 0x90, 0xA0, 0x93, 0x83])
    return bytes(buf[:max_len])


def _flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    flags: dict[str, str] = {}
    paths: list[str] = []
    for a in argv:
        if a.startswith("-") and "=" in a:
            k, _, v = a[1:].partition("=")
            flags[k] = v
        elif not a.startswith("-"):
            paths.append(a)
    return flags, paths


def load_corpus(paths: list[str]) -> list[bytes]:
    out: list[bytes] = []
    for p in map(Path, paths):
        files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
        out += [f.read_bytes() for f in files]
    return out


class InputTimeout(Exception):
    """One input ran longer than -timeout."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    if seconds <= 0:
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise InputTimeout(f"an input ran longer than {seconds:g} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def fallback(target: Target, argv: list[str]) -> int:
    """Corpus first, then mutations, until -max_total_time or -runs; 1 on a crash."""
    flags, paths = _flags(argv[1:])
    corpus = load_corpus(paths)
    seconds = float(flags.get("max_total_time", "0") or 0)
    runs = int(flags.get("runs", "-1"))
    max_len = int(flags.get("max_len", "65536"))
    rng = random.Random(int(flags.get("seed", "0")) or None)
    prefix = flags.get("artifact_prefix", "")
    per_input = float(flags.get("timeout", "10"))
    deadline = time.monotonic() + seconds if seconds > 0 else float("inf")
    if runs < 0 and seconds <= 0:
        runs = len(corpus)  # like libFuzzer given files: run each once
    done = 0
    inputs = iter(corpus)
    started = time.monotonic()
    while (runs < 0 or done < runs) and time.monotonic() < deadline:
        data = next(inputs, None)
        if data is None:
            base = rng.choice(corpus) if corpus else b""
            data = mutate(rng, base, corpus, max_len)
        try:
            with _time_limit(per_input):
                target(data)
        except Exception as exc:
            kind = "timeout" if isinstance(exc, InputTimeout) else "crash"
            name = f"{prefix}{kind}-{hashlib.sha1(data).hexdigest()}"
            Path(name).write_bytes(data)
            traceback.print_exc()
            print(f"fallback driver: {kind} after {done} runs, input written to {name}",
                  file=sys.stderr)
            return 1
        done += 1
    took = time.monotonic() - started
    print(f"fallback driver: {done} runs in {took:.1f} s, corpus {len(corpus)}, no crash",
          file=sys.stderr)
    return 0


def run(target: Target, argv: list[str] | None = None) -> None:
    """Fuzz ``target`` with atheris if it is there, else with :func:`fallback`."""
    argv = list(sys.argv if argv is None else argv)
    a = atheris_module()
    if a is None:
        sys.exit(fallback(target, argv))
    a.Setup(argv, target)
    a.Fuzz()
