"""Daemon configuration: an embedded default, a TOML file, TRANSFERD_* variables, flags.

Later sources win: defaults < file < environment < command-line flags.  Every
key is typed by its default; a key nobody knows, or a value of the wrong type
or range, is a :class:`ConfigError` naming the key, raised before anything
starts.  ``config/transferd.toml`` documents every key.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transferd.protocol.constants import DEFAULT_MAX_BODY, DEFAULT_MAX_PAYLOAD, PROTO_MINOR

ENV_PREFIX = "TRANSFERD_"
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the key."""


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 18515
    unix_socket: str = ""
    token: str = ""
    protocol_minor: int = PROTO_MINOR
    max_body: int = DEFAULT_MAX_BODY
    max_payload: int = DEFAULT_MAX_PAYLOAD


@dataclass
class MemoryConfig:
    host_limit_mib: int = 4096
    max_buffer_mib: int = 0


@dataclass
class MetricsConfig:
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 18516


@dataclass
class EngineConfig:
    enabled: bool = True
    # One address per rail of the host domain group; empty means "the server host".
    host_rails: list[str] = field(default_factory=list)
    peer_port: int = 0
    pin_workers: bool = True
    peer_timeout_s: float = 30.0
    # "tcp", or "chaos": tcp that delivers out of order at random delays (tests).
    domain: str = "tcp"
    chaos_seed: int = 0
    chaos_max_delay_ms: float = 5.0


@dataclass
class LogConfig:
    level: str = "info"


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self) -> Config:
        s = self.server
        _check_port("server.port", s.port)
        _check_port("metrics.port", self.metrics.port)
        _check_port("engine.peer_port", self.engine.peer_port)
        if s.protocol_minor not in (1, 2):
            raise ConfigError(f"server.protocol_minor: must be 1 or 2, got {s.protocol_minor}")
        if s.max_body < 1024:
            raise ConfigError(f"server.max_body: must be at least 1024, got {s.max_body}")
        if s.max_payload < 1:
            raise ConfigError(f"server.max_payload: must be positive, got {s.max_payload}")
        if self.memory.host_limit_mib < 1:
            raise ConfigError(
                f"memory.host_limit_mib: must be at least 1, got {self.memory.host_limit_mib}"
            )
        if self.memory.max_buffer_mib < 0:
            raise ConfigError("memory.max_buffer_mib: must be 0 (no cap) or positive")
        if not 1 <= max(1, len(self.engine.host_rails)) <= 4:
            raise ConfigError("engine.host_rails: a domain group holds 1 to 4 rails")
        if self.engine.domain not in ("tcp", "chaos"):
            raise ConfigError(
                f"engine.domain: must be 'tcp' or 'chaos', got {self.engine.domain!r}"
            )
        if self.engine.chaos_max_delay_ms < 0:
            raise ConfigError("engine.chaos_max_delay_ms: must not be negative")
        if self.engine.peer_timeout_s <= 0:
            raise ConfigError("engine.peer_timeout_s: must be positive")
        if self.log.level not in LOG_LEVELS:
            raise ConfigError(f"log.level: must be one of {', '.join(LOG_LEVELS)}")
        return self

    @property
    def host_limit(self) -> int:
        return self.memory.host_limit_mib << 20

    @property
    def max_buffer(self) -> int:
        return (self.memory.max_buffer_mib << 20) or self.host_limit


def _check_port(key: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key}: {port} is not a TCP port (0-65535)")


def _coerce(key: str, default: Any, value: Any, *, from_text: bool) -> Any:
    """Give ``value`` the type of ``default`` or raise ConfigError naming ``key``."""
    kind = type(default)
    if from_text:
        text = str(value).strip()
        if kind is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{key}: expected a boolean, got {text!r}")
        if kind is list:
            return [p.strip() for p in text.split(",") if p.strip()]
        try:
            return kind(text)
        except ValueError:
            raise ConfigError(f"{key}: expected {kind.__name__}, got {text!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings")
        return list(value)
    if type(value) is not kind:
        raise ConfigError(f"{key}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _apply(cfg: Config, section: str, key: str, value: Any, *, from_text: bool) -> None:
    name = f"{section}.{key}"
    sec = getattr(cfg, section, None)
    if sec is None or not dataclasses.is_dataclass(sec):
        raise ConfigError(f"{name}: unknown section {section!r}")
    if key not in {f.name for f in dataclasses.fields(sec)}:
        raise ConfigError(f"{name}: unknown key")
    setattr(sec, key, _coerce(name, getattr(sec, key), value, from_text=from_text))


def load(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration; ``overrides`` maps ``section.key`` to flag values."""
    cfg = Config()
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{section}: expected a [{section}] table")
            if section not in {f.name for f in dataclasses.fields(cfg)}:
                raise ConfigError(f"{section}: unknown section [{section}]")
            for key, value in table.items():
                _apply(cfg, section, key, value, from_text=False)
    environ = os.environ if env is None else env
    sections = {f.name for f in dataclasses.fields(cfg)}
    for var, value in environ.items():
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX) :].lower()
        section, _, key = rest.partition("_")
        if section in sections and key:
            _apply(cfg, section, key, value, from_text=True)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        _apply(
            cfg,
            section,
            key,
            value,
            from_text=isinstance(value, str)
            and not isinstance(getattr(getattr(cfg, section, None), key, ""), str),
        )
    return cfg.validate()
