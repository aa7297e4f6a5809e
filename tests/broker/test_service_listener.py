"""The cloud's own Mosquitto listener (`write-config --service-listener`): replicas of a service
share one account there, devices cannot log in there, and every device listener still ties
client ids to usernames. Enforced by a real private Mosquitto."""

from __future__ import annotations

import getpass
import re
import secrets
import time
from pathlib import Path

import pytest
from test_acl import Probe, _free_port, _start_mosquitto, _stop

from broker import acl
from broker.topics import DeviceChannel, device_topic
from specfleet import cli

# A takeover is one broker round trip; give paho's callback thread a moment to count it.
TAKEOVER_WAIT_S = 1.0


def _specfleet(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert status == 0, err
    return out


def _listener_blocks(config_text: str) -> list[dict[str, str]]:
    """Each listener's own options, as Mosquitto reads them (a listener line opens a block)."""
    blocks: list[dict[str, str]] = []
    for raw in config_text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition(" ")
        if key == "listener":
            blocks.append({"listener": value})
        elif blocks and key in acl.LISTENER_AUTH_OPTIONS:
            blocks[-1][key] = value
    return blocks


@pytest.mark.parametrize("tls", [False, True])
def test_every_device_listener_ties_client_ids_to_usernames(tmp_path: Path, tls: bool) -> None:
    """use_username_as_clientid is a listener's own option in Mosquitto 2, even with
    per_listener_settings false: the TLS listener needs its own line."""
    files = acl.TlsFiles(tmp_path / "c.pem", tmp_path / "k.pem") if tls else None
    for service_listener in (None, "1884"):
        text = acl.render_mosquitto_conf(tmp_path, tls=files, service_listener=service_listener)
        blocks = _listener_blocks(text)
        devices = blocks[:-1] if service_listener else blocks
        assert devices and all(b["use_username_as_clientid"] == "true" for b in devices)
        if service_listener:
            assert blocks[-1]["use_username_as_clientid"] == "false"
            assert blocks[-1]["password_file"] == str(tmp_path.resolve() / "service-passwords")
            assert all(b["password_file"] == str(tmp_path.resolve() / "passwords") for b in devices)


def test_replicas_share_an_account_on_the_service_listener_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("specfleet.commands",))
    db = ("--database-url", f"sqlite:///{tmp_path / 'specfleet.db'}")
    device_id = f"pi-{secrets.token_hex(4)}"
    _specfleet(capsys, "db", "upgrade", *db)
    added = _specfleet(capsys, "devices", "add", device_id, "--kind", "pi", *db)
    device_secret = re.search(r"^credential\s+(\S+)$", added, re.MULTILINE)
    assert device_secret
    verifier_file = tmp_path / "verifier-credential"
    verifier_file.write_text("a-mounted-secret\n")
    device_port, service_port = _free_port(), _free_port()
    written = _specfleet(
        capsys, "broker", "write-config", "--out", str(tmp_path / "broker"),
        "--listener", f"{device_port} 127.0.0.1", "--service-listener", f"{service_port} 127.0.0.1",
        "--service-user", "coordinator:coordinator", "--service-user", "verifier:verifier",
        "--service-credential", f"verifier={verifier_file}",
        "--run-as-user", getpass.getuser(), *db,
    )  # fmt: skip
    assert "new verifier user" not in written  # its credential came from the file
    coordinator = re.search(r"^new coordinator user coordinator: credential (\S+)", written, re.M)
    assert coordinator
    service_hashes = acl.parse_passwords((tmp_path / "broker" / "service-passwords").read_text())
    assert set(service_hashes) == {"coordinator", "verifier"}

    running = _start_mosquitto(tmp_path / "broker" / acl.CONFIG_FILE, [device_port, service_port])
    opened: list[Probe] = []

    def probe(port: int, username: str, secret: str, client_id: str) -> Probe:
        opened.append(Probe(port, username, secret, client_id))
        return opened[-1]

    try:
        replicas = [
            probe(service_port, "verifier", "a-mounted-secret", f"verifier-{i}") for i in (1, 2)
        ]
        for replica in replicas:
            assert not replica.connect().is_failure
            replica.subscribe("specfleet/v1/verifier/+/work")
        sender = probe(service_port, "coordinator", coordinator.group(1), "coordinator-a")
        assert not sender.connect().is_failure
        sender.publish("specfleet/v1/verifier/verifier-1/work", b"both hear it")
        for replica in replicas:
            assert replica.receive_until(b"both hear it")
        # A device's credential does not open the service listener.
        assert probe(service_port, device_id, device_secret.group(1), "sneaky").connect().is_failure
        # On the device listener one account still holds one connection: the second takes over.
        first = probe(device_port, device_id, device_secret.group(1), "first")
        assert not first.connect().is_failure
        second = probe(device_port, device_id, device_secret.group(1), "coordinator")
        assert not second.connect().is_failure
        time.sleep(TAKEOVER_WAIT_S)
        assert first.disconnects >= 1
        assert all(replica.disconnects == 0 for replica in replicas)
        assert sender.disconnects == 0
        # paho reconnects by itself, so the two now take the id from each other; stop both.
        first.close()
        second.close()
        device = probe(device_port, device_id, device_secret.group(1), "again")
        assert not device.connect().is_failure
        device.subscribe(device_topic(device_id, DeviceChannel.VERDICT))
        sender.publish(device_topic(device_id, DeviceChannel.VERDICT), b"to the device")
        assert device.receive_until(b"to the device")
    finally:
        for opened_probe in opened:
            opened_probe.close()
        _stop(running)


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--service-credential", "verifier"], "expected NAME=FILE"),
        (["--service-credential", "nobody=/dev/null"], "not one of the service users"),
        (["--service-credential", "coordinator=/nonexistent/file"], "No such file"),
    ],
)
def test_bad_service_credentials_are_refused_with_the_reason(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    reason: str,
) -> None:
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("specfleet.commands",))
    db = ("--database-url", f"sqlite:///{tmp_path / 'specfleet.db'}")
    _specfleet(capsys, "db", "upgrade", *db)
    status = cli.main(["broker", "write-config", "--out", str(tmp_path / "b"), *argv, *db])
    assert status != 0
    assert reason in capsys.readouterr().err
