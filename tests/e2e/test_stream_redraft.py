"""A host stream takes the drafter the policy chose, across real processes.

When the session's policy chooses another host drafter mid-stream, the coordinator tells the
verifier (`StreamRedraft`), which drafts the stream's next pass with it: the stream goes on, with
no word to the device and no round run twice. One verifier and one agent on a private Mosquitto:
a cloud session's drafter is changed under it after a few rounds, and its later rounds must run
the new drafter, rebuild the committed tokens, answer exactly as the target alone does, and
appear once each in the verifier's pass trace.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from test_cloud_mode import _rebuilt, _rounds, _start_agent, count_drafts
from test_dsd_bus import shared_prompts, target_answer

from broker import messages as m
from broker.mosquitto import PrivateMosquitto
from coordinator.db.models import SessionStatus
from core.settings import Settings
from localfleet.demo import ask
from localfleet.fleet import START_TIMEOUT_S, AgentSpec, local_fleet

MAX_TOKENS = 32
CLOUD = AgentSpec("redraft-device", "other", "hybrid", "none")
SWITCH_AT = 3  # rounds committed before the drafter is changed
NEW_DRAFT = "lookup"


def test_a_stream_takes_the_drafter_the_policy_chose_within_it(tmp_path: Path) -> None:
    prompt = shared_prompts()[0]
    trace = tmp_path / "passes.jsonl"

    async def main() -> tuple[dict[str, Any], int, Counter[str], Any]:
        settings = Settings(home=tmp_path / "home", coordinator_id=f"c-{uuid.uuid4().hex[:8]}")
        with PrivateMosquitto(tcp_nodelay=True) as mosquitto:
            async with local_fleet(
                settings,
                [],
                ["redraft-verifier"],
                workdir=tmp_path / "fleet",
                external_broker=mosquitto.url,
                verifier_flags=["--pass-trace", str(trace)],
            ) as fleet:
                _start_agent(fleet, CLOUD, mosquitto.url)
                await fleet.wait_agents(time.monotonic() + START_TIMEOUT_S)
                book = fleet.coordinator.book
                (verifier,) = book.pool.live()
                assert NEW_DRAFT in verifier.status.drafts
                drafts = count_drafts(fleet)
                switched_at: list[int] = []

                async def switch() -> None:
                    # The policy of a session whose window the agent fixed is left alone by
                    # the adaptive policy: set here, it stands for the rest of the answer.
                    while True:
                        for live in book.live.values():
                            if live.next_round >= SWITCH_AT and live.streaming:
                                live.policy = live.policy.model_copy(
                                    update={"draft_model": NEW_DRAFT}
                                )
                                switched_at.append(live.next_round)
                                return
                        await asyncio.sleep(0.002)

                switching = asyncio.create_task(switch())
                request = {
                    "prompt": prompt["prompt"],
                    "task_type": prompt["task"],
                    "max_tokens": MAX_TOKENS,
                    "mode": "cloud",
                    "k": 4,
                    "draft": "hybrid",
                }
                async with httpx.AsyncClient() as client:
                    port = fleet.agent_ports[CLOUD.device_id]
                    answer = await ask(client, port, request, CLOUD.device_id, False)
                await asyncio.wait_for(switching, 1.0)
                stored = await asyncio.to_thread(_rounds, fleet, answer["session_id"])
                return answer, switched_at[0], drafts, stored

    answer, switched_at, drafts, (session, rounds) = asyncio.run(main())

    assert answer["status"] == "finished", answer
    expected = list(target_answer(prompt["prompt"], MAX_TOKENS))
    assert answer["token_ids"] == expected
    assert session.status is SessionStatus.FINISHED
    assert _rebuilt(session, rounds) == session.committed_ids == expected
    assert all(r.mode is m.Mode.CLOUD for r in rounds)
    assert len(rounds) > switched_at + 2, "the answer ended before the switch could show"
    # Before the switch the stream drafted with the hybrid; from some round after the one in
    # flight when it came (the verifier may have run ahead), every drafted round ran the new
    # drafter (a drafted round names its drafter; a round that drafted nothing names none).
    drafters = [r.draft_model for r in rounds]
    assert "hybrid" in drafters[:switched_at]
    first_new = drafters.index(NEW_DRAFT)
    assert first_new >= switched_at
    assert set(drafters[first_new:]) <= {NEW_DRAFT, None}, list(enumerate(drafters))
    # The stream went on: each round ran in one pass of the verifier, none twice.
    ran = Counter(
        row
        for line in trace.read_text().splitlines()
        for row in json.loads(line)["rows_of"]
        if row.startswith(answer["session_id"][:8])
    )
    assert sorted(ran.values()) == [1] * len(rounds), ran
    # The device asked for nothing: the coordinator started the stream at the open.
    assert drafts[answer["session_id"]] == 0
