"""Domains by name: parsing engine.domain, wrappers, registering a Domain of one's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from transferd.domains import registry
from transferd.domains.base import DomainOptions
from transferd.protocol.errors import BadRequest


def test_names_and_specs() -> None:
    assert {"tcp", "chaos", "verbs"} <= set(registry.names())
    assert registry.parse("tcp") == ["tcp"]
    assert registry.parse("chaos") == ["chaos", "tcp"]  # a wrapper alone wraps tcp
    assert registry.parse("Chaos:TCP") == ["chaos", "tcp"]
    assert registry.parse("chaos:chaos") == ["chaos", "chaos", "tcp"]
    for bad, words in [("bogus", "unknown Domain 'bogus'"), ("tcp:chaos", "does not wrap"),
                       ("chaos:bogus", "unknown"), ("", "unknown")]:
        with pytest.raises(BadRequest, match=words):
            registry.parse(bad)


def test_verbs_is_an_entry_that_names_what_it_lacks() -> None:
    """verbs is made by create() like tcp; without devices in its settings (or without
    pyverbs) it refuses, naming what is missing, before anything listens."""
    assert registry.parse("verbs") == ["verbs"]
    with pytest.raises(BadRequest, match=r"rdma_devices|pyverbs"):
        registry.create("verbs", None, 0, "127.0.0.1", 0, DomainOptions())  # type: ignore[arg-type]


def test_a_domain_of_ones_own_and_a_wrapper_around_it() -> None:
    made: list[tuple[str, int]] = []

    class Fake:
        def __init__(self, receiver: object, rail: int, host: str, port: int,
                     options: DomainOptions, *, inner: object = None) -> None:
            self.inner = inner
            made.append((type(self).__name__, rail))

    class Wrap(Fake):
        pass

    registry.register_domain("fake", Fake)  # type: ignore[arg-type]
    registry.register_domain("wrap", Wrap, wrapper=True)  # type: ignore[arg-type]
    try:
        assert {"fake", "wrap"} <= set(registry.names())
        d = registry.create("wrap:fake", None, 1, "h", 0, DomainOptions())  # type: ignore[arg-type]
        assert isinstance(d, Wrap) and isinstance(d.inner, Fake)
        assert made == [("Fake", 1), ("Wrap", 1)]
        with pytest.raises(ValueError):
            registry.register_domain("a:b", Fake)  # type: ignore[arg-type]
    finally:
        registry.unregister_domain("fake")
        registry.unregister_domain("wrap")
    with pytest.raises(BadRequest):
        registry.parse("fake")


def test_what_needs_an_rdma_port_is_a_capability(tmp_path: Path) -> None:
    """`transferd doctor` asks the Domain's capability, not its name, whether the engine
    needs an RDMA port and pinned memory: verbs does, wrapped or not; tcp does not."""
    from transferd import config as cfg
    from transferd.commands.probes import needs_rdma

    assert registry.capabilities("verbs").rdma
    assert registry.capabilities("chaos:verbs").rdma
    assert not registry.capabilities("tcp").rdma and not registry.capabilities("chaos").rdma
    on = {"engine.enabled": True}
    verbs = tmp_path / "verbs.toml"
    verbs.write_text('[engine]\nenabled = true\ndomain = "verbs"\nrdma_devices = ["mlx5_0"]\n')
    assert needs_rdma(cfg.load(verbs, env={}))
    assert not needs_rdma(cfg.load(env={}, overrides={**on, "engine.domain": "tcp"}))
    assert not needs_rdma(cfg.load(verbs, env={}, overrides={"engine.enabled": False}))
