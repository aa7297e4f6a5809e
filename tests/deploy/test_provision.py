"""`specfleet devices provision`: registry, broker files and reload, bundle; on a real Mosquitto."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import stat
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from deploy_support import isolation, run_cli
from sqlalchemy.engine import Engine

from broker.client import (
    BrokerAddress,
    BusAuthError,
    BusConnectionError,
    ConnectOptions,
    connect,
)
from broker.messages import Mode
from broker.mosquitto import PrivateMosquitto, free_port
from broker.topics import DeviceChannel, device_topic
from coordinator.db.engine import make_sessionmaker
from coordinator.db.models import DecodingSession, Event, SessionStatus
from coordinator.db.registry import DeviceRegistry
from coordinator.ops.provisioning import parse_acl
from coordinator.runtime.service import Coordinator
from coordinator.stack import broker_revoke, http_api, quickstart_broker
from coordinator.web.api.main import create_app
from coordinator.web.auth import AdminStore
from coordinator.web.control import attach_service
from core.aio import timeout
from core.settings import Settings
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


# --- service accounts and retirement ----------------------------------------------------------


@pytest.mark.parametrize("name", ["coordinator", "verifier", "observer", "verifier-1"])
def test_a_device_may_not_take_a_service_accounts_name(
    tmp_path: Path,
    sqlite_db: tuple[str, Engine],
    broker_dir: Path,
    settings_home: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
) -> None:
    """`devices provision coordinator` once replaced the coordinator's hash in the password
    file; the default service names and the broker's own service users are refused."""
    url, engine = sqlite_db
    written = ["broker", "write-config", "--out", str(broker_dir), "--database-url", url]
    written += [
        "--service-user",
        "coordinator:coordinator",
        "--service-user",
        "verifier-1:verifier",
    ]
    assert run_cli(written) == 0
    capsys.readouterr()
    passwords = (broker_dir / "passwords").read_text()
    code = provision(name, broker_dir, url, tmp_path / "bundle")
    out = capsys.readouterr().out
    assert code == 2
    assert len(out.strip().splitlines()) == 1 and repr(name) in out and "service account" in out
    assert DeviceRegistry(make_sessionmaker(engine)).count() == 0
    assert (broker_dir / "passwords").read_text() == passwords


def _open_session_row(engine: Engine, device_id: str, status: SessionStatus) -> uuid.UUID:
    row = DecodingSession(
        device_id=device_id,
        task_type="qa",
        prompt="hello",
        prompt_ids=[1, 2, 3],
        temperature=0.0,
        top_p=1.0,
        seed=7,
        max_tokens=8,
        mode=Mode.DISTRIBUTED,
        draft_model="lookup",
        k=4,
        status=status,
        committed_ids=[],
        committed_len=3,
    )
    with make_sessionmaker(engine).begin() as db:
        db.add(row)
    return row.id


async def _retire_while_connected(
    settings: Settings, engine: Engine, device_id: str, credential: str, *, through: str = "api"
) -> float:
    """Retire `device_id` while the device is connected, through the API of a running
    coordinator or (`through="cli"`) with `specfleet devices retire` beside it, which leaves
    the broker and the sessions to the coordinator; returns how long until the broker cut the
    device off."""
    registry = DeviceRegistry(make_sessionmaker(engine))
    coordinator = Coordinator(settings, engine)
    app = create_app(settings, engine)
    attach_service(app, coordinator, broker_revoke(settings, registry, None))
    _, token = AdminStore(make_sessionmaker(engine)).create("alice")
    address = BrokerAddress.from_url(settings.broker_url)
    service = asyncio.create_task(coordinator.run(), name="coordinator")
    port = free_port()
    try:
        await asyncio.wait_for(coordinator.connected.wait(), 10)
        device_options = ConnectOptions(f"dev-{device_id}", device_id, credential)
        async with (
            http_api(app, "127.0.0.1", port),
            httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}",
                headers={"Authorization": f"Bearer {token}"},
            ) as client,
            connect(address, device_options) as device,
        ):
            await device.subscribe(device_topic(device_id, DeviceChannel.VERDICT))
            retired_at = time.monotonic()
            if through == "cli":
                command = ["devices", "retire", device_id, "--reason", "stolen"]
                command += ["--database-url", settings.database_url]
                assert await asyncio.to_thread(run_cli, command) == 0
            else:
                response = await client.post(
                    f"/api/v1/devices/{device_id}/retire", json={"reason": "stolen"}
                )
                assert response.status_code == 200, response.text
                assert response.json()["status"] == "retired"
            with pytest.raises(BusConnectionError):
                async with timeout(5.0):
                    async for _ in device.messages():
                        pass
            cut_after_s = time.monotonic() - retired_at
        with pytest.raises(BusAuthError):
            async with connect(address, device_options):
                pass
        return cut_after_s
    finally:
        service.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await service


