"""A settings file for the cloud processes (`specfleet --config FILE` or SPECFLEET_CONFIG): TOML
of the environment's names, under the environment and over the defaults; a missing, broken or
misspelt file is refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.settings import CONFIG_ENV, ConfigFileError, Settings, check_config_file


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_file_sits_between_the_environment_and_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [k for k in os.environ if k.startswith("SPECFLEET_")]:
        monkeypatch.delenv(name)
    config = _write(
        tmp_path / "specfleet.toml",
        f'http_port = 8500\nhome = "{tmp_path}"\ncoordinator_id = "coordinator-a"\n',
    )
    monkeypatch.setenv(CONFIG_ENV, str(config))
    monkeypatch.setenv("SPECFLEET_COORDINATOR_ID", "coordinator-b")
    settings = Settings()
    assert settings.http_port == 8500  # from the file
    assert settings.coordinator_id == "coordinator-b"  # the environment wins
    assert settings.database_url == f"sqlite:///{tmp_path / 'specfleet.db'}"  # derived from home
    assert settings.broker_url == "mqtt://127.0.0.1:1883"  # the default
    monkeypatch.delenv(CONFIG_ENV)
    assert Settings().http_port == 8420


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (None, "no such file"),
        ("http_port = [\n", "not TOML"),
        ('database_ulr = "sqlite:///x.db"\n', "no such setting: database_ulr"),
    ],
)
def test_a_bad_file_is_refused_with_the_reason(
    tmp_path: Path, text: str | None, reason: str
) -> None:
    path = tmp_path / "specfleet.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigFileError, match=reason):
        check_config_file(path)


def _specfleet(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    return subprocess.run(
        [sys.executable, "-m", "specfleet", *argv],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_commands_take_the_file_from_config(tmp_path: Path) -> None:
    database = tmp_path / "from-the-file.db"
    config = _write(tmp_path / "specfleet.toml", f'database_url = "sqlite:///{database}"\n')
    done = _specfleet("--config", str(config), "db", "upgrade")
    assert done.returncode == 0, done.stderr
    assert database.is_file()
    listed = _specfleet("devices", "list", "--config", str(config))  # after the command too
    assert (listed.returncode, listed.stdout) == (0, "no devices\n")


def test_a_misspelt_setting_stops_the_command_in_one_line(tmp_path: Path) -> None:
    config = _write(tmp_path / "specfleet.toml", "http_prot = 8500\n")
    done = _specfleet("--config", str(config), "devices", "list")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"specfleet: settings: {config}: no such setting: http_prot"
    ]
