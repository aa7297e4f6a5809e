"""`specfleet devices provision`: registry, broker files and reload, bundle; on a real Mosquitto."""

from __future__ import annotations

import asyncio
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from deploy_support import isolation, run_cli
from sqlalchemy.engine import Engine

from broker.client import (
    BrokerAddress,
    BusAuthError,
    ConnectOptions,
    connect,
)
from broker.mosquitto import PrivateMosquitto
from coordinator.db.engine import make_sessionmaker
from coordinator.provisioning import parse_acl
from coordinator.registry import DeviceRegistry
from device_agent.settings import load_agent_settings


def write_config(broker_dir: Path, database_url: str, capsys: pytest.CaptureFixture[str]) -> str:
    """`broker write-config`; returns the coordinator's new credential."""
    assert (
        run_cli(
            ["broker", "write-config", "--out", str(broker_dir), "--database-url", database_url]
        )
        == 0
    )
    found = re.search(
        r"new coordinator user coordinator: credential (\S+)", capsys.readouterr().out
    )
    assert found is not None
    return found.group(1)


def provision(name: str, broker_dir: Path, database_url: str, out: Path, *extra: str) -> int:
    return run_cli(
        [
            "devices", "provision", name, "--kind", "pi", "--tag", "lab",
            "--out", str(out),
            "--broker-dir", str(broker_dir),
            "--broker-pid-file", str(broker_dir / "mosquitto.pid"),
            "--database-url", database_url,
            *extra,
        ]
    )  # fmt: skip


async def try_connect(url: str, username: str, password: str) -> None:
    options = ConnectOptions(client_id=f"probe-{username}", username=username, password=password)
    async with connect(BrokerAddress.from_url(url), options):
        pass


ISOLATED = {"read": [b"own command"], "written": [b"own status"]}


@pytest.fixture
def settings_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("SPECFLEET_HOME", str(home))
    return home


def test_provision_registers_updates_and_reloads_the_broker_and_writes_a_bundle(
    tmp_path: Path,
    sqlite_db: tuple[str, Engine],
    broker_dir: Path,
    secured_mosquitto: Callable[[], PrivateMosquitto],
    settings_home: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, engine = sqlite_db
    coordinator = ("coordinator", write_config(broker_dir, url, capsys))
    broker = secured_mosquitto()
    monkeypatch.setenv("SPECFLEET_BROKER_URL", broker.url)

    bundle = tmp_path / "bundles" / "pi-1"
    assert provision("pi-1", broker_dir, url, bundle) == 0
    assert "sent SIGHUP" in capsys.readouterr().out

    # The bundle: a private credential whose hash alone is in the database.
    credential = (bundle / "credential").read_text().strip()
    assert stat.S_IMODE((bundle / "credential").stat().st_mode) == 0o600
    registry = DeviceRegistry(make_sessionmaker(engine))
    assert registry.verify_credential("pi-1", credential)
    assert credential.encode() not in Path(url.removeprefix("sqlite:///")).read_bytes()
    assert sorted(p.name for p in bundle.iterdir()) == [
        "agent.toml", "credential", "device.json", "drafts.json", "release-key.pub.pem",
    ]  # fmt: skip
    cwd = Path.cwd()
    os.chdir(bundle)  # the bundle's paths are relative to itself
    try:
        settings = load_agent_settings(Path("agent.toml"))
    finally:
        os.chdir(cwd)
    assert (settings.device_id, settings.credential, settings.kind) == ("pi-1", credential, "pi")
    assert settings.broker_url == broker.url

    # The broker took the new device without a restart, and keeps it to its own topics.
    assert asyncio.run(isolation(broker.url, "pi-1", credential, coordinator, "pi-x")) == ISOLATED
    # The probe does see leaks: the coordinator's own account, which may use every topic.
    leaky = asyncio.run(isolation(broker.url, "coordinator", coordinator[1], coordinator, "pi-x"))
    assert b"foreign command" in leaky["read"] and b"forged status" in leaky["written"]
    with pytest.raises(BusAuthError):
        asyncio.run(try_connect(broker.url, "pi-1", "not-the-credential"))

    # A second device: the first keeps its account, the service user keeps its block.
    assert provision("pi-2", broker_dir, url, tmp_path / "bundles" / "pi-2") == 0
    blocks = parse_acl((broker_dir / "acl").read_text())
    assert set(blocks) == {"coordinator", "pi-1", "pi-2"}
    second = (tmp_path / "bundles" / "pi-2" / "credential").read_text().strip()
    assert asyncio.run(isolation(broker.url, "pi-2", second, coordinator, "pi-1")) == ISOLATED
    assert asyncio.run(isolation(broker.url, "pi-1", credential, coordinator, "pi-2")) == ISOLATED


def test_provision_bundles_the_ca_for_tls_brokers_and_the_chosen_drafts(
    tmp_path: Path,
    sqlite_db: tuple[str, Engine],
    settings_home: Path,
    draft_dir: Path,
) -> None:
    url, _ = sqlite_db
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    bundle = tmp_path / "bundle"
    code = run_cli(
        [
            "devices", "provision", "jet-1", "--kind", "jetson",
            "--device-broker-url", "mqtts://fleet.example:8883", "--ca-file", str(ca),
            "--draft", draft_dir.name, "--models-dir", str(draft_dir.parent),
            "--out", str(bundle), "--database-url", url,
        ]
    )  # fmt: skip
    assert code == 0
    assert (bundle / "ca.crt").read_bytes() == ca.read_bytes()
    assert 'ca_file = "ca.crt"' in (bundle / "agent.toml").read_text()
    drafts = (bundle / "drafts.json").read_text()
    assert draft_dir.name in drafts and '"sha256"' in drafts


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--draft", "no-such-draft"], "--draft no-such-draft"),
        (["--kind", "toaster"], "--kind 'toaster'"),
        (["--device-broker-url", "http://x"], "scheme must be mqtt"),
        (["--broker-pid-file", "/nonexistent"], "needs --broker-dir"),
    ],
)
def test_provision_refuses_bad_input_before_registering(
    tmp_path: Path,
    sqlite_db: tuple[str, Engine],
    settings_home: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    url, engine = sqlite_db
    argv = ["devices", "provision", "pi-9", "--kind", "pi", "--out", str(tmp_path / "b")]
    argv += ["--models-dir", str(tmp_path), "--database-url", url, *extra]
    assert run_cli(argv) == 2
    assert message in capsys.readouterr().out
    assert DeviceRegistry(make_sessionmaker(engine)).count() == 0


def test_a_lost_bundle_is_reissued_with_a_new_credential(
    tmp_path: Path, sqlite_db: tuple[str, Engine], settings_home: Path
) -> None:
    url, engine = sqlite_db
    base = ["devices", "provision", "pi-3", "--kind", "pi", "--database-url", url]
    assert run_cli([*base, "--out", str(tmp_path / "first")]) == 0
    assert run_cli([*base, "--out", str(tmp_path / "first")]) == 2  # never overwritten
    assert run_cli([*base, "--out", str(tmp_path / "second"), "--rotate"]) == 0
    old = (tmp_path / "first" / "credential").read_text().strip()
    new = (tmp_path / "second" / "credential").read_text().strip()
    registry = DeviceRegistry(make_sessionmaker(engine))
    assert registry.verify_credential("pi-3", new)
    assert not registry.verify_credential("pi-3", old)
