"""CRC32C (Castagnoli) over views, from the fastest C implementation installed here.

Two backends compute the same function (initial value 0, continuing a value passed
in), and both take any C-contiguous buffer, a memoryview of a region, never a copy:

- ``awscrt`` (aws-checksums): folds 64 bytes at a time with VPCLMULQDQ where the CPU
  has AVX-512, CLMUL where not.
- ``crc32c``: the CPU's CRC32 instruction (SSE 4.2, ARMv8), its own table code where
  there is none.

Which is faster depends on the CPU, by a factor of two either way: on a Zen 4 with
AVX-512, awscrt 42 ms per GiB from memory against crc32c's 81; on an EPYC without
AVX-512, awscrt 190-210 against crc32c's 112 (``docs/probes/crc_speed.py``).  So
:func:`require` does not trust an order: where both are installed it times each over
the same megabyte in cache (about half a millisecond, once per process) and keeps the
faster (:data:`backend`; ``transferd doctor`` says which, and the two figures).

Both are dependencies in pyproject.toml (awscrt on x86-64 and ARM64, where it ships
wheels).  Imported on first use, so that a daemon that never verifies never loads them;
with neither :func:`require` raises BadRequest saying what to install (a verify asked
for is refused, never skipped).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .errors import BadRequest

CrcFn = Callable[[Any, int], int]

_crc: CrcFn | None = None
backend: str | None = None  # which one :func:`require` chose ("awscrt", "crc32c")
#: What the choice was made on: each installed backend's best time over a megabyte in
#: cache, in ms per GiB (empty where only one is installed: nothing to choose).
timings: dict[str, float] = {}


def _awscrt() -> CrcFn:
    from awscrt import checksums

    return checksums.crc32c


def _crc32c() -> CrcFn:
    import crc32c as mod

    return mod.crc32c


# Every backend known; one that fails to import is skipped.  Where timing cannot tell
# them apart (within TIE), the first is kept.
BACKENDS: tuple[tuple[str, Callable[[], CrcFn]], ...] = (
    ("awscrt", _awscrt),
    ("crc32c", _crc32c),
)


def load(name: str) -> CrcFn:
    """The backend ``name``'s function (ImportError where it is not installed)."""
    for known, loader in BACKENDS:
        if known == name:
            return loader()
    raise KeyError(name)


# The timing: a megabyte (what a receive folds in, in cache), each backend in turn,
# best of ROUNDS (a shared machine's preemptions make the worst meaningless).
SAMPLE = 1 << 20
ROUNDS = 3
TIE = 0.05


def installed() -> list[tuple[str, CrcFn]]:
    """The backends that import here, in BACKENDS order."""
    out = []
    for name, loader in BACKENDS:
        try:
            out.append((name, loader()))
        except ImportError:
            continue
    return out


def fastest(found: Sequence[tuple[str, CrcFn]],
            clock: Callable[[], float] = time.perf_counter) -> tuple[str, dict[str, float]]:
    """The name of the fastest of ``found`` over :data:`SAMPLE` bytes, and each one's
    best time (ms per GiB); the first unless another is faster by more than TIE."""
    data = bytes(range(256)) * (SAMPLE // 256)
    best = {name: float("inf") for name, _ in found}
    for _, fn in found:
        fn(data, 0)  # (into cache, and any lazy set-up of the backend)
    for _ in range(ROUNDS):
        for name, fn in found:
            t0 = clock()
            fn(data, 0)
            best[name] = min(best[name], clock() - t0)
    per_gib = {name: t * 1e3 * (1 << 30) / SAMPLE for name, t in best.items()}
    choice = found[0][0]
    for name, _ in found[1:]:
        if per_gib[name] < per_gib[choice] * (1 - TIE):
            choice = name
    return choice, per_gib


def require() -> CrcFn:
    """The checksum function (the fastest installed, timed once); BadRequest saying
    what to install where there is none."""
    global _crc, backend, timings
    if _crc is None:
        found = installed()
        if not found:
            raise BadRequest(
                "checksums (verify) need the awscrt or the crc32c package, and neither "
                "is installed here: pip install awscrt crc32c (dependencies of transferd)")
        if len(found) == 1:
            name, timings = found[0][0], {}
        else:
            name, timings = fastest(found)
        backend, _crc = name, dict(found)[name]
    return _crc


def crc_of(views: Iterable[Any], value: int = 0) -> int:
    """CRC32C of ``views`` concatenated (continuing ``value``)."""
    fn = require()
    for v in views:
        value = fn(v, value)
    return value


def crc_span(fn: CrcFn, segs: Sequence[memoryview], i: int, off: int, n: int,
             value: int) -> int:
    """Continue ``value`` over the ``n`` bytes of ``segs`` from segment ``i`` at
    ``off`` (bytes just received there: a running checksum while they are in cache)."""
    while n > 0:
        seg = segs[i]
        k = min(len(seg) - off, n)
        value = fn(seg[off:off + k] if off or k < len(seg) else seg, value)
        n -= k
        i += 1
        off = 0
    return value


__all__ = ["BACKENDS", "backend", "crc_of", "crc_span", "fastest", "installed", "load",
           "require", "timings"]
