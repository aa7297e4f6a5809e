"""Heat and power in the policy, across real processes: an agent whose /sys says it runs hot has
its sessions' drafting moved to the verifier host, with the reason on the rounds, and answers
exactly as the target alone does.

The agent reads a /sys tree the test writes (`--sys-root`), as the kernel lays it out; its
telemetry carries the reading and its limit (75 degrees C here) to the coordinator's policy.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from rounds_check import assert_rounds_rebuild
from test_dsd_bus import shared_prompts, target_answer

from broker.messages import Mode
from broker.mosquitto import PrivateMosquitto
from coordinator.db.models import Round
from core.settings import Settings
from localfleet.demo import ask
from localfleet.fleet import START_TIMEOUT_S, AgentSpec, LocalFleet, local_fleet

MAX_TOKENS = 24
DEVICE = AgentSpec("warm-phone", "phone", "hybrid", "none")
LIMIT_C = 75.0


def _set_temperature(sys_root: Path, degrees: float) -> None:
    zone = sys_root / "class" / "thermal" / "thermal_zone0"
    zone.mkdir(parents=True, exist_ok=True)
    (zone / "temp").write_text(f"{round(degrees * 1000)}\n")


async def _wait_for_limit(fleet: LocalFleet, hot: bool) -> None:
    policy = fleet.coordinator.book.policy
    deadline = time.monotonic() + 30.0
    while (policy.device_limit(DEVICE.device_id) is not None) != hot:
        assert time.monotonic() < deadline, "the device's telemetry never reached the policy"
        await asyncio.sleep(0.1)


def test_a_hot_device_has_its_drafting_moved_to_the_host_and_says_why(tmp_path: Path) -> None:
    prompt = shared_prompts()[0]
    sys_root = tmp_path / "sys"
    _set_temperature(sys_root, 45.0)

    async def main() -> list[tuple[dict[str, Any], list[Round]]]:
        settings = Settings(home=tmp_path / "home", coordinator_id=f"c-{uuid.uuid4().hex[:8]}")
        with PrivateMosquitto(tcp_nodelay=True) as mosquitto:
            async with local_fleet(
                settings, [], ["limits-verifier"], workdir=tmp_path / "fleet",
                external_broker=mosquitto.url,
            ) as fleet:  # fmt: skip
                registry = fleet.coordinator.registry
                _, credential = registry.provision(DEVICE.device_id, "phone", (), actor="test")
                fleet.credentials[DEVICE.device_id] = credential
                fleet.start_agent(
                    DEVICE,
                    broker_url=mosquitto.url,
                    extra=[
                        "--telemetry-interval", "0.5",
                        "--sys-root", str(sys_root),
                        "--thermal-limit", str(LIMIT_C),
                    ],
                )  # fmt: skip
                await fleet.wait_agents(time.monotonic() + START_TIMEOUT_S)
                port = fleet.agent_ports[DEVICE.device_id]
                request = {
                    "prompt": prompt["prompt"],
                    "task_type": prompt["task"],
                    "max_tokens": MAX_TOKENS,
                    "draft": "hybrid",
                    "k": 4,
                    "mode": "distributed",
                }
                answers = []
                async with httpx.AsyncClient() as client:
                    await _wait_for_limit(fleet, hot=False)
                    cool = await ask(client, port, request, DEVICE.device_id, False)
                    _set_temperature(sys_root, 88.0)
                    await _wait_for_limit(fleet, hot=True)
                    adaptive = {**request, "k": 0}
                    del adaptive["mode"]
                    hot = await ask(client, port, adaptive, DEVICE.device_id, False)
                for answer in (cool, hot):
                    assert answer["status"] == "finished", answer
                    with fleet.coordinator.sessions() as db:
                        _, rounds = assert_rounds_rebuild(
                            db, answer["session_id"], answer["token_ids"]
                        )
                    answers.append((answer, rounds))
                return answers

    (cool, cool_rounds), (hot, hot_rounds) = asyncio.run(main())

    expected = list(target_answer(prompt["prompt"], MAX_TOKENS))
    for answer in (cool, hot):
        assert answer["token_ids"] == expected
    assert {r.mode for r in cool_rounds} == {Mode.DISTRIBUTED}
    # Hot: after its opening round the device drafts nothing; every later round ran on the
    # verifier host, and the decision that moved it names the limit and the reading.
    later = hot_rounds[1:]
    assert later and all(r.mode in (Mode.CLOUD, Mode.PLAIN) for r in later)
    reasons = [
        r.policy["decision"]["reason"] for r in hot_rounds if r.policy and "decision" in r.policy
    ]
    assert any(
        reason.startswith("device too hot: 88 °C (limit 75): drafting moves off the device")
        for reason in reasons
    ), reasons
