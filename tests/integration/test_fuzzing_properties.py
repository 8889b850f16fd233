"""The fuzz targets of fuzzing/ (``make fuzz``) stay runnable: the seed corpus comes out of
docs/protocol.md's captured frames and decodes, and every target runs over its seeds and a
few hundred blind mutations of them without a failure (the fallback driver: no atheris
needed).  The fuzzing itself, for minutes, is ``make fuzz``; this is only a guard."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from fuzzing import corpus, driver


def test_the_seed_corpus_comes_from_the_captured_frames(tmp_path: Path) -> None:
    counts = corpus.write(tmp_path)
    assert set(counts) == set(corpus.TARGETS)
    assert all(counts.values()), counts  # every target has seeds
    # Every client connection of the doc is a dispatch seed, with and without its HELLO.
    assert counts["dispatch"] > counts["server_connection"] >= 20
    firsts = {p.read_bytes()[:3] for p in (tmp_path / "server_connection").iterdir()}
    assert b"TD\x00" in firsts  # connections start with HELLO (0x00)


@pytest.mark.parametrize("target", corpus.TARGETS)
def test_each_target_runs_over_its_seeds(target: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FUZZ_DRIVER", "fallback")
    monkeypatch.chdir(tmp_path)  # where a failing input would be written
    corpus.write(tmp_path / "corpus")
    mod = importlib.import_module(f"fuzzing.fuzz_{target}")
    seeds = driver.load_corpus([str(tmp_path / "corpus" / target)])
    runs = len(seeds) + (100 if target == "dispatch" else 400)
    try:
        rc = driver.fallback(mod.test_one_input, ["fuzz", f"-runs={runs}", "-seed=1",
                                                   str(tmp_path / "corpus" / target)])
    finally:
        if hasattr(mod, "close"):
            mod.close()  # the dispatch target's in-process daemon
    assert rc == 0, [p.name for p in tmp_path.iterdir()]
    assert f"fallback driver: {runs} runs" in capsys.readouterr().err
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*"))


def test_the_fallback_driver_reports_a_failing_input(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A target that fails on some input: exit 1 and the input written, as libFuzzer does."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "seed").write_bytes(b"hello")

    def target(data: bytes) -> None:
        assert b"l" not in data

    assert driver.fallback(target, ["fuzz", str(tmp_path / "seed")]) == 1
    (crash,) = tmp_path.glob("crash-*")
    assert crash.read_bytes() == b"hello"
