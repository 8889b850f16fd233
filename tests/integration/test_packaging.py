"""What ``pip install`` of the checkout gives an operator (issue 23, item 6): a wheel built
without a warning and without writing into the checkout, its license as an SPDX
expression, and the manual pages of both programs, current with their --help."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO


def test_the_manual_pages_are_current() -> None:
    r = subprocess.run([sys.executable, "docs/tools/manpages.py", "--check"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_pages_cover_every_command_and_flag() -> None:
    import click

    from rpc_server.cli import main as rpc_server
    from transferd.cli import main as transferd

    page = (REPO / "man" / "transferd.1").read_text()
    ctx = click.Context(transferd)
    for name in transferd.list_commands(ctx):
        sub = transferd.get_command(ctx, name)
        assert sub is not None and f'.SS "transferd {name}"'.replace("-", "\\-") in page, name
        for p in sub.params:
            for opt in getattr(p, "opts", []):
                if opt.startswith("-"):
                    assert opt.replace("-", "\\-") in page, (name, opt)
    page = (REPO / "man" / "rpc-server.1").read_text()
    for p in rpc_server.params:
        for opt in getattr(p, "opts", []):
            assert opt.replace("-", "\\-") in page, opt


def test_a_wheel_builds_cleanly_outside_the_checkout(tmp_path: Path) -> None:
    src = tmp_path / "checkout"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "*.egg-info", "build", "__pycache__", ".*_cache", ".hypothesis",
        ".bench-venv", "benchmarks", "tests", "fuzzing"))
    before = sorted(p.name for p in src.iterdir())
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0 and ("No matching distribution" in r.stdout + r.stderr
                              or "Could not find a version" in r.stdout + r.stderr):
        pytest.skip(f"the build backend cannot be fetched here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "Warning" not in out and "deprecated" not in out.lower(), out
    assert sorted(p.name for p in src.iterdir()) == before  # no build/, no *.egg-info
    (wheel,) = (tmp_path / "dist").glob("transferd-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    for page in ("transferd.1", "rpc-server.1"):
        assert f"transferd-0.1.0.data/data/share/man/man1/{page}" in names, names
    assert any(n.startswith("rpc_server/") for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
