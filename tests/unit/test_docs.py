"""The docs stay true without a daemon: deploy files, alert rules, and the way
docs/tools/capture_frames.py compares examples that hold per-run values.

The captured frames themselves are re-captured from live daemons in
tests/integration/test_docs.py.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from types import ModuleType
from typing import Any

import msgpack
import pytest

from tests.helpers import REPO
from transferd.protocol.frames import HEADER, encode_frame

PROMETHEUS = REPO / "deploy" / "prometheus"


def run(argv: list[str], cwd: os.PathLike[str] | str = REPO, timeout: float = 60
        ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_deploy_and_docs_name_only_real_metrics_and_keys() -> None:
    r = run([sys.executable, "docs/tools/check_deploy.py"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check out" in r.stdout


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool (from Prometheus) is not installed")
def test_alert_rules_load_and_pass_their_unit_tests() -> None:
    r = run(["promtool", "check", "rules", "alerts.yml"], cwd=PROMETHEUS)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(["promtool", "test", "rules", "alerts_test.yml"], cwd=PROMETHEUS)
    assert r.returncode == 0, r.stdout + r.stderr


# -- capture_frames.py's comparison of volatile examples -----------------------------------


@pytest.fixture(scope="module")
def cf() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "capture_frames", REPO / "docs" / "tools" / "capture_frames.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def block(cf: ModuleType, name: str) -> str:
    text = (REPO / "docs" / "protocol.md").read_text()
    for m in cf.BLOCK.finditer(text):
        if m.group(2) == name:
            return str(m.group(3)).removesuffix("\n")
    raise AssertionError(f"docs/protocol.md has no block {name}")


def body_of(raw: bytes) -> Any:
    body_len = HEADER.unpack_from(raw)[4]
    return msgpack.unpackb(raw[24 : 24 + body_len], raw=False)


def edit(cap: Any, i: int, change: Any) -> None:
    """Re-encode frame ``i`` of ``cap`` after ``change(body)``, as a daemon would send it."""
    w = cap.wire[i]
    _, cmd, flags, seq, body_len, _, payload_len = HEADER.unpack_from(w.raw)
    body = msgpack.unpackb(w.raw[24 : 24 + body_len], raw=False)
    change(body)
    w.raw = encode_frame(cmd, flags, seq, body, payload_len) + w.raw[24 + body_len :]


def test_every_example_in_the_doc_reads_back_to_its_own_text(cf: ModuleType) -> None:
    for name in cf.EXAMPLES:
        text = block(cf, name)
        assert cf.render(cf.parse(text)) == text, name


def test_per_run_values_may_differ_but_nothing_else(cf: ModuleType) -> None:
    text = block(cf, "ENGINE_SINGLE_WRITE")
    assert "ENGINE_SINGLE_WRITE" in cf.VOLATILE
    assert cf.same(text, cf.parse(text))

    def new_rkey(body: dict[str, Any]) -> None:
        body["dst"][0][2][0][1] ^= 0x5A5A
        body["dst"][0][0] += 1 << 20  # another address

    other_run = cf.parse(text)
    edit(other_run, 0, new_rkey)
    assert cf.same(text, other_run)

    def other_imm(body: dict[str, Any]) -> None:
        body["imm"] = 6

    changed = cf.parse(text)
    edit(changed, 0, other_imm)
    assert not cf.same(text, changed)

    # The bytes B read back are not a per-run value.
    changed = cf.parse(text)
    changed.wire[-1].raw = changed.wire[-1].raw[:-1] + b"X"
    assert not cf.same(text, changed)

    # A block edited by hand (its decoded line no longer matches its bytes) is stale.
    assert not cf.same(text.replace('"imm": 7', '"imm": 6', 1), cf.parse(text))


def test_a_value_must_reappear_where_it_did(cf: ModuleType) -> None:
    # In ENGINE_SEND_RECV the NetAddr A sends to is B's; B's message EVENT names A.
    text = block(cf, "ENGINE_SEND_RECV")
    sent = cf.parse(text)
    shown = cf.signature(sent)
    assert "<node1>" in repr(shown) and "<node2>" in repr(shown)

    def same_node_as_b(body: dict[str, Any]) -> None:
        addr = body_of(sent.wire[1].raw)["addr"]
        body["from"][0] = msgpack.unpackb(addr, raw=False)[1]

    changed = cf.parse(text)
    edit(changed, 2, same_node_as_b)
    assert not cf.same(text, changed)
