"""Domains by name: ``engine.domain`` picks one (aioquic's congestion-control registry
is the model).

A name maps to a factory ``(port, rail, host, port_number, options) -> Domain`` (a
Domain class, or a callable with the ``capabilities`` its Domains have).
A wrapper (``chaos``) is named before the Domain it wraps, after a colon:
``"chaos:tcp"``; a wrapper alone wraps ``tcp``.  Built-in entries are
imported on first use, so reading this module costs nothing; tests register
their own Domains with :func:`register_domain`.

``verbs`` is an entry like ``tcp``: its factory (:func:`transferd.domains.verbs.bind.
create`) reads its devices from ``options.of("verbs")`` and, where pyverbs or a device is
missing, raises :class:`~transferd.domains.verbs.VerbsUnavailable` naming what.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transferd.protocol.errors import BadRequest

if TYPE_CHECKING:
    from .base import Capabilities, Domain, DomainOptions, Port

Factory = Callable[..., "Domain"]
# A wrapper's factory takes the Domain it wraps as a keyword, ``inner``.

_FACTORIES: dict[str, Factory] = {}
_WRAPPERS: set[str] = set()
# Imported on first use: "module:attribute" of the factory.
_BUILTIN: dict[str, str] = {
    "tcp": "transferd.domains.tcp.domain:TcpDomain",
    "chaos": "transferd.domains.chaos:ChaosDomain",
    "verbs": "transferd.domains.verbs.bind:create",
}
_BUILTIN_WRAPPERS = {"chaos"}
DEFAULT_INNER = "tcp"


def register_domain(name: str, factory: Factory, *, wrapper: bool = False) -> None:
    """Make ``name`` a Domain (or, with ``wrapper``, a Domain around another)."""
    if not name or ":" in name:
        raise ValueError(f"a Domain's name is a word without ':', not {name!r}")
    _FACTORIES[name] = factory
    if wrapper:
        _WRAPPERS.add(name)
    else:
        _WRAPPERS.discard(name)


def unregister_domain(name: str) -> None:
    _FACTORIES.pop(name, None)
    _WRAPPERS.discard(name)


def names() -> list[str]:
    """Every Domain name known, built-in and registered."""
    return sorted({*_BUILTIN, *_FACTORIES})


def is_wrapper(name: str) -> bool:
    return name in _WRAPPERS or (name in _BUILTIN_WRAPPERS and name not in _FACTORIES)


def parse(spec: str) -> list[str]:
    """``"chaos:tcp"`` -> ``["chaos", "tcp"]`` (a lone wrapper wraps tcp); BadRequest if
    a name is unknown or a wrapper has nothing to wrap."""
    parts = [p.strip().lower() for p in spec.split(":")]
    known = set(names())
    for p in parts:
        if p not in known:
            raise BadRequest(f"engine.domain: unknown Domain {p!r} in {spec!r}; known: "
                             f"{', '.join(names())}")
    if is_wrapper(parts[-1]):
        parts.append(DEFAULT_INNER)
    for p in parts[:-1]:
        if not is_wrapper(p):
            raise BadRequest(f"engine.domain: {p!r} does not wrap another Domain ({spec!r})")
    if is_wrapper(parts[-1]):
        raise BadRequest(f"engine.domain: {spec!r} wraps nothing")
    return parts


def _factory(name: str) -> Factory:
    f = _FACTORIES.get(name)
    if f is not None:
        return f
    module, _, attr = _BUILTIN[name].partition(":")
    f = getattr(importlib.import_module(module), attr)
    return f


def create(spec: str, port: Port, rail: int, host: str, port_number: int,
           options: DomainOptions) -> Domain:
    """The Domain ``spec`` names, bound to ``host:port_number``, as rail ``rail`` of the
    group whose port is ``port``."""
    parts = parse(spec)
    domain = _factory(parts[-1])(port, rail, host, port_number, options)
    for wrapper in reversed(parts[:-1]):
        domain = _factory(wrapper)(port, rail, host, port_number, options, inner=domain)
    return domain


def capabilities(spec: str) -> Capabilities:
    """What the Domains ``spec`` makes can do (a wrapper's are those of what it wraps)."""
    from .base import Capabilities

    caps = getattr(_factory(parse(spec)[-1]), "capabilities", None)
    return caps if isinstance(caps, Capabilities) else Capabilities()


def choices() -> tuple[str, ...]:
    """The built-in specs a configuration may name (each wrapper alone and around the
    default), in the registry's order: what ``engine.domain`` accepts."""
    out: list[str] = []
    for name in _BUILTIN:
        out.append(name)
        if name in _BUILTIN_WRAPPERS:
            out.append(f"{name}:{DEFAULT_INNER}")
    return tuple(out)


def config_problems(spec: str, engine: Any) -> list[str]:
    """What the Domain ``spec`` names finds wrong with the [engine] section ``engine``
    (its own keys: verbs wants one RDMA device per rail), without touching a device."""
    try:
        factory = _factory(parse(spec)[-1])
    except BadRequest as exc:
        return [exc.message]
    check = getattr(factory, "config_problems", None)
    return list(check(engine)) if check is not None else []


def machine_problems(spec: str, engine: Any) -> list[tuple[str, str]]:
    """(config key, message) for each reason this machine cannot run ``spec`` as
    configured (a device missing, a port down): what start and check-config report."""
    try:
        factory = _factory(parse(spec)[-1])
    except BadRequest:
        return []
    check = getattr(factory, "machine_problems", None)
    return list(check(engine)) if check is not None else []


def describe(spec: str) -> dict[str, Any]:
    """What ``spec`` resolves to (for messages and docs)."""
    parts = parse(spec)
    return {"spec": spec, "chain": parts}
