"""Configuration: defaults, TOML files, TRANSFERD_* variables, overrides, check-config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO
from transferd import config as cfgmod
from transferd.config import Config, ConfigError, load
from transferd.protocol.constants import DEFAULT_MAX_BODY, DEFAULT_MAX_PAYLOAD, PROTO_MINOR

SHIPPED = REPO / "config" / "transferd.toml"
EXAMPLES = sorted((REPO / "config" / "examples").glob("*.toml"))


def write(tmp_path: Path, text: str, name: str = "t.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_validate() -> None:
    cfg = Config().validate()
    assert cfg.server.host == "127.0.0.1"
    assert cfg.server.protocol_minor == PROTO_MINOR
    assert cfg.server.max_body == DEFAULT_MAX_BODY
    assert cfg.server.max_payload == DEFAULT_MAX_PAYLOAD
    assert cfg.host_limit == cfg.memory.host_limit_mib << 20
    assert cfg.max_buffer == cfg.host_limit  # max_buffer_mib 0 = no cap
    assert load(env={}) == Config()


def test_max_buffer_cap() -> None:
    cfg = load(env={}, overrides={"memory.max_buffer_mib": 16})
    assert cfg.max_buffer == 16 << 20


def test_toml_file_is_loaded(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        """
[server]
host = "0.0.0.0"
port = 19000
token = "abc"
protocol_minor = 1
[memory]
host_limit_mib = 64
[metrics]
enabled = false
[engine]
host_rails = ["198.18.0.1", "198.18.1.1"]
secret_file = "/etc/transferd/cluster.secret"   # non-loopback rails need one
peer_timeout_s = 5        # an int is fine for a float key
[log]
level = "debug"
""",
    )
    cfg = load(p, env={})
    assert (cfg.server.host, cfg.server.port, cfg.server.token) == ("0.0.0.0", 19000, "abc")
    assert cfg.server.protocol_minor == 1
    assert cfg.memory.host_limit_mib == 64 and cfg.host_limit == 64 << 20
    assert cfg.metrics.enabled is False
    assert cfg.engine.host_rails == ["198.18.0.1", "198.18.1.1"]
    assert cfg.engine.peer_timeout_s == 5.0 and isinstance(cfg.engine.peer_timeout_s, float)
    assert cfg.log.level == "debug"
    # Untouched keys keep their defaults.
    assert cfg.server.max_body == DEFAULT_MAX_BODY


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[server]\nprot = 1\n", "server.prot"),
        ("[server]\nport = 1\nbogus = true\n", "server.bogus"),
        ("[bogus]\nx = 1\n", "bogus"),
        ("[bogus]\n", "bogus"),
        ("stray = 1\n", "stray"),
        ("[server]\nport = \"18515\"\n", "server.port"),
        ("[server]\nport = 1.5\n", "server.port"),
        ("[server]\nport = true\n", "server.port"),
        ("[server]\nport = 70000\n", "server.port"),
        ("[server]\nport = -1\n", "server.port"),
        ("[server]\nhost = 127\n", "server.host"),
        ("[server]\nprotocol_minor = 3\n", "server.protocol_minor"),
        ("[server]\nprotocol_minor = 0\n", "server.protocol_minor"),
        ("[server]\nmax_body = 10\n", "server.max_body"),
        ("[server]\nmax_payload = 0\n", "server.max_payload"),
        ("[memory]\nhost_limit_mib = 0\n", "memory.host_limit_mib"),
        ("[memory]\nhost_limit_mib = \"lots\"\n", "memory.host_limit_mib"),
        ("[memory]\nmax_buffer_mib = -1\n", "memory.max_buffer_mib"),
        ("[metrics]\nenabled = 1\n", "metrics.enabled"),
        ("[metrics]\nport = 65536\n", "metrics.port"),
        ("[engine]\nhost_rails = \"10.0.0.1\"\n", "engine.host_rails"),
        ("[engine]\nhost_rails = [1, 2]\n", "engine.host_rails"),
        ("[engine]\nhost_rails = [\"a\", \"b\", \"c\", \"d\", \"e\"]\n", "engine.host_rails"),
        ("[engine]\npeer_timeout_s = 0\n", "engine.peer_timeout_s"),
        ("[engine]\npeer_port = 99999\n", "engine.peer_port"),
        ("[log]\nlevel = \"loud\"\n", "log.level"),
    ],
)
def test_bad_file_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(p, env={})
    assert key in str(info.value)


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(write(tmp_path, "[server\nport = 1\n"), env={})


def test_env_overrides(tmp_path: Path) -> None:
    p = write(tmp_path, "[server]\nport = 19000\nhost = \"127.0.0.2\"\n")
    env = {
        "TRANSFERD_SERVER_PORT": "19001",
        "TRANSFERD_SERVER_MAX_BODY": "8192",
        "TRANSFERD_MEMORY_HOST_LIMIT_MIB": "32",
        "TRANSFERD_METRICS_ENABLED": "off",
        "TRANSFERD_ENGINE_HOST_RAILS": "198.18.0.1, 198.18.1.1",
        "TRANSFERD_ENGINE_SECRET": "from the environment",
        "TRANSFERD_ENGINE_PEER_TIMEOUT_S": "2.5",
        "TRANSFERD_LOG_LEVEL": "warning",
        # The client's switches share the prefix and must not trip the daemon.
        "TRANSFERD_NO_BATCHED_GET": "1",
        "TRANSFERD_STATS": "1",
        "TRANSFERD_STATS_MS": "100",
        "UNRELATED": "x",
    }
    cfg = load(p, env=env)
    assert cfg.server.port == 19001  # env beats the file
    assert cfg.server.host == "127.0.0.2"  # the file beats the default
    assert cfg.server.max_body == 8192
    assert cfg.memory.host_limit_mib == 32
    assert cfg.metrics.enabled is False
    assert cfg.engine.host_rails == ["198.18.0.1", "198.18.1.1"]
    assert cfg.engine.peer_timeout_s == 2.5
    assert cfg.log.level == "warning"


@pytest.mark.parametrize("text", ["1", "true", "YES", "on"])
def test_env_booleans_true(text: str) -> None:
    assert load(env={"TRANSFERD_ENGINE_PIN_WORKERS": text}).engine.pin_workers is True
    assert load(env={"TRANSFERD_METRICS_ENABLED": text}).metrics.enabled is True


@pytest.mark.parametrize("text", ["0", "false", "No", "off"])
def test_env_booleans_false(text: str) -> None:
    assert load(env={"TRANSFERD_ENGINE_PIN_WORKERS": text}).engine.pin_workers is False


@pytest.mark.parametrize(
    ("var", "value", "key"),
    [
        ("TRANSFERD_SERVER_PORT", "http", "server.port"),
        ("TRANSFERD_SERVER_PORT", "99999", "server.port"),
        ("TRANSFERD_SERVER_BOGUS", "1", "server.bogus"),
        ("TRANSFERD_METRICS_ENABLED", "maybe", "metrics.enabled"),
        ("TRANSFERD_MEMORY_HOST_LIMIT_MIB", "1.5", "memory.host_limit_mib"),
        ("TRANSFERD_SERVER_PROTOCOL_MINOR", "7", "server.protocol_minor"),
    ],
)
def test_bad_env_names_the_key(var: str, value: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(env={var: value})
    assert key in str(info.value)


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSFERD_SERVER_PORT", "19555")
    assert load().server.port == 19555
    assert load(env={}).server.port == Config().server.port


def test_overrides_beat_env_and_file(tmp_path: Path) -> None:
    p = write(tmp_path, "[server]\nport = 19000\n[memory]\nhost_limit_mib = 10\n")
    cfg = load(
        p,
        env={"TRANSFERD_SERVER_PORT": "19001"},
        overrides={
            "server.port": 19002,
            "memory.host_limit_mib": None,  # None = flag not given
            "server.token": "123",  # a string key keeps a numeric-looking string
            "metrics.port": "0",  # text for a numeric key is parsed
        },
    )
    assert cfg.server.port == 19002
    assert cfg.memory.host_limit_mib == 10
    assert cfg.server.token == "123"
    assert cfg.metrics.port == 0


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"server.nope": 1}, "server.nope"),
        ({"nope.port": 1}, "nope"),
        ({"server.port": -5}, "server.port"),
        ({"server.port": "x"}, "server.port"),
        ({"memory.host_limit_mib": True}, "memory.host_limit_mib"),
    ],
)
def test_bad_overrides_name_the_key(overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(env={}, overrides=overrides)
    assert key in str(info.value)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
    assert "debug" in cfgmod.LOG_LEVELS


# -- the shipped files ---------------------------------------------------------------------


def test_shipped_config_equals_the_embedded_default() -> None:
    if not SHIPPED.exists():
        pytest.skip("config/transferd.toml is not written yet")
    assert load(SHIPPED, env={}) == Config()


def test_shipped_config_mentions_every_key() -> None:
    if not SHIPPED.exists():
        pytest.skip("config/transferd.toml is not written yet")
    import dataclasses
    import tomllib

    data = tomllib.loads(SHIPPED.read_text())
    for sec in dataclasses.fields(Config()):
        assert sec.name in data, f"[{sec.name}] missing from {SHIPPED}"
        for key in dataclasses.fields(getattr(Config(), sec.name)):
            assert key.name in data[sec.name], f"{sec.name}.{key.name} missing from {SHIPPED}"


def node_files(tmp_path: Path) -> dict[str, str]:
    """The files an example names on its node (the service's token), made here."""
    tok = tmp_path / "token"
    tok.write_text("a-token")
    tok.chmod(0o600)
    return {"TRANSFERD_SERVER_TOKEN_FILE": str(tok)}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_configs_validate(path: Path, tmp_path: Path) -> None:
    load(path, env=node_files(tmp_path) if "token_file" in path.read_text() else {})


# -- transferd check-config ---------------------------------------------------------------


def check_config(path: Path | None, env: dict[str, str] | None = None, *flags: str
                 ) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    clean.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "transferd.cli", "check-config", *flags,
         *([str(path)] if path else [])],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean,
        cwd=REPO,
    )


