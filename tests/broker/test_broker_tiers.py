"""Broker tiers past one Mosquitto: EMQX's generated rules say what the Mosquitto ACL says (from
the same source), and a bridged Mosquitto pair carries a device's rounds between a site broker
and the core one while the site's ACL still holds each device to its own topics."""

from __future__ import annotations

import getpass
import hashlib
import queue
import re
import secrets
import time
from pathlib import Path

import pytest
from test_acl import TEST_ITERATIONS, Probe, _free_port, _start_mosquitto, _stop

from broker import acl, bridge, emqx
from broker.passwords import hash_credential, new_credential, pbkdf2_parts
from broker.topics import DeviceChannel, device_topic
from coordinator.ops.provisioning import parse_acl
from specfleet import cli

# Quiet time after which a message that was not delivered counts as refused.
NOT_DELIVERED_S = 0.5


def _accounts() -> tuple[list[acl.DeviceAccount], list[acl.ServiceUser]]:
    def hashed() -> str:
        return hash_credential(new_credential(), iterations=TEST_ITERATIONS)

    devices = [acl.DeviceAccount(name, hashed()) for name in ("pi-01", "jetson-7", "phone.a_b")]
    services = [
        acl.ServiceUser(role.value, hashed(), role)
        for role in acl.ServiceRole  # every role, the bridge's included
    ]
    return devices, services


def test_emqx_rules_are_the_mosquitto_rules_for_every_account() -> None:
    devices, services = _accounts()
    mosquitto = parse_acl(acl.generate_acl(devices, services))
    emqx_acl = emqx.generate_emqx_acl(services)
    for account in [*devices, *services]:
        expected = emqx.mosquitto_rules_as_emqx(mosquitto[account.username])
        assert emqx.emqx_effective_rules(emqx_acl, account.username) == expected
    # Someone the registry does not know gets the device rules of their own name only, and
    # cannot authenticate anyway (no row in users.csv).
    stranger = emqx.emqx_effective_rules(emqx_acl, "stranger")
    assert stranger == emqx.mosquitto_rules_as_emqx(acl.device_rules("stranger"))


def test_emqx_users_carry_the_registry_hashes_as_emqx_checks_them() -> None:
    devices, services = _accounts()
    files = emqx.generate_emqx_users(devices, services)
    rows = [line.split(",") for line in files.users_csv.splitlines()]
    assert rows[0] == ["user_id", "password_hash", "salt", "is_superuser"]
    by_user = {row[0]: row for row in rows[1:]}
    assert set(by_user) == {a.username for a in [*devices, *services]}
    service_rows = files.service_users_csv.splitlines()[1:]
    assert {row.split(",")[0] for row in service_rows} == {s.username for s in services}
    assert files.iterations == TEST_ITERATIONS
    credential = new_credential()
    account = acl.DeviceAccount("pi-09", hash_credential(credential, iterations=TEST_ITERATIONS))
    row = emqx.generate_emqx_users([account], []).users_csv.splitlines()[1].split(",")
    # EMQX's pbkdf2: hex of PBKDF2(mac_fun, password, salt as stored, iterations, dk_length).
    digest = hashlib.pbkdf2_hmac("sha512", credential.encode(), row[2].encode(), TEST_ITERATIONS)
    assert row[1] == digest.hex()


@pytest.mark.parametrize(
    ("hashes", "reason"),
    [
        ([hash_credential("x", iterations=100, salt=b"\x00\xff" * 6)], "binary salt"),
        (
            [hash_credential("x", iterations=100), hash_credential("y", iterations=200)],
            "[100, 200]",
        ),
    ],
)
def test_accounts_emqx_cannot_check_are_refused_with_the_reason(
    hashes: list[str], reason: str
) -> None:
    devices = [acl.DeviceAccount(f"pi-{i}", h) for i, h in enumerate(hashes)]
    with pytest.raises(emqx.EmqxExportError, match=re.escape(reason)):
        emqx.generate_emqx_users(devices, [])


def test_new_salts_are_text() -> None:
    assert pbkdf2_parts(hash_credential("x")).salt.isascii()


