"""Daemon configuration: the schema, and how it is loaded.

Later sources win: embedded defaults < a TOML file < ``TRANSFERD_<SECTION>_<KEY>``
variables < command-line flags.  The schema is the section dataclasses (in
:mod:`transferd.config_sections`, assembled into :class:`Config` here): every key
is declared with :func:`key`, which carries its doc string and its bounds, and
is typed by its default.  ``config/transferd.toml`` and the key reference in
``docs/configuration.md`` are generated from it (``python -m
transferd.config_docs --write``; a test fails when they drift).

Adding a key: one ``key(...)`` line in its section's dataclass, with a doc
string written for operators, then run the generator.  Checks that span
several keys go in :meth:`Config.problems`.

A key nobody knows, a value of the wrong type, out of range, or not finite is a
:class:`ConfigError`; every problem is collected and reported at once, each
naming its key, before anything starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import math
import os
import stat
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The sections and their helpers live in a leaf module; they are part of this
# module's API too.
from transferd.config_discovery import DiscoveryConfig, discovery_problems
from transferd.config_engine import EngineConfig, _rail_problems
from transferd.config_sections import (
    ENV_PREFIX,
    LOG_FORMATS,
    LOG_LEVELS,
    TOKEN_REFUSED,
    ConfigError,
    GpuConfig,
    LogConfig,
    MemoryConfig,
    MetricsConfig,
    ServerConfig,
    _listen_problems,
    key,
)
from transferd.domains import registry as domain_registry
from transferd.logs import one_line
from transferd.memory.buffers import DeviceSpec

__all__ = [
    "ENV_PREFIX",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "TOKEN_REFUSED",
    "Config",
    "ConfigError",
    "DiscoveryConfig",
    "EngineConfig",
    "GpuConfig",
    "LogConfig",
    "MemoryConfig",
    "MetricsConfig",
    "ServerConfig",
    "all_keys",
    "env_name",
    "key",
    "load",
    "load_with_sources",
    "schema",
]


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    log: LogConfig = field(default_factory=LogConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)

    def problems(self) -> list[str]:
        """Every problem of this configuration (per-key bounds, then across keys; a check
        across keys that names a key out of its own bounds says nothing more)."""
        out: list[str] = []
        for name, _f, value in self.items():
            out += _check_value(name, _f.metadata, value)
        bad = {p.split(":", 1)[0] for p in out}
        return out + [p for p in self._across() if not any(k in p for k in bad)]

    def _across(self) -> list[str]:
        out: list[str] = []
        if not 1 <= max(1, len(self.engine.host_rails)) <= 4:
            out.append("engine.host_rails: a domain group holds 1 to 4 rails")
        # The Domain's own keys, checked by the Domain (the registry asks it).
        out += domain_registry.config_problems(self.engine.domain, self.engine)
        out += _listen_problems(self.server)
        e = self.engine
        if e.secret_file and e.secret:
            out.append("engine.secret: set engine.secret_file or engine.secret "
                       "(TRANSFERD_ENGINE_SECRET), not both")
        out += _rail_problems(e)
        if e.previous_secret_file and not e.has_secret():
            out.append("engine.previous_secret_file: set without engine.secret_file or "
                       "engine.secret (the secret in use now)")
        if self.server.previous_token_file and not (self.server.token_file
                                                    or self.server.token):
            out.append("server.previous_token_file: set without server.token_file or "
                       "server.token (the secret in use now)")
        out += discovery_problems(self.discovery)
        if e.expect_timeout_s > e.max_expect_timeout_s:
            out.append(f"engine.expect_timeout_s: {e.expect_timeout_s:g} s is over "
                       f"engine.max_expect_timeout_s ({e.max_expect_timeout_s:g} s)")
        mem = self.memory
        if mem.max_buffer_mib > mem.host_limit_mib:
            out.append(
                f"memory.max_buffer_mib: {mem.max_buffer_mib} MiB is over "
                f"memory.host_limit_mib ({mem.host_limit_mib} MiB)"
            )
        for dev in self.gpu.devices:
            kind, _, idx = dev.partition(":")
            if kind != "cuda" or not idx.isdigit():
                out.append(f"gpu.devices: {dev!r} is not a CUDA device name (cuda:N)")
        if len(set(self.gpu.devices)) != len(self.gpu.devices):
            out.append("gpu.devices: a device is listed twice")
        return out

    def validate(self) -> Config:
        problems = self.problems()
        if problems:
            raise ConfigError(problems)
        return self

    def items(self) -> Iterator[tuple[str, dataclasses.Field[Any], Any]]:
        """``("section.key", field, value)`` for every key, in schema order."""
        for sec in dataclasses.fields(self):
            table = getattr(self, sec.name)
            for f in dataclasses.fields(table):
                yield f"{sec.name}.{f.name}", f, getattr(table, f.name)

    def get(self, dotted: str) -> Any:
        section, _, name = dotted.partition(".")
        return getattr(getattr(self, section), name)

    @property
    def host_limit(self) -> int:
        return self.memory.host_limit_mib << 20

    @property
    def max_buffer(self) -> int:
        return (self.memory.max_buffer_mib << 20) or self.host_limit

    def devices(self) -> list[DeviceSpec]:  # and memory.max_buffers, for BufferTable
        """The devices buffers are served from, each under its own limit."""
        cap = (self.memory.max_buffer_mib << 20) or None
        devs = [DeviceSpec("cpu", self.host_limit, cap)]
        if self.memory.shm_limit_mib:
            devs.append(DeviceSpec("shm", self.memory.shm_limit_mib << 20, cap))
        return devs


def schema() -> Iterator[tuple[str, type, dataclasses.Field[Any]]]:
    """``(section name, section class, key field)`` for every key of the schema."""
    for sec in dataclasses.fields(Config):
        cls = sec.default_factory
        assert isinstance(cls, type)
        for f in dataclasses.fields(cls):
            yield sec.name, cls, f


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, _c, f in schema()]


def env_name(dotted: str) -> str:
    return ENV_PREFIX + dotted.replace(".", "_").upper()


def _check_value(name: str, meta: Mapping[str, Any], value: Any) -> list[str]:
    lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices") or ()
    texts = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(t, str) and "\0" in t for t in texts):
        # No path, URL, name or secret holds one; os.open and lstat raise ValueError.
        return [f"{name}: has a NUL byte"]
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{name}: must be a finite number, got {value}"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if name.endswith("port") and not 0 <= value <= 65535:
            off = meta.get("off")
            return [f"{name}: {value} is not a TCP port (0-65535)"
                    + (f"; to turn it off set {off}" if off and value < 0 else "")]
        if lo is not None and hi is not None and not lo <= value <= hi:
            return [f"{name}: must be {_num(lo)} to {_num(hi)}, got {value}"]
        if lo is not None and value < lo:
            return [f"{name}: must be at least {_num(lo)}, got {value}"]
        if hi is not None and value > hi:
            return [f"{name}: must be at most {_num(hi)}, got {value}"]
    if choices and value not in choices:
        return [f"{name}: must be one of {', '.join(choices)}, got {value!r}"]
    return []


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _coerce(name: str, f: dataclasses.Field[Any], default: Any, value: Any,
            *, from_text: bool) -> Any:
    """Give ``value`` the type of ``default`` or raise ConfigError naming ``name``."""
    kind = type(default)
    if from_text:
        text = str(value).strip()
        if kind is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{name}: expected a boolean, got {text!r}")
        if kind is list:
            return [p.strip() for p in text.split(",") if p.strip()]
        if kind is str:
            value = text
        else:
            try:
                return kind(text)
            except ValueError:
                raise ConfigError(f"{name}: expected {kind.__name__}, got {text!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}: expected a list of strings")
        return list(value)
    if type(value) is not kind:
        raise ConfigError(
            f"{name}: expected {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    if kind is str and f.metadata.get("choices"):
        return value.lower()
    return value


def _unknown(name: str, candidates: list[str]) -> str:
    near = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {near[0]}?)" if near else ""


def _from(problem: str, source: str) -> str:
    """A problem of a value a variable gave names the variable (the file's and the
    flags' are plain: their line says where)."""
    return f"{problem} (from {source[4:]})" if source.startswith("env ") else problem


class _Loader:
    """Applies one source after another, collecting every problem."""

    def __init__(self) -> None:
        self.cfg = Config()
        self.sources = dict.fromkeys(all_keys(), "default")
        self.errors: list[str] = []
        self.sections = [f.name for f in dataclasses.fields(Config)]

    def apply(self, section: str, name: str, value: Any, *, from_text: bool,
              source: str) -> None:
        dotted = f"{section}.{name}"
        sec = getattr(self.cfg, section, None) if section in self.sections else None
        if sec is None:
            self.errors.append(
                f"{one_line(dotted)}: unknown section {section!r}"
                f"{_unknown(section, self.sections)}"
            )
            return
        fields = {f.name: f for f in dataclasses.fields(sec)}
        if name not in fields:
            # (A key of the file's or a variable's, any text: shown escaped, as every
            # line that prints it goes to a terminal or the journal.)
            self.errors.append(_from(f"{one_line(dotted)}: unknown key"
                                     f"{_unknown(dotted, all_keys())}", source))
            return
        try:
            setattr(sec, name, _coerce(dotted, fields[name], getattr(sec, name), value,
                                       from_text=from_text))
        except ConfigError as exc:
            self.errors += [_from(e, source) for e in exc.errors]
            return
        self.sources[dotted] = source

    def file(self, path: str | Path) -> None:
        try:
            raw = _read_file(path)
            data = tomllib.loads(raw.decode())
        except OSError as exc:
            self.errors.append(f"{path}: cannot read: {exc.strerror}")
            return
        except UnicodeDecodeError as exc:
            self.errors.append(f"{path}: not valid TOML: not UTF-8 text ({exc.reason} at "
                               f"byte {exc.start})")
            return
        except tomllib.TOMLDecodeError as exc:
            self.errors.append(f"{path}: not valid TOML: {exc}")
            return
        except ValueError as exc:  # an integer past Python's 4300 digits
            self.errors.append(f"{path}: not valid TOML: {str(exc)[:200]}")
            return
        except RecursionError:
            # tomllib descends once per nested array or inline table: a 1 MiB file of
            # "a = [[[[..." is past the interpreter's stack (a traceback of thousands
            # of lines, the reload "failed: maximum recursion depth exceeded").
            self.errors.append(f"{path}: not valid TOML: arrays or inline tables nested "
                               "too deep")
            return
        for section, table in data.items():
            if section not in self.sections:
                shown = one_line(section)
                self.errors.append(
                    f"{shown}: unknown section [{shown}]{_unknown(section, self.sections)}"
                )
                continue
            if not isinstance(table, dict):
                self.errors.append(f"{section}: expected a [{section}] table")
                continue
            for name, value in table.items():
                self.apply(section, name, value, from_text=False, source=f"file {path}")

    def environment(self, environ: Mapping[str, str]) -> None:
        for var, value in environ.items():
            if not var.startswith(ENV_PREFIX):
                continue
            rest = var[len(ENV_PREFIX):].lower()
            section, _, name = rest.partition("_")
            # Variables whose first word is not a section are not the daemon's:
            # the client library's switches share the prefix.
            if section in self.sections and name:
                self.apply(section, name, value, from_text=True, source=f"env {var}")

    def flags(self, overrides: Mapping[str, Any]) -> None:
        for dotted, value in overrides.items():
            if value is None:
                continue
            section, _, name = dotted.partition(".")
            current = getattr(getattr(self.cfg, section, None), name, "")
            self.apply(section, name, value, source="flag",
                       from_text=isinstance(value, str) and not isinstance(current, str))


# Longest configuration file read, in bytes (a longer one is refused, not cut).
MAX_CONFIG_FILE = 1 << 20


def _read_file(path: str | Path) -> bytes:
    """A configuration file's bytes.  Anything but a regular file (a FIFO nobody
    writes, /dev/zero) is refused without reading it, and so is one over
    :data:`MAX_CONFIG_FILE`: SIGHUP reads it on the daemon's loop, which must not
    block on the open or fill memory."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if st.st_size > MAX_CONFIG_FILE:
            raise OSError(errno.EFBIG, f"over {MAX_CONFIG_FILE} bytes")
        chunks = []
        got = 0
        while got <= MAX_CONFIG_FILE:
            data = os.read(fd, MAX_CONFIG_FILE + 1 - got)
            if not data:
                break
            chunks.append(data)
            got += len(data)
        if got > MAX_CONFIG_FILE:  # grew since the fstat
            raise OSError(errno.EFBIG, f"over {MAX_CONFIG_FILE} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def load_with_sources(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[Config, dict[str, str]]:
    """Like :func:`load`, also returning where each key's value came from
    (``"default"``, ``"file PATH"``, ``"env VAR"`` or ``"flag"``)."""
    ld = _Loader()
    if path is not None:
        ld.file(path)
    ld.environment(os.environ if env is None else env)
    ld.flags(overrides or {})
    # Values that failed to parse kept their default; report bounds only for the rest.
    bad = {e.split(":", 1)[0] for e in ld.errors}
    problems = [_from(p, ld.sources.get(p.split(":", 1)[0], "")) for p in ld.cfg.problems()
                if p.split(":", 1)[0] not in bad]
    if ld.errors or problems:
        raise ConfigError(ld.errors + problems)
    return ld.cfg, ld.sources


def load(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration; ``overrides`` maps ``section.key`` to flag values
    (``None`` = the flag was not given).  Raises ConfigError listing every problem."""
    return load_with_sources(path, env=env, overrides=overrides)[0]
