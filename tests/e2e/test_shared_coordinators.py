"""Two coordinators share one fleet on the real Mosquitto and PostgreSQL: each answers the
devices of its own shards, and the output is the target's own, token for token.

The first coordinator runs in this process (local_fleet), the second as `specfleet up`; both
with shared_fleet. The devices are named so that one falls in each half of the shards (the
first coordinator keeps the low half when the second arrives)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from rounds_check import assert_rounds_rebuild
from test_dsd_bus import shared_prompts, target_answer

from bench.fleet import shards_settled
from broker.mosquitto import PrivateMosquitto, free_port
from coordinator.runtime.shards import N_SHARDS, shard_of
from core.settings import Settings
from localfleet.demo import ask
from localfleet.fleet import AgentSpec, ChildProcess, LocalFleet, local_fleet

AGENTS = [
    AgentSpec("share-pi", "phone", "ngram", "none"),  # shard 0: the first coordinator's
    AgentSpec("share-jetson", "jetson", "lookup", "onnx"),  # shard 60: the second's
]
VERIFIERS = ["share-verifier-1"]
PROMPTS_PER_AGENT = 2
MAX_TOKENS = 16
SETTLE_TIMEOUT_S = 60.0


def _second_coordinator(fleet: LocalFleet, broker_url: str, workdir: Path) -> ChildProcess:
    argv = [sys.executable, "-m", "specfleet", "up", "--broker", broker_url,
            "--database-url", fleet.settings.database_url,
            "--http-port", str(free_port())]  # fmt: skip
    env = fleet._child_env()
    env["SPECFLEET_SHARED_FLEET"] = "true"
    env["SPECFLEET_COORDINATOR_ID"] = f"{fleet.settings.coordinator_id}-second"
    child = ChildProcess("coordinator-second", argv, env, workdir / "coordinator-second.log")
    child.start()
    return child


async def _settle(fleet: LocalFleet, second: ChildProcess) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not await asyncio.to_thread(shards_settled, fleet.settings.database_url, 2):
        assert second.alive(), second.log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "the two coordinators did not share the shards"
        await asyncio.sleep(0.5)


async def _answers(fleet: LocalFleet) -> list[dict[str, Any]]:
    prompts = shared_prompts()
    async with httpx.AsyncClient() as client:

        async def serve(index: int, spec: AgentSpec) -> list[dict[str, Any]]:
            answers = []
            for prompt in prompts[index :: len(AGENTS)][:PROMPTS_PER_AGENT]:
                request = {"prompt": prompt["prompt"], "task_type": prompt["task"],
                           "max_tokens": MAX_TOKENS, "temperature": 0.0}  # fmt: skip
                summary = await ask(
                    client, fleet.agent_ports[spec.device_id], request, spec.device_id,
                    stream=False,
                )  # fmt: skip
                answers.append({**summary, "prompt": prompt["prompt"], "device": spec.device_id})
            return answers

        per_agent = await asyncio.gather(*(serve(i, s) for i, s in enumerate(AGENTS)))
    return [answer for answers in per_agent for answer in answers]


def test_two_coordinators_share_sessions_and_the_output_is_the_targets(
    tmp_path: Path, create_pg_database: Callable[[], str]
) -> None:
    assert shard_of(AGENTS[0].device_id) < N_SHARDS // 2 <= shard_of(AGENTS[1].device_id)

    async def main(broker_url: str) -> tuple[list[dict[str, Any]], str, set[str]]:
        settings = Settings(
            home=tmp_path / "home",
            database_url=create_pg_database(),
            coordinator_id="coordinator-first",
            shared_fleet=True,
        )
        async with local_fleet(
            settings, AGENTS, VERIFIERS, workdir=tmp_path / "fleet", external_broker=broker_url
        ) as fleet:
            second = _second_coordinator(fleet, broker_url, tmp_path)
            try:
                await _settle(fleet, second)
                answers = await _answers(fleet)
                with fleet.coordinator.sessions() as db:
                    for answer in answers:
                        assert_rounds_rebuild(db, answer["session_id"], answer["token_ids"])
                # A copy now: once the second stops, the first takes its shards back.
                held = set(fleet.coordinator.shards.held) if fleet.coordinator.shards else set()
            finally:
                await second.stop()
            return answers, second.log_path.read_text(), {str(s) for s in held}

    with PrivateMosquitto() as mosquitto:
        answers, second_log, first_held = asyncio.run(main(mosquitto.url))
    assert len(answers) == len(AGENTS) * PROMPTS_PER_AGENT
    for answer in answers:
        assert tuple(answer["token_ids"]) == target_answer(answer["prompt"], MAX_TOKENS)
    # Each coordinator opened the sessions of its own device, and only those.
    assert str(shard_of("share-pi")) in first_held
    assert str(shard_of("share-jetson")) not in first_held
    opened_by_second = {a["session_id"] for a in answers if a["session_id"] in second_log}
    assert opened_by_second == {a["session_id"] for a in answers if a["device"] == "share-jetson"}
