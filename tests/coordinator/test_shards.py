"""Device shards held through PostgreSQL advisory locks: shared fairly, disjoint, handed back
after the handler is done with them, and taken over when a holder's connection dies."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from coordinator_rig import raw_device, rig_settings, running_coordinator

from broker.topics import DeviceChannel, device_topic
from coordinator.runtime.shards import N_SHARDS, ShardLeases, ShardsUnavailable, shard_of

if TYPE_CHECKING:
    from coordinator.runtime.service import Coordinator


class Holder:
    """A ShardLeases with its callbacks recorded."""

    def __init__(self, url: str) -> None:
        self.gained: list[frozenset[int]] = []
        self.released: list[frozenset[int]] = []
        self.leases = ShardLeases(url, on_gained=self._gained, on_released=self._released)

    async def _gained(self, shards: frozenset[int]) -> None:
        self.gained.append(shards)

    async def _released(self, shards: frozenset[int]) -> None:
        # The lock is still ours while the handler drains: nobody else may hold it yet.
        assert not (shards & self.leases.held)
        self.released.append(shards)


async def _steps(*holders: Holder, rounds: int) -> None:
    for _ in range(rounds):
        for holder in holders:
            await holder.leases.step()


async def _share_then_take_over(url: str) -> dict[str, object]:
    a, b = Holder(url), Holder(url)
    await _steps(a, rounds=1)
    alone = set(a.leases.held)
    await _steps(b, a, b, rounds=2)
    shared = (set(a.leases.held), set(b.leases.held))
    handed_back = set().union(*a.released)
    # a dies: its connection closes, and PostgreSQL lets its locks go (when its backend has
    # exited, a moment after the close on a loaded host): b takes them on one of its steps.
    a.leases._close()
    for _ in range(50):
        await _steps(b, rounds=1)
        if len(b.leases.held) == N_SHARDS:
            break
        await asyncio.sleep(0.1)
    taken_over = set(b.leases.held)
    b.leases._close()
    return {"alone": alone, "shared": shared, "handed_back": handed_back, "after": taken_over}


def test_shards_are_shared_disjointly_and_taken_over(create_pg_database: Callable[[], str]) -> None:
    found = asyncio.run(_share_then_take_over(create_pg_database()))
    everything = set(range(N_SHARDS))
    assert found["alone"] == everything
    held_a, held_b = found["shared"]  # type: ignore[misc]
    assert held_a.isdisjoint(held_b) and held_a | held_b == everything
    assert len(held_a) == len(held_b) == N_SHARDS // 2
    assert found["handed_back"] == held_b
    assert found["after"] == everything


async def _fenced_when_the_lock_connection_ends(url: str) -> dict[str, object]:
    """The server ends a's lock connection; b takes the freed shard. From then on a must not
    act for it, before any step of its own has run."""
    import psycopg

    from coordinator.runtime.shards import _libpq_url

    a, b = Holder(url), Holder(url)
    await a.leases.step()
    device = "pi-01"
    owned_before = a.leases.owns(device)
    assert a.leases._conn is not None
    pid = a.leases._conn.info.backend_pid
    with psycopg.connect(_libpq_url(url), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    async with asyncio.timeout(10):
        while not b.leases.owns(device):
            await b.leases.step()
            await asyncio.sleep(0.05)
    # Both may not act for it at once: a's fence holds without a step of its own.
    both = [a.leases.owns(device) for _ in range(20) if not await asyncio.sleep(0.05)]
    await a.leases.step()  # a gives its shards up, then shares afresh on a new connection
    released = set().union(*a.released)
    a.leases._close()
    b.leases._close()
    return {"before": owned_before, "old_owner_acts": any(both), "released": released}


def test_the_old_owner_stops_acting_when_its_lock_connection_ends(
    create_pg_database: Callable[[], str],
) -> None:
    found = asyncio.run(_fenced_when_the_lock_connection_ends(create_pg_database()))
    assert found == {"before": True, "old_owner_acts": False, "released": set(range(N_SHARDS))}


def test_ownership_follows_the_device_shard(create_pg_database: Callable[[], str]) -> None:
    holder = Holder(create_pg_database())
    asyncio.run(holder.leases.step())  # the lock connection is up
    holder.leases.held = {shard_of("pi-01")}
    assert holder.leases.owns("pi-01")
    assert not holder.leases.owns(next(d for d in (f"pi-{i}" for i in range(99))
                                       if shard_of(d) != shard_of("pi-01")))  # fmt: skip
    holder.leases._close()


def test_sqlite_cannot_share_a_fleet(sqlite_url: str) -> None:
    async def nothing(_: frozenset[int]) -> None:
        return None

    with pytest.raises(ShardsUnavailable, match="PostgreSQL advisory locks"):
        ShardLeases(sqlite_url, on_gained=nothing, on_released=nothing)


def test_settings_refuse_a_shared_fleet_without_postgresql(sqlite_url: str) -> None:
    from pydantic import ValidationError

    from core.settings import Settings

    with pytest.raises(ValidationError, match="shared_fleet needs PostgreSQL"):
        Settings(shared_fleet=True, database_url=sqlite_url)


async def _command_from_the_other_coordinator(url: str, tmp_path: Path) -> dict[str, Any]:
    """Two sharing coordinators; the one that does not own the device sends it a command (as
    its API's start or cancel does) and must still get the device's ack."""
    from broker import messages as m
    from broker.mosquitto import PrivateMosquitto
    from coordinator.db import migrate
    from coordinator.db.engine import make_engine

    engine = make_engine(url)
    migrate.upgrade(engine)
    half = N_SHARDS // 2
    with PrivateMosquitto() as broker:
        shared = [
            rig_settings(tmp_path / name, engine, broker.url).model_copy(
                update={"shared_fleet": True}
            )
            for name in ("first", "second")
        ]
        async with (
            running_coordinator(shared[0], engine) as first,
            running_coordinator(shared[1], engine) as second,
        ):
            assert first.shards is not None and second.shards is not None
            async with asyncio.timeout(30):  # their own lock loops share the shards out
                while (len(first.shards.held), len(second.shards.held)) != (half, half):
                    await asyncio.sleep(0.2)
            device_id = next(f"pi-{i}" for i in range(99) if first.shards.owns(f"pi-{i}"))
            async with raw_device(broker.url, device_id) as device:
                sent = asyncio.create_task(
                    second.fleet.send_command(device_id, m.CommandName.PING, timeout_s=10)
                )
                async with asyncio.timeout(10):
                    command = None
                    while not isinstance(command, m.Command):
                        command = m.decode((await anext(device._messages)).payload)
                ack = m.CommandAck(command_id=command.command_id, device_id=device_id, ok=True)
                await device.send(DeviceChannel.ACK, ack)
                answered = await sent
                return {
                    "ack": answered.command_id == command.command_id,
                    "owned_by_second": second.shards.owns(device_id),
                }


def test_a_command_from_a_coordinator_that_does_not_own_the_device_is_acked(
    create_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    found = asyncio.run(_command_from_the_other_coordinator(create_pg_database(), tmp_path))
    assert found == {"ack": True, "owned_by_second": False}


async def _presence_at_takeover(url: str, tmp_path: Path) -> dict[str, Any]:
    """A device announced itself (retained status) before a coordinator held its shard: the
    coordinator that takes the shard knows it at once, without waiting for its next message."""
    from broker import messages as m
    from broker.mosquitto import PrivateMosquitto
    from coordinator.db import migrate
    from coordinator.db.engine import make_engine
    from coordinator.db.models import DeviceStatus
    from coordinator.db.registry import DeviceNotFoundError

    engine = make_engine(url)
    migrate.upgrade(engine)
    device_id = "pi-presence"
    with PrivateMosquitto() as broker:
        async with raw_device(broker.url, device_id) as device:
            status = m.Status(device_id=device_id, state=m.DeviceState.ONLINE, at=time.time(),
                              kind="phone", drafts=("ngram",), keepalive_s=7)  # fmt: skip
            await device.client.publish(
                device_topic(device_id, DeviceChannel.STATUS), m.encode(status), retain=True
            )
            settings = rig_settings(tmp_path / "c", engine, broker.url)
            settings = settings.model_copy(update={"shared_fleet": True})
            async with running_coordinator(settings, engine) as coordinator:
                assert coordinator.shards is not None
                async with asyncio.timeout(30):
                    while not coordinator.shards.owns(device_id):
                        await asyncio.sleep(0.1)
                known = None
                for _ in range(50):  # 5 s: far less than any keepalive or telemetry period
                    try:
                        found = await asyncio.to_thread(coordinator.registry.get, device_id)
                    except DeviceNotFoundError:
                        found = None
                    if found is not None and found.status is DeviceStatus.ONLINE:
                        known = found
                        break
                    await asyncio.sleep(0.1)
                return {
                    "online": known is not None,
                    "drafts": list(known.installed_models) if known else [],
                    "keepalive_s": coordinator.fleet._keepalive_s.get(device_id),
                }


def test_a_taken_over_device_is_known_at_takeover(
    create_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    found = asyncio.run(_presence_at_takeover(create_pg_database(), tmp_path))
    assert found == {"online": True, "drafts": ["ngram"], "keepalive_s": 7}


async def _device_of_the_holder(holder: Coordinator, heir: Coordinator,
                                prefix: str) -> str:  # fmt: skip
    """Once the two coordinators share the shards: a device id of a shard the holder has."""
    assert holder.shards is not None and heir.shards is not None
    async with asyncio.timeout(60):
        while not (holder.shards.held and heir.shards.held):
            await asyncio.sleep(0.1)
    return next(f"{prefix}-{i}" for i in range(10_000) if holder.shards.owns(f"{prefix}-{i}"))


async def _presence_kept_for_a_takeover(url: str, tmp_path: Path) -> dict[str, Any]:
    """A device's status reaches a coordinator that does not hold its shard; the shard's holder
    stops; the one that takes the shard over knows the device from that status. It was sent
    without retain, so the broker has nothing to give again: it can only come from what the
    second coordinator kept."""
    from broker import messages as m
    from broker.mosquitto import PrivateMosquitto
    from coordinator.db import migrate
    from coordinator.db.engine import make_engine

    engine = make_engine(url)
    migrate.upgrade(engine)
    with PrivateMosquitto() as broker:
        first = rig_settings(tmp_path / "a", engine, broker.url).model_copy(
            update={"shared_fleet": True}
        )
        second = rig_settings(tmp_path / "b", engine, broker.url).model_copy(
            update={"shared_fleet": True}
        )
        async with running_coordinator(second, engine) as heir:
            assert heir.shards is not None
            async with running_coordinator(first, engine) as holder:
                device_id = await _device_of_the_holder(holder, heir, "pi-kept")
                async with raw_device(broker.url, device_id) as device:
                    status = m.Status(device_id=device_id, state=m.DeviceState.ONLINE,
                                      at=time.time(), kind="phone", drafts=("ngram",),
                                      keepalive_s=7)  # fmt: skip
                    await device.client.publish(
                        device_topic(device_id, DeviceChannel.STATUS), m.encode(status)
                    )
                    async with asyncio.timeout(10):
                        while holder.fleet._keepalive_s.get(device_id) is None:
                            await asyncio.sleep(0.05)
                before = heir.fleet._keepalive_s.get(device_id)
            async with asyncio.timeout(60):  # the holder is gone: its shards come to the heir
                while not heir.shards.owns(device_id):
                    await asyncio.sleep(0.1)
            async with asyncio.timeout(10):
                while heir.fleet._keepalive_s.get(device_id) is None:
                    await asyncio.sleep(0.05)
            return {"before": before, "after": heir.fleet._keepalive_s.get(device_id)}


def test_a_taken_over_device_is_known_from_the_status_kept_while_another_held_it(
    create_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    found = asyncio.run(_presence_kept_for_a_takeover(create_pg_database(), tmp_path))
    assert found == {"before": None, "after": 7}


async def _close_kept_for_a_takeover(url: str, tmp_path: Path) -> dict[str, Any]:
    """A device opens a session on its shard's holder; the holder stops; the device closes the
    session before another coordinator has taken the shard over, so only that one hears the
    close (a device does not send it again). The takeover must close the session rather than
    bring it back active."""
    from broker import messages as m
    from broker.mosquitto import PrivateMosquitto
    from coordinator.db import migrate
    from coordinator.db.engine import make_engine

    engine = make_engine(url)
    migrate.upgrade(engine)
    with PrivateMosquitto() as broker:
        first, second = (
            rig_settings(tmp_path / name, engine, broker.url).model_copy(
                update={"shared_fleet": True}
            )
            for name in ("a", "b")
        )
        async with (
            running_coordinator(second, engine) as heir,
            contextlib.AsyncExitStack() as devices,
        ):
            assert heir.shards is not None
            async with running_coordinator(first, engine) as holder:
                device_id = await _device_of_the_holder(holder, heir, "pi-close")
                session_id = str(uuid.uuid4())
                # The device outlives the holder.
                device = await devices.enter_async_context(raw_device(broker.url, device_id))
                opened = m.SessionOpen(session_id=session_id, prompt="hi", prompt_ids=(1, 2, 3),
                                       draft_model="lookup")  # fmt: skip
                await device.send(DeviceChannel.SESSION, opened)
                await device.reply(accept=lambda r: isinstance(r, m.SessionState))
            owned_at_close = heir.shards.owns(device_id)
            await device.send(DeviceChannel.SESSION, m.SessionClose(session_id=session_id))
            async with asyncio.timeout(60):  # the holder is gone: its shards come to the heir
                while not heir.shards.owns(device_id):
                    await asyncio.sleep(0.1)
            told = await device.reply(
                accept=lambda r: isinstance(r, m.SessionState) and r.status != "active"
            )
            stored = await asyncio.to_thread(heir.book.store.load, session_id)
            return {
                "owned_at_close": owned_at_close,
                "told": str(getattr(told, "status", "")),
                "stored": stored.status.value if stored else None,
                "live": session_id in heir.book.live,
            }


def test_a_close_sent_while_no_coordinator_held_the_shard_ends_the_session_at_takeover(
    create_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    found = asyncio.run(_close_kept_for_a_takeover(create_pg_database(), tmp_path))
    assert found == {"owned_at_close": False, "told": "cancelled", "stored": "cancelled",
                     "live": False}  # fmt: skip


async def _two_statuses_at_once(url: str, tmp_path: Path) -> str:
    """An older status taken up first (as a takeover takes a kept one) and a newer one beside it
    (as the bus loop takes a live one): the newer is what the registry ends with."""
    from broker import messages as m
    from broker.mosquitto import PrivateMosquitto
    from coordinator.db import migrate
    from coordinator.db.engine import make_engine

    engine = make_engine(url)
    migrate.upgrade(engine)
    device_id = "pi-two-statuses"
    with PrivateMosquitto() as broker:
        settings = rig_settings(tmp_path / "c", engine, broker.url)
        async with running_coordinator(settings, engine) as coordinator:
            older = m.Status(device_id=device_id, state=m.DeviceState.ONLINE, at=time.time(),
                             kind="phone", keepalive_s=7)  # fmt: skip
            newer = m.Status(device_id=device_id, state=m.DeviceState.OFFLINE, at=time.time(),
                             reason="went away")  # fmt: skip
            first = asyncio.create_task(coordinator.fleet.on_status(device_id, older))
            await asyncio.sleep(0)  # the older one is under way, waiting on the database
            await coordinator.fleet.on_status(device_id, newer)
            await first
            device = await asyncio.to_thread(coordinator.registry.get, device_id)
            return str(device.status.value)


def test_a_newer_status_taken_up_beside_an_older_one_wins(
    create_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    assert asyncio.run(_two_statuses_at_once(create_pg_database(), tmp_path)) == "offline"


async def _announced(url: str, tmp_path: Path) -> dict[str, Any]:
    """Sessions taken over are announced to their devices, except one already heard from since
    the takeover began (its device talks to the new owner: a state would only make it send its
    draft again); a rebuild keeps the copy in memory that a draft loaded first."""
    from broker import messages as m
    from broker.mosquitto import PrivateMosquitto
    from coordinator.db import migrate
    from coordinator.db.engine import make_engine

    engine = make_engine(url)
    migrate.upgrade(engine)
    with PrivateMosquitto() as broker:
        settings = rig_settings(tmp_path / "c", engine, broker.url)
        async with (
            running_coordinator(settings, engine) as coordinator,
            raw_device(broker.url, "pi-quiet") as quiet,
            raw_device(broker.url, "pi-heard") as heard,
        ):
            ids = {}
            for device in (quiet, heard):
                ids[device.device_id] = str(uuid.uuid4())
                opened = m.SessionOpen(session_id=ids[device.device_id], prompt="hi",
                                       prompt_ids=(1, 2, 3), draft_model="lookup")  # fmt: skip
                await device.send(DeviceChannel.SESSION, opened)
                await device.reply(accept=lambda r: isinstance(r, m.SessionState))
            since = time.monotonic()
            before = dict(coordinator.book.live)
            coordinator.book.live.pop(ids["pi-quiet"])  # as if never loaded here
            coordinator.book.live[ids["pi-heard"]].last_heard = time.monotonic()  # a draft came
            rebuilt = await coordinator.book.rebuild(heard_at=since)
            await coordinator.book.announce(rebuilt, quiet_since=since)
            return {
                "kept": coordinator.book.live[ids["pi-heard"]] is before[ids["pi-heard"]],
                "quiet_told": [type(r).__name__ for r in await quiet.drain(1.0)],
                "heard_told": [type(r).__name__ for r in await heard.drain(1.0)],
            }


def test_a_takeover_announces_only_the_sessions_not_heard_from_since(
    create_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    found = asyncio.run(_announced(create_pg_database(), tmp_path))
    assert found == {"kept": True, "quiet_told": ["SessionState"], "heard_told": []}


async def _cancel_from_the_other_coordinator(url: str, tmp_path: Path) -> dict[str, Any]:
    """A session open on its owner; the other coordinator's API cancels it. The owner's copy in
    memory must go with the row (else it answers the device's drafts on a cancelled session)."""
    from broker import messages as m
    from broker.mosquitto import PrivateMosquitto
    from coordinator.db import migrate
    from coordinator.db.engine import make_engine
    from coordinator.web.control import ServiceControl

    engine = make_engine(url)
    migrate.upgrade(engine)
    half = N_SHARDS // 2
    with PrivateMosquitto() as broker:
        shared = [
            rig_settings(tmp_path / name, engine, broker.url).model_copy(
                update={"shared_fleet": True}
            )
            for name in ("owner", "other")
        ]
        async with (
            running_coordinator(shared[0], engine) as owner,
            running_coordinator(shared[1], engine) as other,
        ):
            assert owner.shards is not None and other.shards is not None
            async with asyncio.timeout(30):
                while (len(owner.shards.held), len(other.shards.held)) != (half, half):
                    await asyncio.sleep(0.2)
            device_id = next(f"pi-{i}" for i in range(99) if owner.shards.owns(f"pi-{i}"))
            session_id = uuid.uuid4()
            async with raw_device(broker.url, device_id) as device:
                opened = m.SessionOpen(session_id=str(session_id), prompt="hi",
                                       prompt_ids=(1, 2, 3), draft_model="lookup")  # fmt: skip
                await device.send(DeviceChannel.SESSION, opened)
                await device.reply(accept=lambda r: isinstance(r, m.SessionState))
                live_before = str(session_id) in owner.book.live
                await ServiceControl(other).cancel_session(
                    session_id, reason="cancelled by an operator", actor="test"
                )
                told = await device.reply(
                    accept=lambda r: isinstance(r, m.SessionState) and r.status != "active"
                )
                async with asyncio.timeout(5):
                    while str(session_id) in owner.book.live:
                        await asyncio.sleep(0.1)
                stored = await asyncio.to_thread(owner.book.store.load, str(session_id))
                return {
                    "live_before": live_before,
                    "owner_copy_gone": str(session_id) not in owner.book.live,
                    "told": str(getattr(told, "status", "")),
                    "stored": stored.status.value if stored else None,
                }


def test_a_cancel_from_a_coordinator_that_does_not_own_the_device_ends_the_owners_copy(
    create_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    found = asyncio.run(_cancel_from_the_other_coordinator(create_pg_database(), tmp_path))
    assert found == {
        "live_before": True,
        "owner_copy_gone": True,
        "told": "cancelled",
        "stored": "cancelled",
    }


async def _two_fleets(first_url: str, second_url: str) -> tuple[int, int]:
    a, b = Holder(first_url), Holder(second_url)
    await _steps(a, b, rounds=2)
    held = len(a.leases.held), len(b.leases.held)
    a.leases._close()
    b.leases._close()
    return held


def test_fleets_in_other_databases_of_the_server_do_not_share_shards(
    create_pg_database: Callable[[], str],
) -> None:
    """pg_locks lists the whole server's locks: a coordinator counts only its own database's."""
    held = asyncio.run(_two_fleets(create_pg_database(), create_pg_database()))
    assert held == (N_SHARDS, N_SHARDS)