@pytest.mark.parametrize("through", ["api", "cli"])
def test_retiring_a_device_revokes_it_on_the_broker_and_closes_its_sessions(
    through: str,
    tmp_path: Path,
    sqlite_db: tuple[str, Engine],
    broker_dir: Path,
    secured_mosquitto: Callable[[], PrivateMosquitto],
    settings_home: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, engine = sqlite_db
    coordinator_secret = write_config(broker_dir, url, capsys)
    broker = secured_mosquitto()
    monkeypatch.setenv("SPECFLEET_BROKER_URL", broker.url)
    assert provision("pi-r", broker_dir, url, tmp_path / "bundle") == 0
    credential = (tmp_path / "bundle" / "credential").read_text().strip()
    active = _open_session_row(engine, "pi-r", SessionStatus.ACTIVE)
    suspended = _open_session_row(engine, "pi-r", SessionStatus.SUSPENDED)
    settings = Settings(
        home=settings_home,
        database_url=url,
        secret_key="a-test-secret-of-32-characters!!",
        broker_url=broker.url,
        broker_username="coordinator",
        broker_password=coordinator_secret,
        broker_dir=broker_dir,
        broker_pid_file=broker_dir / "mosquitto.pid",
    )

    cut_after_s = asyncio.run(
        _retire_while_connected(settings, engine, "pi-r", credential, through=through)
    )

    assert cut_after_s < 5.0
    assert "pi-r" not in parse_acl((broker_dir / "acl").read_text())
    assert "pi-r:" not in (broker_dir / "passwords").read_text()
    assert "coordinator" in parse_acl((broker_dir / "acl").read_text())
    with make_sessionmaker(engine)() as db:
        statuses = {row.id: row.status for row in db.scalars(sa.select(DecodingSession))}
        events = db.scalars(sa.select(Event).where(Event.device_id == "pi-r")).all()
    assert statuses == {active: SessionStatus.CANCELLED, suspended: SessionStatus.CANCELLED}
    closed = {e.session_id: e.detail for e in events if e.kind == "session.cancelled"}
    assert closed == {
        active: {"reason": "device retired: stolen"},
        suspended: {"reason": "device retired: stolen"},
    }
    (revoked,) = [e for e in events if e.kind == "device.revoked"]
    assert revoked.actor == ("user:alice" if through == "api" else "coordinator")
    assert "SIGHUP" in revoked.detail["broker"]
    assert set(revoked.detail["sessions_closed"]) == {str(active), str(suspended)}


def test_the_retire_command_updates_and_reloads_the_broker_itself(
    tmp_path: Path,
    sqlite_db: tuple[str, Engine],
    broker_dir: Path,
    secured_mosquitto: Callable[[], PrivateMosquitto],
    settings_home: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With --broker-dir, `devices retire` needs no running coordinator to cut the device off."""
    url, _ = sqlite_db
    write_config(broker_dir, url, capsys)
    broker = secured_mosquitto()
    assert provision("pi-c", broker_dir, url, tmp_path / "bundle") == 0
    credential = (tmp_path / "bundle" / "credential").read_text().strip()
    asyncio.run(try_connect(broker.url, "pi-c", credential))
    capsys.readouterr()

    retire = ["devices", "retire", "pi-c", "--reason", "lost", "--database-url", url]
    reload = ["--broker-dir", str(broker_dir), "--broker-pid-file", str(broker_dir / "x.pid")]
    assert run_cli([*retire, "--broker-pid-file", "x.pid"]) == 2
    assert "needs --broker-dir" in capsys.readouterr().out
    assert run_cli([*retire, *reload]) == 2  # a pid file that is not there
    failed = capsys.readouterr().out
    assert "pi-c is retired, but the broker was not updated" in failed, failed
    assert len(failed.strip().splitlines()) == 1
    reload[-1] = str(broker_dir / "mosquitto.pid")
    assert run_cli([*retire, *reload]) == 0
    out = capsys.readouterr().out
    assert "SIGHUP" in out, out
    assert "pi-c" not in parse_acl((broker_dir / "acl").read_text())
    with pytest.raises(BusAuthError):
        asyncio.run(try_connect(broker.url, "pi-c", credential))


def test_the_quickstart_broker_revokes_a_retired_device_at_once(
    sqlite_db: tuple[str, Engine], settings_home: Path
) -> None:
    url, engine = sqlite_db
    registry = DeviceRegistry(make_sessionmaker(engine), hash_iterations=100)
    _, credential = registry.provision("pi-q", "pi")
    settings = Settings(home=settings_home, database_url=url)

    async def scenario() -> None:
        quick = quickstart_broker(settings, free_port(), registry)
        revoke = broker_revoke(settings, registry, quick)
        assert revoke is not None
        address = BrokerAddress.from_url(quick.broker.url)
        options = ConnectOptions("dev-pi-q", "pi-q", credential, protocol="3.1.1")
        async with quick.broker:
            async with connect(address, options) as device:
                await device.subscribe(device_topic("pi-q", DeviceChannel.VERDICT))
                registry.retire("pi-q")
                assert "1 connection(s) closed" in await revoke("pi-q")
                with pytest.raises(BusConnectionError):
                    async with timeout(5.0):
                        async for _ in device.messages():
                            pass
            with pytest.raises(BusAuthError):
                async with connect(address, options):
                    pass

    asyncio.run(scenario())