def test_emqx_conf_names_the_files_the_cluster_and_both_listeners() -> None:
    cluster = emqx.EmqxCluster(static_seeds=("emqx@node-a", "emqx@node-b"))
    text = emqx.render_emqx_conf("/opt/emqx/etc/specfleet", iterations=20000, cluster=cluster)
    assert 'seeds = ["emqx@node-a", "emqx@node-b"]' in text
    assert '"/opt/emqx/etc/specfleet/users.csv"' in text
    assert '"/opt/emqx/etc/specfleet/service-users.csv"' in text
    assert "iterations = 20000" in text and "no_match = deny" in text
    with pytest.raises(ValueError, match="NAME@HOST"):
        emqx.EmqxCluster(static_seeds=("node-a",))


# --- a bridged pair, for real -------------------------------------------------------------------


def _broker_dir(
    path: Path, port: int, devices: list[acl.DeviceAccount], services: list[acl.ServiceUser]
) -> acl.BrokerFiles:
    return acl.write_broker_files(
        path,
        config_text=acl.render_mosquitto_conf(
            path, listeners=[f"{port} 127.0.0.1"], run_as_user=getpass.getuser()
        ),
        acl_text=acl.generate_acl(devices, services),
        passwords_text=acl.generate_passwords(devices, services),
    )


def _nothing_but(probe: Probe, marker: bytes) -> list[tuple[str, bytes]]:
    time.sleep(NOT_DELIVERED_S)
    return probe.receive_until(marker)


def test_a_bridged_pair_carries_rounds_and_the_site_acl_still_holds(tmp_path: Path) -> None:
    suffix = secrets.token_hex(3)
    a, b = f"dev-a-{suffix}", f"dev-b-{suffix}"
    secret = {name: new_credential() for name in (a, b, "coordinator", "site-1")}

    def hashed(name: str) -> str:
        return hash_credential(secret[name], iterations=TEST_ITERATIONS)

    # The core: the coordinator and the site's bridge account. The site: the devices.
    core_port, site_port = _free_port(), _free_port()
    core = _broker_dir(
        tmp_path / "core",
        core_port,
        [],
        [
            acl.ServiceUser("coordinator", hashed("coordinator"), acl.ServiceRole.COORDINATOR),
            acl.ServiceUser("site-1", hashed("site-1"), acl.ServiceRole.BRIDGE),
        ],
    )
    site_dir = tmp_path / "site"
    site = _broker_dir(
        site_dir, site_port, [acl.DeviceAccount(a, hashed(a)), acl.DeviceAccount(b, hashed(b))], []
    )
    link = bridge.BridgeLink("site-1", "127.0.0.1", core_port, "site-1", secret["site-1"])
    bridge.write_bridge(site_dir, link)
    site.config.write_text(bridge.with_bridge(site.config.read_text(), site_dir))
    assert (site_dir / bridge.BRIDGE_DIR / bridge.BRIDGE_FILE).stat().st_mode & 0o777 == 0o600

    running = [_start_mosquitto(core.config, [core_port])]
    opened: list[Probe] = []
    try:
        running.append(_start_mosquitto(site.config, [site_port]))
        coordinator = Probe(core_port, "coordinator", secret["coordinator"], "coordinator")
        device = Probe(site_port, a, secret[a], a)
        opened += [coordinator, device]
        assert not coordinator.connect().is_failure
        assert not device.connect().is_failure
        coordinator.subscribe(f"specfleet/v1/dev/+/{DeviceChannel.DRAFT.value}")
        device.subscribe(
            device_topic(a, DeviceChannel.VERDICT), device_topic(b, DeviceChannel.VERDICT)
        )
        # The bridge connects on its own schedule: wait until a draft crosses.
        deadline = time.monotonic() + 10
        while True:
            device.publish(device_topic(a, DeviceChannel.DRAFT), b"hello")
            try:
                coordinator.receive_until(b"hello")
                break
            except queue.Empty:
                assert time.monotonic() < deadline, running[1].log()
        # Uplink: the device's round reaches the coordinator on the other broker.
        device.publish(device_topic(a, DeviceChannel.DRAFT), b"round-1")
        assert coordinator.receive_until(b"round-1")[-1] == (
            device_topic(a, DeviceChannel.DRAFT),
            b"round-1",
        )
        # Downlink: the verdict comes back across the bridge.
        coordinator.publish(device_topic(a, DeviceChannel.VERDICT), b"verdict-1")
        assert device.receive_until(b"verdict-1")[-1][1] == b"verdict-1"
        # The site's ACL: A cannot speak as B, and does not hear B's verdicts.
        device.publish(device_topic(b, DeviceChannel.DRAFT), b"as-b")
        device.publish(device_topic(a, DeviceChannel.DRAFT), b"marker-up")
        assert _nothing_but(coordinator, b"marker-up") == [
            (device_topic(a, DeviceChannel.DRAFT), b"marker-up")
        ]
        coordinator.publish(device_topic(b, DeviceChannel.VERDICT), b"for-b")
        coordinator.publish(device_topic(a, DeviceChannel.VERDICT), b"marker-down")
        assert _nothing_but(device, b"marker-down") == [
            (device_topic(a, DeviceChannel.VERDICT), b"marker-down")
        ]
    finally:
        for probe in opened:
            probe.close()
        for broker in running:
            _stop(broker)


