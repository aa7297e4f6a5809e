"""`specfleet db|devices|broker ...` end to end on real SQLite and PostgreSQL databases."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from broker import acl
from broker.passwords import verify_credential
from coordinator.db import migrate
from specfleet import cli

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def specfleet(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Run:
    """`specfleet ARGS...` in-process -> (exit status, stdout, stderr)."""
    # Only this package's commands: other roles' modules are not under test here.
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("specfleet.commands",))

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            status = cli.main(list(argv))
        except SystemExit as exc:  # argparse errors
            status = int(exc.code or 0)
        out, err = capsys.readouterr()
        return status, out, err

    return run


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(
    request: pytest.FixtureRequest, sqlite_url: str, create_pg_database: Callable[[], str]
) -> str:
    return sqlite_url if request.param == "sqlite" else create_pg_database()


def _credential(stdout: str) -> str:
    match = re.search(r"^credential\s+(\S+)$", stdout, re.MULTILINE)
    assert match, stdout
    return match.group(1)


def _create_empty_sqlite(url: str) -> None:
    """The file an empty SQLite database is (commands other than `db upgrade` create none)."""
    path = Path(url.removeprefix("sqlite:///"))
    path.parent.mkdir(parents=True, exist_ok=True)
    sqlite3.connect(path).close()


def test_db_upgrade_check_current_downgrade(specfleet: Run, database_url: str) -> None:
    db = ("--database-url", database_url)
    if database_url.startswith("sqlite"):
        _create_empty_sqlite(database_url)
    assert specfleet("db", "current", *db)[1] == "database revision: none (empty database)\n"
    status, _, err = specfleet("db", "check", *db)
    assert status == 2
    assert "specfleet db upgrade" in err
    status, out, _ = specfleet("db", "upgrade", *db)
    assert (status, out) == (0, f"database revision: {migrate.head_revision()}\n")
    assert specfleet("db", "check", *db)[0] == 0
    assert specfleet("db", "downgrade", "base", *db)[0] == 0
    assert specfleet("db", "current", *db)[1] == "database revision: none (empty database)\n"


def test_devices_add_prints_the_credential_once(specfleet: Run, sqlite_url: str) -> None:
    db = ("--database-url", sqlite_url)
    specfleet("db", "upgrade", *db)
    status, out, _ = specfleet("devices", "add", "pi-01", "--kind", "pi", "--tag", "lab", *db)
    assert status == 0
    credential = _credential(out)

    status, listing, _ = specfleet("devices", "list", "--json", *db)
    assert status == 0
    (device,) = json.loads(listing)
    assert (device["id"], device["kind"], device["status"], device["tags"]) == (
        "pi-01",
        "pi",
        "offline",
        ["lab"],
    )
    table = specfleet("devices", "list", *db)[1]
    assert "pi-01" in table
    for shown in (listing, table):
        assert credential not in shown
        assert "$7$" not in shown

    status, out, _ = specfleet("devices", "add", "ph-1", "--kind", "phone", "--json", *db)
    assert status == 0
    assert set(json.loads(out)) == {"id", "kind", "credential"}
    assert (
        json.loads(specfleet("devices", "list", "--kind", "phone", "--json", *db)[1])[0]["id"]
        == "ph-1"
    )


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["devices", "add", "bad/id", "--kind", "pi"], "invalid device id"),
        (["devices", "add", "pi-9", "--kind", "toaster"], "choose one of pi, jetson"),
        (["devices", "add", "pi-01", "--kind", "pi"], "already exists"),
        (["devices", "list", "--status", "asleep"], "choose one of online"),
        (["devices", "retire", "ghost"], "no device 'ghost'"),
        (["db", "downgrade", "nonsense"], "nonsense"),
        (["broker", "write-config", "--out", "{tmp}", "--tls"], "--certfile and --keyfile"),
        (["broker", "write-config", "--out", "{tmp}", "--service-user", "x"], "NAME:ROLE"),
        (["broker", "write-config", "--out", "{tmp}", "--service-user", "x:root"], "choose"),
        (
            ["broker", "write-config", "--out", "{tmp}", "--service-user", "pi-01:coordinator"],
            "username 'pi-01'",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(
    specfleet: Run, sqlite_url: str, tmp_path: Path, argv: list[str], reason: str
) -> None:
    db = ("--database-url", sqlite_url)
    specfleet("db", "upgrade", *db)
    specfleet("devices", "add", "pi-01", "--kind", "pi", *db)
    args = [a.replace("{tmp}", str(tmp_path / "broker")) for a in argv]
    status, _, err = specfleet(*args, *db)
    assert status == 2
    assert len(err.strip().splitlines()) == 1
    assert reason in err


def test_commands_refuse_a_database_that_is_not_migrated(specfleet: Run, sqlite_url: str) -> None:
    _create_empty_sqlite(sqlite_url)  # as a failed first upgrade leaves it
    status, _, err = specfleet("devices", "list", "--database-url", sqlite_url)
    assert status == 2
    assert "run `specfleet db upgrade`" in err


def test_unreachable_database_is_a_one_line_error(specfleet: Run) -> None:
    status, _, err = specfleet("devices", "list", "--database-url", "postgresql://x@127.0.0.1:1/x")
    assert status == 2
    assert err.startswith("specfleet devices: database error:")
    assert len(err.strip().splitlines()) == 1


def test_write_config_builds_broker_files_from_stored_hashes(
    specfleet: Run, sqlite_url: str, tmp_path: Path
) -> None:
    db = ("--database-url", sqlite_url)
    out_dir = tmp_path / "broker"
    specfleet("db", "upgrade", *db)
    keep = _credential(specfleet("devices", "add", "pi-01", "--kind", "pi", *db)[1])
    specfleet("devices", "add", "pi-02", "--kind", "pi", *db)

    status, out, _ = specfleet(
        "broker", "write-config", "--out", str(out_dir),
        "--service-user", "coordinator:coordinator", "--service-user", "verifier-0:verifier", *db,
    )  # fmt: skip
    assert status == 0
    new_users = dict(re.findall(r"^new \w+ user (\S+): credential (\S+)", out, re.MULTILINE))
    assert set(new_users) == {"coordinator", "verifier-0"}
    hashes = acl.parse_passwords((out_dir / acl.PASSWORD_FILE).read_text())
    assert set(hashes) == {"coordinator", "verifier-0", "pi-01", "pi-02"}
    assert verify_credential(keep, hashes["pi-01"])
    assert verify_credential(new_users["coordinator"], hashes["coordinator"])
    assert (out_dir / acl.PASSWORD_FILE).stat().st_mode & 0o777 == 0o600
    assert "user pi-02" in (out_dir / acl.ACL_FILE).read_text()

    # Rerun after retiring a device: services keep their hashes, the device is gone.
    specfleet("devices", "retire", "pi-02", "--reason", "broken", *db)
    status, out, _ = specfleet(
        "broker", "write-config", "--out", str(out_dir),
        "--service-user", "coordinator:coordinator", "--service-user", "verifier-0:verifier", *db,
    )  # fmt: skip
    assert status == 0
    assert "new " not in out
    again = acl.parse_passwords((out_dir / acl.PASSWORD_FILE).read_text())
    assert set(again) == {"coordinator", "verifier-0", "pi-01"}
    assert again["coordinator"] == hashes["coordinator"]
    assert "pi-02" not in (out_dir / acl.ACL_FILE).read_text()
