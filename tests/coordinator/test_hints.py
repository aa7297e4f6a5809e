"""The hints the CLI gives point at commands that exist and work: a mistyped SQLite path is
refused (not created), a device made with `devices add` is told how to get a bundle to flash,
and `models deploy` without a running API names `specfleet up`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from broker.mosquitto import free_port
from inference.artifacts import default_models_dir
from specfleet import cli

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def specfleet(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Run:
    """`specfleet ARGS...` in-process -> (exit status, stdout, stderr)."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("specfleet.commands",))

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            status = cli.main(list(argv))
        except SystemExit as exc:
            status = int(exc.code or 0)
        out, err = capsys.readouterr()
        return status, out, err

    return run


@pytest.mark.parametrize(
    "argv",
    [
        ["devices", "list"],
        ["devices", "list", "--json"],
        ["devices", "add", "pi-1", "--kind", "pi"],
        ["admin", "list"],
        ["db", "current"],
        ["db", "check"],
        ["db", "downgrade", "base"],
        ["replay", "00000000-0000-0000-0000-000000000001"],
    ],
)
def test_a_mistyped_sqlite_path_is_refused_not_created(
    specfleet: Run, tmp_path: Path, argv: list[str]
) -> None:
    typo = tmp_path / "sttate" / "specfleet.db"
    status, out, err = specfleet(*argv, "--database-url", f"sqlite:///{typo}")
    assert status == 2
    assert err.strip().splitlines() == [
        f"specfleet {argv[0]}: no such database: {typo} "
        f"(`specfleet db upgrade --database-url sqlite:///{typo}` creates one)"
    ]
    assert out == ""
    assert not typo.exists()
    assert not typo.parent.exists()


def test_db_upgrade_creates_the_file(specfleet: Run, tmp_path: Path) -> None:
    path = tmp_path / "state" / "specfleet.db"
    status, out, _ = specfleet("db", "upgrade", "--database-url", f"sqlite:///{path}")
    assert status == 0
    assert path.is_file()
    assert out.startswith("database revision: ")
    assert specfleet("devices", "list", "--database-url", f"sqlite:///{path}")[0] == 0


def test_a_device_made_with_add_is_told_how_to_get_a_bundle(
    specfleet: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = f"sqlite:///{tmp_path / 'specfleet.db'}"
    monkeypatch.setenv("SPECFLEET_DATABASE_URL", db)  # flash reads the registry from settings
    monkeypatch.setenv("SPECFLEET_HOME", str(tmp_path / "home"))
    assert specfleet("db", "upgrade")[0] == 0
    status, out, _ = specfleet("devices", "add", "pi-kitchen", "--kind", "pi")
    assert status == 0
    rotate = "`specfleet devices provision pi-kitchen --kind pi --rotate`"
    assert f"No bundle was written, so `specfleet flash` has nothing to install: {rotate}" in out

    target = tmp_path / "card"
    status, _, err = specfleet("flash", "pi-kitchen", "--target-dir", str(target), "--dry-run")
    assert status == 2
    assert len(err.strip().splitlines()) == 1
    assert "pi-kitchen is registered but has no bundle (`devices add` writes none); " in err
    assert f"{rotate} writes one, with a new credential" in err

    # What `provision` without --rotate says of an existing device, and that --rotate works
    # without --kind (the registry knows it).
    status, _, err = specfleet("devices", "provision", "pi-kitchen", "--kind", "pi")
    assert status == 2
    assert "already exists (ids are never reused); `--rotate` gives it a new credential" in err
    status, out, err = specfleet("devices", "provision", "pi-kitchen", "--rotate")
    assert status == 0, err
    assert (tmp_path / "home" / "bundles" / "pi-kitchen" / "device.json").is_file()
    assert "next        specfleet flash pi-kitchen --ssh USER@HOST" in out

    # A device nobody registered gets the plain hint.
    status, _, err = specfleet("flash", "pi-nowhere", "--target-dir", str(target), "--dry-run")
    assert status == 2
    assert "run `specfleet devices provision pi-nowhere --kind KIND` first" in err


def test_a_new_device_still_needs_its_kind(specfleet: Run, sqlite_url: str) -> None:
    assert specfleet("db", "upgrade", "--database-url", sqlite_url)[0] == 0
    status, _, err = specfleet("devices", "provision", "pi-new", "--database-url", sqlite_url)
    assert status == 2
    assert "--kind is required for a new device: pi, jetson, phone or other" in err


def test_models_deploy_without_an_api_names_specfleet_up(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    env["SPECFLEET_HOME"] = str(tmp_path)
    url = f"http://127.0.0.1:{free_port()}/api/v1"
    done = subprocess.run(
        [sys.executable, "-m", "specfleet", "models", "deploy", "draft-l1", "--to", "lab",
         "--artifact-url", url, "--models-dir", str(default_models_dir())],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("specfleet models: the coordinator's API is not reachable at " + url)
    assert line.endswith("start it (`specfleet up`) or pass --artifact-url")
    assert "serve" not in line
