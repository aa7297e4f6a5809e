"""Cloud mode across real processes: the verifier host drafts, the coordinator streams the rounds.

One verifier, two agents on a private Mosquitto. One agent asks for cloud mode outright, and for
plain mode (the host decodes with no drafter); the other leaves the mode to the coordinator and
reaches the broker through an emulated 4G link (60 ms RTT), where drafting next to the target
pays. Every session must answer exactly as the target alone does, and their rounds must rebuild
the committed tokens.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from test_dsd_bus import shared_prompts, target_answer

from broker import messages as m
from broker.mosquitto import PrivateMosquitto
from coordinator.db.models import DecodingSession, Round, SessionStatus
from coordinator.db.registry import DeviceExistsError
from core.settings import Settings
from localfleet.demo import ask
from localfleet.fleet import START_TIMEOUT_S, AgentSpec, LocalFleet, local_fleet
from netem import NetworkEmulator

MAX_TOKENS = 24
CLOUD = AgentSpec("cloud-device", "other", "hybrid", "none")
ADAPTIVE = AgentSpec("adaptive-4g-device", "phone", "hybrid", "none")


def _start_agent(fleet: LocalFleet, spec: AgentSpec, broker_url: str) -> None:
    registry = fleet.coordinator.registry
    try:
        _, credential = registry.provision(spec.device_id, spec.kind, ("test",), actor="test")
    except DeviceExistsError:
        credential = registry.rotate_credential(spec.device_id, actor="test")
    fleet.credentials[spec.device_id] = credential
    fleet.start_agent(spec, broker_url=broker_url, extra=["--telemetry-interval", "1"])


def count_drafts(fleet: LocalFleet) -> Counter[str]:
    """The Drafts each session sends from now on, counted as the coordinator takes them."""
    drafts: Counter[str] = Counter()
    handle_draft = fleet.coordinator.device_handlers[m.Draft]

    async def counting(device_id: str, draft: m.Draft) -> None:
        drafts[draft.session_id] += 1
        await handle_draft(device_id, draft)

    fleet.coordinator.device_handlers[m.Draft] = counting
    return drafts


def _rounds(fleet: LocalFleet, session_id: str) -> tuple[DecodingSession, list[Round]]:
    with fleet.coordinator.sessions() as db:
        session = db.get(DecodingSession, uuid.UUID(session_id))
        assert session is not None
        rounds = db.scalars(
            sa.select(Round).where(Round.session_id == session.id).order_by(Round.round_index)
        ).all()
        return session, list(rounds)


def _rebuilt(session: DecodingSession, rounds: list[Round]) -> list[int]:
    """draft_tokens[:n_accepted] + next_token, round after round, as replay rebuilds them."""
    rebuilt: list[int] = []
    for expected_index, r in enumerate(rounds):
        assert r.round_index == expected_index
        assert r.base_len == len(session.prompt_ids) + len(rebuilt)
        rebuilt += [*r.draft_tokens[: r.n_accepted], r.next_token]
        assert r.committed_len == len(session.prompt_ids) + len(rebuilt)
    return rebuilt


def test_cloud_rounds_stream_and_equal_the_target_alone(tmp_path: Path) -> None:
    prompts = shared_prompts()[:2]

    async def main() -> tuple[list[dict[str, Any]], Counter[str], dict[str, Any]]:
        settings = Settings(home=tmp_path / "home", coordinator_id=f"c-{uuid.uuid4().hex[:8]}")
        with PrivateMosquitto(tcp_nodelay=True) as mosquitto:
            async with (
                NetworkEmulator(0, mosquitto.host, mosquitto.port, profile="4g", seed=1) as link,
                local_fleet(
                    settings,
                    [],
                    ["cloud-verifier"],
                    workdir=tmp_path / "fleet",
                    external_broker=mosquitto.url,
                ) as fleet,
            ):
                _start_agent(fleet, CLOUD, mosquitto.url)
                _start_agent(fleet, ADAPTIVE, f"mqtt://127.0.0.1:{link.port}")
                await fleet.wait_agents(time.monotonic() + START_TIMEOUT_S)
                drafts = count_drafts(fleet)
                answers: list[dict[str, Any]] = []
                async with httpx.AsyncClient() as client:
                    for prompt in prompts:
                        for spec, fields in (
                            (CLOUD, {"mode": "cloud", "k": 4, "draft": "hybrid"}),
                            (CLOUD, {"mode": "plain", "draft": "hybrid"}),
                            (ADAPTIVE, {"k": 0, "draft": "hybrid"}),
                        ):
                            request = {
                                "prompt": prompt["prompt"],
                                "task_type": prompt["task"],
                                "max_tokens": MAX_TOKENS,
                                **fields,
                            }
                            port = fleet.agent_ports[spec.device_id]
                            summary = await ask(client, port, request, spec.device_id, False)
                            answers.append({**summary, "prompt": prompt, "device": spec, **fields})
                stored = {
                    a["session_id"]: await asyncio.to_thread(_rounds, fleet, a["session_id"])
                    for a in answers
                }
                return answers, drafts, stored

    answers, drafts, stored = asyncio.run(main())

    for answer in answers:
        assert answer["status"] == "finished", answer
        expected = list(target_answer(answer["prompt"]["prompt"], MAX_TOKENS))
        assert answer["token_ids"] == expected, answer["device"]
        session, rounds = stored[answer["session_id"]]
        assert session.status is SessionStatus.FINISHED
        assert _rebuilt(session, rounds) == session.committed_ids == expected
        modes = [r.mode for r in rounds]
        if answer.get("mode") == "plain":
            # No drafter anywhere: one token a round, every round streamed, and the stream
            # started by the coordinator at the open (the agent awaits it and asks for nothing).
            assert set(modes) == {m.Mode.PLAIN}
            assert all(r.draft_tokens == [] and r.n_accepted == 0 for r in rounds)
            assert len(rounds) == len(expected) and drafts[answer["session_id"]] == 0
        elif answer["device"] == CLOUD:
            assert set(modes) == {m.Mode.CLOUD}
            # Every round streamed from the open: no Draft at all.
            assert drafts[answer["session_id"]] == 0 < len(rounds)
            assert all(r.t_draft_ms is not None and r.verifier_id for r in rounds)
        else:
            # The adaptive session opens where the policy rates it best: with an empty window on
            # the device, or, the 4G link measured by the sessions before it, straight on the
            # verifier host (a request for round 0, no device round first). Either way the
            # drafting ends up on the host, and the round says why.
            assert modes[0] in (m.Mode.DISTRIBUTED, m.Mode.CLOUD, m.Mode.PLAIN)
            if modes[0] is m.Mode.DISTRIBUTED:
                assert rounds[0].k == 0
            else:  # its round 0 records the decision that opened it on the host (a round
                # the verifier's pass ran without a window is plain, in either host mode)
                policy = rounds[0].policy or {}
                assert f"opening in {policy['mode']} mode" in policy["decision"]["reason"]
            assert m.Mode.CLOUD in modes, [r.policy for r in rounds]
            switch = next(r for r in rounds if r.policy and r.policy["mode"] == "cloud")
            decision = switch.policy["decision"] if switch.policy else {}
            assert decision["rtt_ms"] > 20.0
            assert {c["mode"] for c in decision["candidates"]} == {"distributed", "cloud", "plain"}
            assert "cloud" in decision["reason"]
            assert drafts[answer["session_id"]] < len(rounds)