def test_check_config_good(tmp_path: Path) -> None:
    p = write(tmp_path, "[server]\nport = 19123\n[memory]\nhost_limit_mib = 77\n")
    r = check_config(p)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout and "19123" in r.stdout and "77 MiB" in r.stdout


def test_check_config_bad_key(tmp_path: Path) -> None:
    p = write(tmp_path, "[server]\nport = 19123\nmax_bodie = 4096\n")
    r = check_config(p)
    assert r.returncode == 3
    assert "server.max_bodie" in r.stderr
    assert "OK" not in r.stdout


def test_check_config_bad_value(tmp_path: Path) -> None:
    r = check_config(write(tmp_path, "[log]\nlevel = \"chatty\"\n"))
    assert r.returncode == 3 and "log.level" in r.stderr


def test_check_config_reads_the_environment(tmp_path: Path) -> None:
    p = write(tmp_path, "[server]\nport = 19123\n")
    r = check_config(p, {"TRANSFERD_SERVER_PORT": "not-a-port"})
    assert r.returncode == 3 and "server.port" in r.stderr


def test_check_config_shipped() -> None:
    if not SHIPPED.exists():
        pytest.skip("config/transferd.toml is not written yet")
    r = check_config(SHIPPED)
    assert r.returncode == 0, r.stderr


