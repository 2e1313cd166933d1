"""Settings precedence: defaults < YAML < KVXFERD_* environment < flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvxferd import Settings, load_settings


def test_no_config_at_all_gives_working_defaults() -> None:
    s = load_settings([], environ={})
    assert s == Settings(engine_socket=s.engine_socket)
    assert s.engine_socket.endswith("kvxferd.sock")


def test_each_source_overrides_the_previous(tmp_path: Path) -> None:
    cfg = tmp_path / "kvxferd.yaml"
    cfg.write_text("window: 2\nchunk_bytes: 1048576\npull_timeout_s: 9\ndefault_lease_s: 5\n")
    env = {"KVXFERD_CONFIG": str(cfg), "KVXFERD_CHUNK_BYTES": "2097152", "KVXFERD_PULL_TIMEOUT_S": "8"}
    s = load_settings(["--pull-timeout-s", "7"], environ=env)
    assert s.default_lease_s == 5  # YAML over default
    assert s.window == 2  # YAML
    assert s.chunk_bytes == 2097152  # env over YAML
    assert s.pull_timeout_s == 7  # flag over env


def test_booleans_parse_from_every_source(tmp_path: Path) -> None:
    assert load_settings([], environ={"KVXFERD_LOG_JSON": "yes"}).log_json is True
    assert load_settings(["--no-log-json"], environ={"KVXFERD_LOG_JSON": "1"}).log_json is False


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--window", "0"], {}, "window"),
        ([], {"KVXFERD_CHUNK_BYTES": "lots"}, "KVXFERD_CHUNK_BYTES: expected int"),
        (["--ucx-error-handling", "maybe"], {}, "ucx_error_handling"),
        (["--staging-bytes", "65536", "--chunk-bytes", "131072"], {}, "staging_bytes"),
        (["--chunk-bytes", "4096"], {}, "chunk_bytes"),
    ],
)
def test_bad_values_are_refused_with_their_source(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_settings(argv, environ=env)


def test_unknown_yaml_keys_are_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("windw: 3\n")
    with pytest.raises(ValueError, match="unknown setting 'windw'"):
        load_settings(["--config", str(cfg)], environ={})


def test_help_explains_every_setting_with_its_default_and_environment_variable() -> None:
    from kvxferd._config import build_parser

    text = " ".join(build_parser().format_help().split())  # argparse wraps lines
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        assert f.metadata.get("help"), f"{f.name} has no help text"
        assert f"{flag} " in text
        assert f"env KVXFERD_{f.name.upper()}]" in text
    assert "[default: 8388608; env KVXFERD_CHUNK_BYTES]" in text