# --- the commands -------------------------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def registry_db(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[str, str]:
    """A SQLite registry with one device; returns its --database-url and the device id."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("specfleet.commands",))
    url = f"sqlite:///{tmp_path / 'specfleet.db'}"
    assert _cli(capsys, "db", "upgrade", "--database-url", url)[0] == 0
    assert _cli(capsys, "devices", "add", "pi-01", "--kind", "pi", "--database-url", url)[0] == 0
    return url, "pi-01"


def test_write_emqx_writes_the_cluster_files_from_the_registry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], registry_db: tuple[str, str]
) -> None:
    url, device_id = registry_db
    out = tmp_path / "emqx"
    status, said, err = _cli(
        capsys, "broker", "write-emqx", "--out", str(out), "--seed", "emqx@a", "--seed", "emqx@b",
        "--service-user", "coordinator:coordinator", "--service-user", "site-1:bridge",
        "--database-url", url,
    )  # fmt: skip
    assert status == 0, err
    assert said.count("(shown only now)") == 2
    users = (out / emqx.USERS_FILE).read_text().splitlines()
    assert {row.split(",")[0] for row in users[1:]} == {device_id, "coordinator", "site-1"}
    assert (out / emqx.USERS_FILE).stat().st_mode & 0o777 == 0o600
    rules = emqx.emqx_effective_rules((out / emqx.ACL_FILE).read_text(), "site-1")
    assert rules == emqx.mosquitto_rules_as_emqx(acl.service_rules(acl.ServiceRole.BRIDGE))
    assert 'seeds = ["emqx@a", "emqx@b"]' in (out / emqx.CONFIG_FILE).read_text()


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["write-emqx", "--seed", "nobody"], "NAME@HOST"),
        (["write-config", "--bridge-to", "mqtt://core:1884"], "needs --bridge-username"),
        (["write-config", "--bridge-username", "site-1"], "go with --bridge-to"),
        (
            ["write-config", "--bridge-to", "http://core", "--bridge-username", "s",
             "--bridge-credential", "/dev/null"],
            "scheme must be mqtt",
        ),
    ],
)  # fmt: skip
def test_bad_tier_arguments_are_refused_with_the_reason(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    registry_db: tuple[str, str],
    argv: list[str],
    reason: str,
) -> None:
    url, _ = registry_db
    status, _, err = _cli(
        capsys, "broker", *argv[:1], "--out", str(tmp_path / "x"), *argv[1:], "--database-url", url
    )
    assert status == 2
    assert reason in err


def test_write_config_bridge_to_makes_a_site_broker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], registry_db: tuple[str, str]
) -> None:
    url, _ = registry_db
    credential = tmp_path / "bridge-credential"
    credential.write_text("core-side-secret\n")
    status, _, err = _cli(
        capsys, "broker", "write-config", "--out", str(tmp_path / "site"),
        "--bridge-to", "mqtt://core.example:1884", "--bridge-username", "site-1",
        "--bridge-credential", str(credential), "--database-url", url,
    )  # fmt: skip
    assert status == 0, err
    block = (tmp_path / "site" / bridge.BRIDGE_DIR / bridge.BRIDGE_FILE).read_text()
    assert "address core.example:1884" in block and "remote_password core-side-secret" in block
    assert "include_dir" in (tmp_path / "site" / acl.CONFIG_FILE).read_text()