# -- the schema, and what is generated from it ---------------------------------------------


def test_generated_files_match_the_schema() -> None:
    from transferd import config_docs

    bad = config_docs.drifted()
    assert not bad, (
        f"{', '.join(bad)} differ from the schema in transferd/config_sections.py: "
        f"run `{config_docs.COMMAND}`"
    )


def test_every_key_has_a_doc_string() -> None:
    for section, cls, f in cfgmod.schema():
        assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("), section
        assert len(f.metadata.get("doc", "")) > 20, f"{section}.{f.name} has no doc string"


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    p = write(tmp_path, "[server]\nport = 70000\nprot = 1\n[log]\nlevel = \"loud\"\n")
    with pytest.raises(ConfigError) as info:
        load(p, env={"TRANSFERD_MEMORY_HOST_LIMIT_MIB": "0"})
    keys = [e.split(":")[0] for e in info.value.errors]
    assert keys == ["server.prot", "server.port", "memory.host_limit_mib", "log.level"], keys
    assert str(info.value).count("\n") == 3


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("[server]\nprot = 1\n", "did you mean server.port?"),
        ("[server]\nmax_bodie = 4096\n", "did you mean server.max_body?"),
        ("[servr]\nport = 1\n", "did you mean server?"),
        ("[memory]\nhost_limit = 1\n", "did you mean memory.host_limit_mib?"),
    ],
)
def test_a_typo_suggests_the_nearest_key(tmp_path: Path, text: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=hint.replace("?", r"\?")):
        load(write(tmp_path, text), env={})


def test_env_typo_suggests_the_nearest_key() -> None:
    with pytest.raises(ConfigError, match=r"server.portt: unknown key \(did you mean server.port"):
        load(env={"TRANSFERD_SERVER_PORTT": "1"})


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_nan_and_inf_are_refused(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=r"engine\.peer_timeout_s: must be a finite number"):
        load(write(tmp_path, f"[engine]\npeer_timeout_s = {value}\n"), env={})
    with pytest.raises(ConfigError, match=r"engine\.chaos_max_delay_ms"):
        load(env={"TRANSFERD_ENGINE_CHAOS_MAX_DELAY_MS": value})


