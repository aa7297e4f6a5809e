"""DeviceRegistry on real SQLite and PostgreSQL databases."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy.engine import Engine

from broker.passwords import verify_credential
from coordinator.db.engine import make_sessionmaker
from coordinator.db.events import EventKind, EventLog
from coordinator.db.models import DeviceKind, DeviceStatus
from coordinator.db.registry import (
    DeviceExistsError,
    DeviceNotFoundError,
    DeviceRegistry,
    DeviceRetiredError,
)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
# Low stretching keeps the suite fast; the format and checks are the same as in production.
TEST_ITERATIONS = 10


@pytest.fixture
def registry(db_engine: Engine) -> DeviceRegistry:
    return DeviceRegistry(make_sessionmaker(db_engine), hash_iterations=TEST_ITERATIONS)


@pytest.fixture
def events(db_engine: Engine) -> EventLog:
    return EventLog(make_sessionmaker(db_engine))


def test_provision_returns_a_credential_stored_only_as_a_mosquitto_hash(
    registry: DeviceRegistry,
) -> None:
    device, credential = registry.provision("pi-01", DeviceKind.PI, ["lab", "kitchen", "lab"])
    assert device.kind is DeviceKind.PI
    assert device.status is DeviceStatus.OFFLINE
    assert device.tags == ["kitchen", "lab"]
    assert len(credential) >= 40
    stored = registry.get("pi-01").credential_hash
    assert stored.startswith(f"$7${TEST_ITERATIONS}$")
    assert credential not in stored
    assert verify_credential(credential, stored)
    assert registry.verify_credential("pi-01", credential)
    assert not registry.verify_credential("pi-01", credential + "x")
    assert not registry.verify_credential("nobody", credential)


def test_two_devices_never_share_a_credential(registry: DeviceRegistry) -> None:
    _, first = registry.provision("a", "pi")
    _, second = registry.provision("b", "pi")
    assert first != second
    assert not registry.verify_credential("b", first)


def test_provisioning_an_existing_id_is_refused(registry: DeviceRegistry) -> None:
    registry.provision("pi-01", "pi")
    with pytest.raises(DeviceExistsError):
        registry.provision("pi-01", "phone")


@pytest.mark.parametrize(
    ("device_id", "kind", "tags"),
    [
        ("has/slash", "pi", []),
        ("wild+card", "pi", []),
        ("", "pi", []),
        ("pi-02", "toaster", []),
        ("pi-03", "pi", ["two words"]),
        ("pi-04", "pi", [""]),
    ],
)
def test_provision_refuses_bad_input(
    registry: DeviceRegistry, device_id: str, kind: str, tags: list[str]
) -> None:
    with pytest.raises(ValueError):
        registry.provision(device_id, kind, tags)
    assert registry.count() == 0


def test_unknown_devices_raise_not_found(registry: DeviceRegistry) -> None:
    with pytest.raises(DeviceNotFoundError):
        registry.get("ghost")
    with pytest.raises(DeviceNotFoundError):
        registry.mark_online("ghost", T0)


def _fleet(registry: DeviceRegistry) -> None:
    registry.provision("jet-1", "jetson", ["lab"])
    registry.provision("phone-1", "phone", ["field", "lab2"])
    registry.provision("pi-1", "pi", ["lab", "field"])
    registry.provision("pi-2", "pi", ["a"])
    registry.mark_online("pi-1", T0)


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({}, ["jet-1", "phone-1", "pi-1", "pi-2"]),
        ({"kind": DeviceKind.PI}, ["pi-1", "pi-2"]),
        ({"status": DeviceStatus.ONLINE}, ["pi-1"]),
        ({"status": DeviceStatus.OFFLINE, "kind": DeviceKind.PI}, ["pi-2"]),
        ({"tag": "lab"}, ["jet-1", "pi-1"]),  # whole tags only: "lab2" and "a" do not match
        ({"tag": "field"}, ["phone-1", "pi-1"]),
        ({"tag": "l"}, []),
        ({"tag": "lab", "kind": DeviceKind.PI}, ["pi-1"]),
    ],
)
def test_list_and_count_filter_in_the_database(
    registry: DeviceRegistry, filters: dict[str, object], expected: list[str]
) -> None:
    _fleet(registry)
    assert [d.id for d in registry.list(**filters)] == expected  # type: ignore[arg-type]
    assert registry.count(**filters) == len(expected)  # type: ignore[arg-type]


def test_list_pages_in_id_order(registry: DeviceRegistry) -> None:
    _fleet(registry)
    assert [d.id for d in registry.list(skip=1, limit=2)] == ["phone-1", "pi-1"]
    assert [d.id for d in registry.list(skip=3, limit=10)] == ["pi-2"]


def test_presence_transitions_are_logged_once(registry: DeviceRegistry, events: EventLog) -> None:
    registry.provision("pi-1", "pi")
    online = registry.mark_online("pi-1", T0, detail={"agent": "0.1"})
    assert online.status is DeviceStatus.ONLINE
    assert online.last_seen == T0
    registry.mark_online("pi-1", T0 + timedelta(seconds=5))  # a retained status repeated
    offline = registry.mark_offline("pi-1", T0 + timedelta(seconds=9), "last will")
    assert offline.status is DeviceStatus.OFFLINE
    assert offline.status_reason == "last will"
    registry.mark_offline("pi-1", T0 + timedelta(seconds=10), "keepalive")  # already offline

    logged = events.list(device_id="pi-1", after_id=0)
    assert [(e.kind, e.detail) for e in logged] == [
        (EventKind.DEVICE_PROVISIONED.value, {"kind": "pi", "tags": []}),
        (EventKind.DEVICE_ONLINE.value, {"agent": "0.1"}),
        (EventKind.DEVICE_OFFLINE.value, {"reason": "last will"}),
    ]
    assert logged[1].at == T0
    current = registry.get("pi-1")
    assert current.last_seen == T0 + timedelta(seconds=5)
    assert current.last_seen.tzinfo is not None


def test_a_last_will_older_than_the_last_sighting_is_ignored(registry: DeviceRegistry) -> None:
    registry.provision("pi-1", "pi")
    registry.mark_online("pi-1", T0 + timedelta(seconds=10))
    device = registry.mark_offline("pi-1", T0, "last will of an earlier connection")
    assert device.status is DeviceStatus.ONLINE
    assert registry.get("pi-1").status is DeviceStatus.ONLINE


def test_record_telemetry_keeps_the_latest_snapshot(registry: DeviceRegistry) -> None:
    registry.provision("pi-1", "pi")
    registry.record_telemetry("pi-1", T0, rtt_ms=12.5, cpu_percent=40.0, thermal_c=61.0)
    later = T0 + timedelta(seconds=2)
    registry.record_telemetry(
        "pi-1", later, rtt_ms=9.0, battery_percent=80.0, extra={"throttled": True}
    )
    device = registry.get("pi-1")
    assert device.telemetry == {"rtt_ms": 9.0, "battery_percent": 80.0, "throttled": True}
    assert device.telemetry_at == later
    assert device.last_seen == later


def test_retired_devices_lose_access_and_leave_the_broker_accounts(
    registry: DeviceRegistry, events: EventLog
) -> None:
    _, credential = registry.provision("pi-1", "pi")
    registry.provision("pi-2", "pi")
    registry.retire("pi-1", reason="stolen")
    assert registry.get("pi-1").status is DeviceStatus.RETIRED
    assert not registry.verify_credential("pi-1", credential)
    assert [a.device_id for a in registry.broker_accounts()] == ["pi-2"]
    with pytest.raises(DeviceRetiredError):
        registry.mark_online("pi-1", T0)
    with pytest.raises(DeviceRetiredError):
        registry.record_telemetry("pi-1", T0, rtt_ms=1.0)
    with pytest.raises(DeviceExistsError):
        registry.provision("pi-1", "pi")  # ids are never reused
    registry.retire("pi-1")  # idempotent: no second event
    (retired,) = events.list(kind=EventKind.DEVICE_RETIRED)
    assert retired.device_id == "pi-1"
    assert retired.detail == {"reason": "stolen"}


def test_rotate_credential_replaces_the_old_one(registry: DeviceRegistry) -> None:
    _, old = registry.provision("pi-1", "pi")
    new = registry.rotate_credential("pi-1")
    assert registry.verify_credential("pi-1", new)
    assert not registry.verify_credential("pi-1", old)


def test_broker_accounts_carry_the_stored_hash(registry: DeviceRegistry) -> None:
    _, credential = registry.provision("pi-1", "pi")
    (account,) = registry.broker_accounts()
    assert account.username == "pi-1"
    assert verify_credential(credential, account.credential_hash)


def test_installed_models_and_hardware_are_replaced(registry: DeviceRegistry) -> None:
    registry.provision("pi-1", "pi", hardware={"ram_mb": 4096})
    registry.set_installed_models("pi-1", ["draft-s", "draft-m", "draft-s"])
    registry.set_hardware("pi-1", {"ram_mb": 8192, "soc": "bcm2712"})
    device = registry.get("pi-1")
    assert device.installed_models == ["draft-m", "draft-s"]
    assert device.hardware == {"ram_mb": 8192, "soc": "bcm2712"}
