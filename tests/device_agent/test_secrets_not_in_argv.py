"""Secrets never travel in argv, where `ps` shows them to every user of the machine: the agent's
credential and the verifier's broker password come from a file or the environment."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from device_agent import cli as agent_cli
from verifier import commands as verifier_commands


@pytest.mark.parametrize("command", ["run", "ask"])
def test_the_agent_takes_no_credential_in_argv(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = agent_cli.build_parser()
    prompt = ["hello"] if command == "ask" else []
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([command, *prompt, "--device-id", "pi-1", "--credential", "s3cret"])
    assert exited.value.code == 2
    assert "--credential" in capsys.readouterr().err


def test_the_agent_reads_its_credential_from_a_file(tmp_path: Path) -> None:
    secret_file = tmp_path / "credential"
    secret_file.write_text("s3cret\n")
    secret_file.chmod(0o600)
    args = agent_cli.build_parser().parse_args(
        ["run", "--device-id", "pi-1", "--credential-file", str(secret_file)]
    )
    assert agent_cli._settings(args).credential == "s3cret"


def test_the_agent_reads_its_credential_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPECFLEET_CREDENTIAL", "from-env")
    args = agent_cli.build_parser().parse_args(["run", "--device-id", "pi-1"])
    assert agent_cli._settings(args).credential == "from-env"


def test_the_verifier_takes_no_password_in_argv(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    verifier_commands.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--password", "s3cret"])
    password_file = tmp_path / "password"
    password_file.write_text("s3cret\n")
    args = parser.parse_args(["--password-file", str(password_file)])
    assert verifier_commands._password(args.password_file) == "s3cret"