def test_max_buffer_over_the_host_limit_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"memory.max_buffer_mib: 64 MiB is over memory.host_l"):
        load(env={"TRANSFERD_MEMORY_HOST_LIMIT_MIB": "32", "TRANSFERD_MEMORY_MAX_BUFFER_MIB": "64"})


@pytest.mark.parametrize("level", ["DEBUG", "Warning", " error "])
def test_log_levels_are_case_insensitive(tmp_path: Path, level: str) -> None:
    assert load(env={"TRANSFERD_LOG_LEVEL": level}).log.level == level.strip().lower()
    p = write(tmp_path, f"[log]\nlevel = \"{level.strip()}\"\nformat = \"JSON\"\n")
    cfg = load(p, env={})
    assert (cfg.log.level, cfg.log.format) == (level.strip().lower(), "json")


def test_sources_say_where_each_value_came_from(tmp_path: Path) -> None:
    p = write(tmp_path, "[server]\nport = 19000\nhost = \"127.0.0.2\"\n")
    cfg, src = cfgmod.load_with_sources(
        p, env={"TRANSFERD_SERVER_PORT": "19001"}, overrides={"log.level": "debug"})
    assert src["server.host"] == f"file {p}"
    assert src["server.port"] == "env TRANSFERD_SERVER_PORT"
    assert src["log.level"] == "flag"
    assert src["memory.host_limit_mib"] == "default"
    assert set(src) == set(cfgmod.all_keys())
    assert cfg.get("server.port") == 19001


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_check_config_passes_the_shipped_examples(path: Path, tmp_path: Path) -> None:
    # An example for another node says so, and shows the flag to check it with.
    text = path.read_text()
    flags = ["--other-node"] if "--other-node" in text else []
    r = check_config(path, node_files(tmp_path) if "token_file" in text else None, *flags)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr or "in use" in r.stderr


def test_check_config_without_a_file_checks_defaults_and_env() -> None:
    r = check_config(None)
    assert r.returncode == 0, r.stderr
    assert "(defaults): OK (tcp://127.0.0.1:18515" in r.stdout
    r = check_config(None, {"TRANSFERD_SERVER_PORT": "70000"})
    assert r.returncode == 3 and "server.port" in r.stderr


def test_check_config_finds_what_serve_would_fail_on(tmp_path: Path) -> None:
    p = write(tmp_path, """
[server]
host = "no-such-host.invalid"
port = 19200
[metrics]
host = "127.0.0.1"
port = 19200
[engine]
host_rails = ["127.0.0.1", "192.0.2.10", "127.0.0.1"]
peer_port = 19200
insecure = true     # (a non-loopback rail without a secret is refused before these checks)
""")
    r = check_config(p, {"TRANSFERD_MEMORY_HOST_LIMIT_MIB": str(1 << 30)})
    assert r.returncode in (3, 4), r.stderr
    lines = r.stderr.splitlines()
    assert any(line.startswith("server.host: 'no-such-host.invalid'") for line in lines), lines
    assert any(line.startswith("engine.host_rails[1]: 192.0.2.10 is not an address of this")
               for line in lines), lines
    assert any(line.startswith("engine.host_rails[2]: 127.0.0.1 is rail 0") for line in lines)
    assert any(line.startswith("engine.peer_port: port 19200") and "metrics.port" in line
               for line in lines), lines
    assert any(line.startswith("memory.host_limit_mib:") and "machine's memory" in line
               for line in lines), lines
    # For another node, only what is wrong anywhere remains.
    r = check_config(p, {"TRANSFERD_MEMORY_HOST_LIMIT_MIB": str(1 << 30)}, "--other-node")
    assert r.returncode == 3
    assert "192.0.2.10" not in r.stderr and "machine's memory" not in r.stderr
    assert "no-such-host.invalid" in r.stderr


def test_check_config_warns_of_a_port_taken_now(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = check_config(write(tmp_path, f"[server]\nport = {port}\n"))
    assert r.returncode == 0, r.stderr
    assert f"warning: server.port: cannot listen on 127.0.0.1:{port}" in r.stderr


def test_check_config_print_shows_values_and_sources(tmp_path: Path) -> None:
    p = write(tmp_path, "[server]\nport = 19300\ntoken = \"s3cret\"\n")
    r = check_config(p, {"TRANSFERD_LOG_LEVEL": "DEBUG"}, "--print")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert f"server.port = 19300  # file {p}" in lines
    assert "log.level = \"debug\"  # env TRANSFERD_LOG_LEVEL" in lines
    assert "memory.host_limit_mib = 4096  # default" in lines
    assert "s3cret" not in r.stdout and f"server.token = \"********\"  # file {p}" in lines
    assert len([x for x in lines if " = " in x]) == len(cfgmod.all_keys())
