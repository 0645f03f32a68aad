"""Settings: flags > KVCM_* variables > TOML file > defaults, and one-line errors naming them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcm.common.errors import ConfigError
from kvcm.core.limits import DEFAULT_LIMITS, Limits
from kvcm.server.cli import _build_parser, main
from kvcm.server.settings import SETTINGS, ServerSettings, load_settings


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvcm.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_every_setting_has_a_flag_a_variable_and_a_key() -> None:
    names = [spec.name for spec in SETTINGS]
    assert len(names) == len(set(names))
    limit_names = {spec.name for spec in SETTINGS if spec.table == "limits"}
    assert limit_names == set(Limits.__dataclass_fields__)
    parser = _build_parser()
    for spec in SETTINGS:
        args = parser.parse_args(["serve", spec.flag, "7"])
        assert getattr(args, spec.name) == "7"
        assert spec.env == "KVCM_" + spec.name.upper()


def test_defaults_are_the_documented_ones() -> None:
    settings = load_settings(environ={})
    assert settings == ServerSettings()
    assert settings.limits == DEFAULT_LIMITS
    assert settings.max_message_bytes == 16 * 1024 * 1024


def test_flag_beats_environment_beats_file_beats_default(tmp_path: Path) -> None:
    config = _file(
        tmp_path,
        '[server]\nlog_level = "ERROR"\nshutdown_grace_s = 1\n'
        "[limits]\nmax_pools = 3\nmax_blocks_per_pool = 30\nmax_total_blocks = 300\n",
    )
    environ = {"KVCM_MAX_POOLS": "4", "KVCM_MAX_BLOCKS_PER_POOL": "40", "KVCM_LOG_LEVEL": "debug"}
    settings = load_settings(config, environ=environ, max_pools="5")
    assert settings.limits.max_pools == 5  # flag
    assert settings.limits.max_blocks_per_pool == 40  # environment
    assert settings.log_level == "DEBUG"  # environment, normalised
    assert settings.limits.max_total_blocks == 300  # file
    assert settings.shutdown_grace_s == 1.0  # file (an int where a float is expected)
    assert settings.limits.max_step_ops == DEFAULT_LIMITS.max_step_ops  # default


def test_the_config_file_can_come_from_the_environment(tmp_path: Path) -> None:
    config = _file(tmp_path, "[limits]\nmax_step_ops = 9\n")
    settings = load_settings(environ={"KVCM_CONFIG": str(config)})
    assert settings.limits.max_step_ops == 9


def test_unrelated_kvcm_variables_are_ignored() -> None:
    assert load_settings(environ={"KVCM_VLLM_SITE": "/x"}) == ServerSettings()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nbogus = 1\n", "unknown key 'bogus' in \\[server\\]"),
        ("[servr]\ngrpc_address = 'a:1'\n", "unknown table or key 'servr'"),
        ("[server]\nmax_pools = 3\n", "'max_pools' belongs in \\[limits\\]"),
        ("[limits]\nmax_pools = 'many'\n", "\\[limits\\] max_pools: max_pools must be an integer"),
        ("[limits]\nmax_pools = true\n", "max_pools must be an integer"),
        ("[limits]\nmax_total_blocks = 0\n", "max_total_blocks must be an int >= 1"),
        ("[server]\ngrpc_address = 'nohost'\n", "\\[server\\] grpc_address: grpc_address"),
        ("[server\n", "config file"),
    ],
)
def test_bad_file_values_name_the_setting(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load_settings(_file(tmp_path, text), environ={})
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("environ", "flags", "message"),
    [
        ({"KVCM_MAX_STEP_TOKENS": "lots"}, {}, "environment KVCM_MAX_STEP_TOKENS: max_step"),
        ({"KVCM_SHUTDOWN_GRACE_S": "-1"}, {}, "KVCM_SHUTDOWN_GRACE_S: shutdown_grace_s must"),
        ({}, {"http_address": "host:70000"}, "flag --http-address: http_address"),
        ({}, {"log_level": "LOUD"}, "flag --log-level: log_level must be one of"),
        ({}, {"registration_timeout_s": "0"}, "flag --registration-timeout-s"),
        ({}, {"max_message_bytes": str(2**31)}, "max_message_bytes must be <= 2147483647"),
    ],
)
def test_bad_variables_and_flags_name_the_setting(
    environ: dict[str, str], flags: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(environ=environ, **flags)


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file") as caught:
        load_settings(tmp_path / "absent.toml", environ={})
    assert "\n" not in str(caught.value)


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("kvcm ")
    assert out.split()[1][0].isdigit()


def test_an_unknown_flag_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--max-everything", "3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--max-everything" in err


def test_docs_list_every_setting_with_its_spellings_and_default() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text("utf-8")
    rows = {line.split("|")[1].strip(" `"): line for line in docs.splitlines() if "| `" in line}
    for spec in SETTINGS:
        row = rows[spec.name]
        assert f"`{spec.flag}`" in row
        assert f"`{spec.env}`" in row
        assert f"`[{spec.table}] {spec.name}`" in row
        assert str(spec.default) in row, spec.name
