"""Generated ACL, passwords and config, enforced by a real private Mosquitto on a free port."""

from __future__ import annotations

import getpass
import queue
import re
import secrets
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.reasoncodes import ReasonCode

from broker import acl
from broker.passwords import hash_credential, new_credential, verify_credential
from broker.topics import UPLINK_CHANNELS, DeviceChannel, device_topic
from specfleet import cli

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
START_TIMEOUT_S = 10.0
WAIT_S = 5.0
# Low stretching keeps connects fast here; the broker reads the count from each hash.
TEST_ITERATIONS = 100


# --- a private broker --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class RunningBroker:
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _start_mosquitto(config_path: Path, ports: list[int]) -> RunningBroker:
    log_path = config_path.with_suffix(".log")
    with log_path.open("wb") as log:
        process = subprocess.Popen([MOSQUITTO, "-c", str(config_path)], stdout=log, stderr=log)
    running = RunningBroker(ports[0], process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    for port in ports:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"mosquitto exited {process.returncode}:\n{running.log()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    process.kill()
                    raise RuntimeError(f"mosquitto did not listen:\n{running.log()}") from None
                time.sleep(0.02)
    return running


def _stop(running: RunningBroker) -> None:
    running.process.terminate()
    try:
        running.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        running.process.kill()
        running.process.wait()


@dataclass
class Fleet:
    broker: RunningBroker
    credentials: dict[str, str]  # username -> plaintext
    a: str
    b: str
    coordinator: str
    verifier: str


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Devices A and B and a coordinator, on a broker configured only by the generated files."""
    suffix = secrets.token_hex(4)  # unique topics per test
    a, b, coordinator = f"dev-a-{suffix}", f"dev-b-{suffix}", f"coord-{suffix}"
    verifier = f"verifier-{suffix}"
    credentials = {name: new_credential() for name in (a, b, coordinator, verifier)}

    def hashed(name: str) -> str:
        return hash_credential(credentials[name], iterations=TEST_ITERATIONS)

    devices = [acl.DeviceAccount(a, hashed(a)), acl.DeviceAccount(b, hashed(b))]
    services = [
        acl.ServiceUser(coordinator, hashed(coordinator), acl.ServiceRole.COORDINATOR),
        acl.ServiceUser(verifier, hashed(verifier), acl.ServiceRole.VERIFIER),
    ]
    port = _free_port()
    files = acl.write_broker_files(
        tmp_path,
        config_text=acl.render_mosquitto_conf(
            tmp_path, listeners=[f"{port} 127.0.0.1"], run_as_user=getpass.getuser()
        ),
        acl_text=acl.generate_acl(devices, services),
        passwords_text=acl.generate_passwords(devices, services),
    )
    running = _start_mosquitto(files.config, [port])
    yield Fleet(running, credentials, a, b, coordinator, verifier)
    _stop(running)


# --- paho clients ------------------------------------------------------------------------------


class Probe:
    """A paho client that records its CONNACK and queues every message it receives."""

    def __init__(
        self, port: int, username: str | None, password: str | None, client_id: str | None = None
    ) -> None:
        self.port = port
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.connack: ReasonCode | None = None
        self.disconnects = 0  # paho reconnects by itself: count what the broker cut
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"probe-{secrets.token_hex(4)}",
            protocol=mqtt.MQTTv311,
        )
        if username is not None:
            self.client.username_pw_set(username, password)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *_: self._subscribed.set()
        self.client.on_disconnect = self._on_disconnect

    def _on_connect(self, _c: object, _u: object, _f: object, rc: ReasonCode, _p: object) -> None:
        self.connack = rc
        if rc.is_failure:
            # Stop paho's loop from retrying the refused connection.
            self.client.disconnect()
        self._connected.set()

    def _on_disconnect(self, *_: object) -> None:
        self.disconnects += 1

    def _on_message(self, _c: object, _u: object, message: mqtt.MQTTMessage) -> None:
        self.messages.put((message.topic, bytes(message.payload)))

    def connect(self, *, ca_certs: str | None = None) -> ReasonCode:
        if ca_certs is not None:
            self.client.tls_set(ca_certs=ca_certs)
        self.client.connect("127.0.0.1", self.port, keepalive=30)
        self.client.loop_start()
        assert self._connected.wait(WAIT_S), "no CONNACK"
        assert self.connack is not None
        return self.connack

    def subscribe(self, *topics: str) -> None:
        self._subscribed.clear()
        self.client.subscribe([(topic, 1) for topic in topics])
        assert self._subscribed.wait(WAIT_S), "no SUBACK"

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(WAIT_S)

    def receive_until(self, last_payload: bytes) -> list[tuple[str, bytes]]:
        """Everything received up to and including `last_payload`."""
        received = []
        while True:
            topic, payload = self.messages.get(timeout=WAIT_S)
            received.append((topic, payload))
            if payload == last_payload:
                return received

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def probes() -> Iterator[list[Probe]]:
    opened: list[Probe] = []
    yield opened
    for probe in opened:
        probe.close()


def _connected(
    fleet: Fleet, probes: list[Probe], username: str, client_id: str | None = None
) -> Probe:
    probe = Probe(fleet.broker.port, username, fleet.credentials[username], client_id)
    probes.append(probe)
    assert not probe.connect().is_failure
    return probe


# --- the broker enforces the generated files ---------------------------------------------------


@pytest.mark.parametrize("who", ["a", "coordinator"])
def test_the_right_credential_is_accepted(fleet: Fleet, probes: list[Probe], who: str) -> None:
    _connected(fleet, probes, getattr(fleet, who))


@pytest.mark.parametrize(
    "case", ["wrong password", "another device's credential", "unknown user", "anonymous"]
)
def test_bad_credentials_are_refused(fleet: Fleet, probes: list[Probe], case: str) -> None:
    username, secret = {
        "wrong password": (fleet.a, "not-the-credential"),
        "another device's credential": (fleet.a, fleet.credentials[fleet.b]),
        "unknown user": ("intruder", fleet.credentials[fleet.a]),
        "anonymous": (None, None),
    }[case]
    probe = Probe(fleet.broker.port, username, secret)
    probes.append(probe)
    assert probe.connect().is_failure


def test_a_device_cannot_publish_outside_its_own_uplinks(fleet: Fleet, probes: list[Probe]) -> None:
    coordinator = _connected(fleet, probes, fleet.coordinator)
    coordinator.subscribe("specfleet/v1/#", "other/#")
    device_a = _connected(fleet, probes, fleet.a)

    forbidden = [
        device_topic(fleet.b, DeviceChannel.DRAFT),  # impersonating B
        device_topic(fleet.b, DeviceChannel.STATUS),
        device_topic(fleet.b, DeviceChannel.TELEMETRY),
        device_topic(fleet.a, DeviceChannel.VERDICT),  # forging its own verdicts
        device_topic(fleet.a, DeviceChannel.COMMAND),
        "specfleet/v1/verifier/x",
        "other/topic",
    ]
    allowed = [device_topic(fleet.a, c) for c in UPLINK_CHANNELS]
    for topic in forbidden:
        device_a.publish(topic, b"forbidden " + topic.encode(), retain=True)
    for topic in allowed:
        device_a.publish(topic, b"allowed " + topic.encode())

    # One connection's messages arrive in order, so any forbidden one would come first.
    received = coordinator.receive_until(b"allowed " + allowed[-1].encode())
    assert [topic for topic, _ in received] == allowed

    # Nothing forbidden was retained either, for a subscriber that arrives later (one
    # connection per account: the broker binds client ids to usernames).
    coordinator.close()
    late = _connected(fleet, probes, fleet.coordinator)
    late.subscribe(*forbidden)
    assert late.messages.empty()
    late.publish(device_topic(fleet.b, DeviceChannel.COMMAND), b"marker")
    assert late.messages.empty()


def test_a_device_reads_only_its_own_verdicts_and_commands(
    fleet: Fleet, probes: list[Probe]
) -> None:
    coordinator = _connected(fleet, probes, fleet.coordinator)
    device_a = _connected(fleet, probes, fleet.a)
    device_b = _connected(fleet, probes, fleet.b)
    device_a.subscribe(
        device_topic(fleet.b, DeviceChannel.VERDICT),
        device_topic(fleet.b, DeviceChannel.COMMAND),
        device_topic(fleet.b, DeviceChannel.DRAFT),
        "specfleet/v1/dev/+/verdict",
        "specfleet/v1/dev/+/cmd",
    )
    device_b.subscribe(device_topic(fleet.b, DeviceChannel.VERDICT))

    coordinator.publish(device_topic(fleet.b, DeviceChannel.VERDICT), b"b verdict")
    coordinator.publish(device_topic(fleet.b, DeviceChannel.COMMAND), b"b command")
    coordinator.publish(device_topic(fleet.b, DeviceChannel.DRAFT), b"b draft")
    coordinator.publish(device_topic(fleet.a, DeviceChannel.VERDICT), b"a verdict")
    coordinator.publish(device_topic(fleet.a, DeviceChannel.COMMAND), b"a command")

    # B's verdict was really published: B gets it.
    assert device_b.receive_until(b"b verdict") == [
        (device_topic(fleet.b, DeviceChannel.VERDICT), b"b verdict")
    ]
    # A gets its own two messages and nothing of B's, which was sent before them.
    assert device_a.receive_until(b"a command") == [
        (device_topic(fleet.a, DeviceChannel.VERDICT), b"a verdict"),
        (device_topic(fleet.a, DeviceChannel.COMMAND), b"a command"),
    ]


def test_a_device_cannot_read_other_devices_uplinks(fleet: Fleet, probes: list[Probe]) -> None:
    device_a = _connected(fleet, probes, fleet.a)
    device_b = _connected(fleet, probes, fleet.b)
    coordinator = _connected(fleet, probes, fleet.coordinator)
    device_a.subscribe("specfleet/v1/#")
    coordinator.subscribe(device_topic(fleet.b, DeviceChannel.DRAFT))
    device_b.publish(device_topic(fleet.b, DeviceChannel.DRAFT), b"b draft")
    assert coordinator.receive_until(b"b draft")  # it went through the broker
    coordinator.publish(device_topic(fleet.a, DeviceChannel.VERDICT), b"a verdict")
    assert device_a.receive_until(b"a verdict") == [
        (device_topic(fleet.a, DeviceChannel.VERDICT), b"a verdict")
    ]


def test_a_verifier_reads_drafts_and_answers_verdicts_and_nothing_more(
    fleet: Fleet, probes: list[Probe]
) -> None:
    """Direct rounds: a verifier reads every device's drafts (on both its draft topics) and
    writes their verdicts; it cannot speak for a device, send it commands, or read its sessions
    and telemetry."""
    verifier = _connected(fleet, probes, fleet.verifier)
    coordinator = _connected(fleet, probes, fleet.coordinator)
    device_a = _connected(fleet, probes, fleet.a)
    verifier.subscribe(
        "specfleet/v1/dev/+/draft", "specfleet/v1/dev/+/direct", "specfleet/v1/dev/+/session"
    )
    coordinator.subscribe("specfleet/v1/dev/#")
    device_a.subscribe(device_topic(fleet.a, DeviceChannel.VERDICT))

    device_a.publish(device_topic(fleet.a, DeviceChannel.SESSION), b"a session")
    device_a.publish(device_topic(fleet.a, DeviceChannel.DRAFT), b"a draft")
    device_a.publish(device_topic(fleet.a, DeviceChannel.DIRECT), b"a direct draft")
    assert verifier.receive_until(b"a direct draft") == [
        (device_topic(fleet.a, DeviceChannel.DRAFT), b"a draft"),
        (device_topic(fleet.a, DeviceChannel.DIRECT), b"a direct draft"),
    ]
    forbidden = [
        device_topic(fleet.a, DeviceChannel.DRAFT),
        device_topic(fleet.a, DeviceChannel.DIRECT),
        device_topic(fleet.a, DeviceChannel.SESSION),
        device_topic(fleet.a, DeviceChannel.COMMAND),
    ]
    for topic in forbidden:
        verifier.publish(topic, b"forbidden " + topic.encode())
    verifier.publish(device_topic(fleet.a, DeviceChannel.VERDICT), b"a verdict")
    assert device_a.receive_until(b"a verdict") == [
        (device_topic(fleet.a, DeviceChannel.VERDICT), b"a verdict")
    ]
    seen = coordinator.receive_until(b"a verdict")
    assert not [topic for topic, payload in seen if payload.startswith(b"forbidden")]


@pytest.mark.parametrize(
    ("victim", "watched", "sender"),
    [
        ("coordinator", ("a", DeviceChannel.DRAFT), "a"),
        ("verifier", ("a", DeviceChannel.DRAFT), "a"),
        ("b", ("b", DeviceChannel.VERDICT), "coordinator"),
    ],
)
def test_a_device_cannot_take_another_clients_id(
    fleet: Fleet,
    probes: list[Probe],
    victim: str,
    watched: tuple[str, DeviceChannel],
    sender: str,
) -> None:
    """Device A connects with the client id of the coordinator, a verifier or device B: the
    broker files it under A's own username, and the victim stays connected and subscribed."""
    victim_id = getattr(fleet, victim)
    topic = device_topic(getattr(fleet, watched[0]), watched[1])
    target = _connected(fleet, probes, victim_id, client_id=victim_id)
    target.subscribe(topic)
    intruder = _connected(fleet, probes, fleet.a, client_id=victim_id)
    time.sleep(0.2)  # a takeover would have closed the victim's socket by now
    publisher = intruder if sender == "a" else _connected(fleet, probes, getattr(fleet, sender))
    publisher.publish(topic, b"still here")
    assert target.receive_until(b"still here") == [(topic, b"still here")]
    assert (target.disconnects, intruder.disconnects) == (0, 0)


# --- TLS ----------------------------------------------------------------------------------------


def test_the_tls_config_serves_devices_over_tls(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    credential = new_credential()
    devices = [acl.DeviceAccount("tls-dev", hash_credential(credential, iterations=10))]
    tls_port, local_port = _free_port(), _free_port()
    files = acl.write_broker_files(
        tmp_path,
        config_text=acl.render_mosquitto_conf(
            tmp_path,
            listeners=[f"{tls_port} 127.0.0.1", f"{local_port} 127.0.0.1"],
            tls=acl.TlsFiles(cert, key),
            run_as_user=getpass.getuser(),
        ),
        acl_text=acl.generate_acl(devices),
        passwords_text=acl.generate_passwords(devices),
    )
    running = _start_mosquitto(files.config, [tls_port, local_port])
    probes = [Probe(tls_port, "tls-dev", credential), Probe(tls_port, "tls-dev", "nope")]
    try:
        assert not probes[0].connect(ca_certs=str(cert)).is_failure
        assert probes[1].connect(ca_certs=str(cert)).is_failure
    finally:
        for probe in probes:
            probe.close()
        _stop(running)


# --- the generated text ------------------------------------------------------------------------


def _user_blocks(acl_text: str) -> dict[str, list[str]]:
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in acl_text.splitlines():
        if line.startswith("user "):
            current = blocks.setdefault(line.removeprefix("user "), [])
        elif line.startswith("topic "):
            assert current is not None, "a rule outside a user block applies to anonymous users"
            current.append(line)
    return blocks


def test_generated_acl_gives_each_account_exactly_its_rules() -> None:
    digest = hash_credential("x", iterations=1)
    text = acl.generate_acl(
        [acl.DeviceAccount("pi-1", digest)],
        [
            acl.ServiceUser("coordinator", digest, acl.ServiceRole.COORDINATOR),
            acl.ServiceUser("verifier-0", digest, acl.ServiceRole.VERIFIER),
            acl.ServiceUser("dashboard", digest, acl.ServiceRole.OBSERVER),
        ],
    )
    assert _user_blocks(text) == {
        "coordinator": ["topic readwrite specfleet/v1/#"],
        "verifier-0": [
            "topic readwrite specfleet/v1/verifier/#",
            "topic read specfleet/v1/dev/+/draft",
            "topic read specfleet/v1/dev/+/direct",
            "topic write specfleet/v1/dev/+/verdict",
        ],
        "dashboard": ["topic read specfleet/v1/#"],
        "pi-1": [
            "topic write specfleet/v1/dev/pi-1/status",
            "topic write specfleet/v1/dev/pi-1/telemetry",
            "topic write specfleet/v1/dev/pi-1/session",
            "topic write specfleet/v1/dev/pi-1/draft",
            "topic write specfleet/v1/dev/pi-1/direct",
            "topic write specfleet/v1/dev/pi-1/ack",
            "topic read specfleet/v1/dev/pi-1/verdict",
            "topic read specfleet/v1/dev/pi-1/cmd",
        ],
    }


def test_a_username_used_twice_is_refused() -> None:
    digest = hash_credential("x", iterations=1)
    device = acl.DeviceAccount("coordinator", digest)
    service = acl.ServiceUser("coordinator", digest, acl.ServiceRole.COORDINATOR)
    with pytest.raises(acl.DuplicateUsernameError):
        acl.generate_acl([device], [service])
    with pytest.raises(acl.DuplicateUsernameError):
        acl.generate_passwords([device], [service])


@pytest.mark.parametrize("topic", ["", "a/#/b", "a/b#", "a/+b", "a\nuser root", "#/a"])
def test_malformed_topic_filters_are_refused(topic: str) -> None:
    with pytest.raises(ValueError):
        acl.AclRule(acl.Access.READ, topic)


@pytest.mark.parametrize(
    ("username", "credential_hash"),
    [
        ("evil\nuser x", "$7$1$AAAA$" + "A" * 88),
        ("fine", "plaintext"),
        ("fine", "$6$1$AAAA$AAAA"),
    ],
)
def test_accounts_refuse_unsafe_names_and_non_mosquitto_hashes(
    username: str, credential_hash: str
) -> None:
    with pytest.raises(ValueError):
        acl.DeviceAccount(username, credential_hash)


def test_password_file_round_trips() -> None:
    accounts = [
        acl.DeviceAccount(f"d{i}", hash_credential(f"s{i}", iterations=5)) for i in range(3)
    ]
    parsed = acl.parse_passwords("# comment\n\n" + acl.generate_passwords(accounts))
    assert parsed == {a.username: a.credential_hash for a in accounts}


def test_hashes_written_by_mosquitto_passwd_verify_here(tmp_path: Path) -> None:
    tool = shutil.which("mosquitto_passwd")
    if tool is None:
        pytest.skip("mosquitto_passwd is not installed")
    path = tmp_path / "pw"
    subprocess.run([tool, "-b", "-c", str(path), "alice", "s3cret"], check=True)
    encoded = acl.parse_passwords(path.read_text())["alice"]
    assert verify_credential("s3cret", encoded)
    assert not verify_credential("s3cret!", encoded)


def test_rendered_config_points_at_the_written_files(tmp_path: Path) -> None:
    text = acl.render_mosquitto_conf(tmp_path, listeners=["1884 10.0.0.1"])
    active = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert f"password_file {tmp_path.resolve() / 'passwords'}" in active
    assert f"acl_file {tmp_path.resolve() / 'acl'}" in active
    assert f"persistence_location {tmp_path.resolve() / 'data'}/" in active
    assert "listener 1884 10.0.0.1" in active
    assert "allow_anonymous false" in active
    assert "use_username_as_clientid true" in active
    assert "set_tcp_nodelay true" in active
    assert "persistence true" in active


# --- from the registry to a running broker -----------------------------------------------------


def _specfleet(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert status == 0, err
    return out


def test_provisioned_devices_connect_to_a_broker_from_write_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`devices add` then `broker write-config`: mosquitto accepts the printed credentials."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("specfleet.commands",))
    db = ("--database-url", f"sqlite:///{tmp_path / 'specfleet.db'}")
    device_id = f"pi-{secrets.token_hex(4)}"
    _specfleet(capsys, "db", "upgrade", *db)
    added = _specfleet(capsys, "devices", "add", device_id, "--kind", "pi", *db)
    credential = re.search(r"^credential\s+(\S+)$", added, re.MULTILINE)
    assert credential
    port = _free_port()
    written = _specfleet(
        capsys, "broker", "write-config", "--out", str(tmp_path / "broker"),
        "--listener", f"{port} 127.0.0.1", "--run-as-user", getpass.getuser(), *db,
    )  # fmt: skip
    service = re.search(r"^new coordinator user coordinator: credential (\S+)", written, re.M)
    assert service

    running = _start_mosquitto(tmp_path / "broker" / acl.CONFIG_FILE, [port])
    probes = [
        Probe(port, device_id, credential.group(1)),
        Probe(port, "coordinator", service.group(1)),
        Probe(port, device_id, service.group(1)),
    ]
    try:
        assert not probes[0].connect().is_failure
        assert not probes[1].connect().is_failure
        assert probes[2].connect().is_failure
        probes[1].subscribe(device_topic(device_id, DeviceChannel.STATUS))
        probes[0].publish(device_topic(device_id, DeviceChannel.STATUS), b"online")
        assert probes[1].receive_until(b"online")
    finally:
        for probe in probes:
            probe.close()
        _stop(running)
