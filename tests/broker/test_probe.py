"""`specfleet broker probe-verifier`: a container probe that reads a verifier's retained
heartbeat from a real private Mosquitto."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from broker import messages as m
from broker.client import BrokerAddress, ConnectOptions, connect
from broker.mosquitto import PrivateMosquitto, free_port
from broker.topics import VerifierChannel, verifier_topic
from specfleet import cli


@pytest.fixture
def broker() -> Iterator[PrivateMosquitto]:
    with PrivateMosquitto() as running:
        yield running


async def _retain(url: str, status: m.VerifierStatus) -> None:
    options = ConnectOptions(client_id=f"heartbeat-{status.verifier_id}")
    async with connect(BrokerAddress.from_url(url), options) as client:
        topic = verifier_topic(status.verifier_id, VerifierChannel.STATUS)
        await client.publish(topic, m.encode(status), retain=True)


def _probe(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], url: str, *argv: str
) -> tuple[int, str]:
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("specfleet.commands",))
    monkeypatch.setenv("SPECFLEET_BROKER_URL", url)
    status = cli.main(["broker", "probe-verifier", *argv])
    out, err = capsys.readouterr()
    return status, (out + err).strip()


@pytest.mark.parametrize(
    ("state", "age_s", "healthy", "reason"),
    [
        (m.DeviceState.ONLINE, 0.0, True, "online, heartbeat"),
        (m.DeviceState.ONLINE, 60.0, False, "old (> 15.0 s)"),
        (m.DeviceState.OFFLINE, 0.0, False, "the verifier says offline"),
    ],
)
def test_a_retained_heartbeat_is_judged_by_state_and_age(
    broker: PrivateMosquitto,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    state: m.DeviceState,
    age_s: float,
    healthy: bool,
    reason: str,
) -> None:
    status = m.VerifierStatus(verifier_id="verifier-7", state=state, at=time.time() - age_s)
    asyncio.run(_retain(broker.url, status))
    code, said = _probe(monkeypatch, capsys, broker.url, "verifier-7")
    assert (code == 0) is healthy
    assert reason in said


def test_a_verifier_that_never_beat_is_not_ready(
    broker: PrivateMosquitto, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, said = _probe(monkeypatch, capsys, broker.url, "verifier-never")
    assert code == 2
    assert said.endswith("verifier verifier-never: no heartbeat retained on the broker")


@pytest.mark.parametrize(("flags", "code"), [((), 2), (("--unreachable-ok",), 0)])
def test_an_unreachable_broker_fails_readiness_but_not_liveness(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: tuple[str, ...],
    code: int,
) -> None:
    url = f"mqtt://127.0.0.1:{free_port()}"
    status, said = _probe(monkeypatch, capsys, url, "verifier-7", *flags)
    assert status == code
    assert "unreachable" in said


@pytest.mark.parametrize(
    ("argv", "reason"),
    [(["bad/id"], "invalid device id"), (["v", "--max-age", "0"], "--max-age must be positive")],
)
def test_bad_arguments_are_refused(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    reason: str,
) -> None:
    status, said = _probe(monkeypatch, capsys, "mqtt://127.0.0.1:1", *argv)
    assert status == 2
    assert reason in said
