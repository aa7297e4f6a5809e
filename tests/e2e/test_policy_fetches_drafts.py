"""The adaptive policy has a drafter fetched for a device that lacks it, across real processes:
a real Mosquitto, the coordinator with its database and the artifact API, a verifier with the
real target that drafts no cloud rounds (sessions draft on their devices or run plain), agents.

A phone with no drafts runs adaptive sessions (k = 0) asking for the copying hybrid: the policy
rates draft-l1 (on the acceptance its build measured, no device having run it yet) over what the
phone has and asks for it to be fetched (the decision and its reason on the round); the session
drafts on with what the phone has, the phone installs and verifies the release, and a later
round drafts with draft-l1. Every answer is the target's own.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from on_demand_fleet import (
    answer,
    artifact_api,
    fetches_for,
    installed,
    on_demand_settings,
    start_own_agent,
    until,
)
from test_dsd_bus import shared_prompts, target_answer

from broker.messages import Mode
from broker.mosquitto import PrivateMosquitto
from coordinator.db.models import Round
from inference.artifacts import default_models_dir
from localfleet.fleet import START_TIMEOUT_S, AgentSpec, local_fleet

MAX_TOKENS = 40
WANTED = "draft-l1"
LACKING = AgentSpec("pf-lacking", "phone", "hybrid", "none")  # has none
SESSIONS = 4  # adaptive sessions at most on the lacking phone


def _request(prompt: dict[str, str], draft: str, k: int) -> dict[str, Any]:
    return {
        "prompt": prompt["prompt"],
        "task_type": prompt["task"],
        "max_tokens": MAX_TOKENS,
        "draft": draft,
        "k": k,
    }


def _table(rounds: list[Round]) -> str:
    """The rounds as the policy saw them, one a line, for a failure's message."""
    return "\n".join(
        f"{str(r.session_id)[:8]} {r.round_index} {r.mode.value} {r.draft_model} "
        f"{(r.policy or {}).get('decision', {}).get('reason', '')}"
        for r in rounds
    )


def _asks(policy: dict[str, Any]) -> bool:
    return bool(policy.get("decision", {}).get("fetch") == WANTED)


# In the slow set: whether the policy rates draft-l1 over what the phone has depends on this
# host's measured speeds (on a quiet host a plain pass is fast and the hybrid's rounds cheap, and
# it rightly asks for nothing), so it is run by hand on a loaded host; the rating, the margin
# and the back-off are checked deterministically in tests/coordinator/test_draft_wants.py.
@pytest.mark.slow
def test_the_policy_fetches_the_drafter_it_rates_best_and_switches_to_it(tmp_path: Path) -> None:
    models_dir = default_models_dir()
    if not (models_dir / WANTED / "manifest.json").is_file():
        pytest.skip(f"{WANTED} is not built in {models_dir}")
    prompts = [p for p in shared_prompts() if p["task"] == "chat"]
    settings, key_file = on_demand_settings(tmp_path, models_dir)

    async def main() -> dict[str, Any]:
        seen: dict[str, Any] = {"lacking": []}
        with PrivateMosquitto(tcp_nodelay=True) as mosquitto:
            async with local_fleet(
                settings, [], ["pf-verifier"], workdir=tmp_path / "fleet",
                external_broker=mosquitto.url, verifier_flags=["--no-cloud-drafts"],
            ) as fleet, artifact_api(fleet, settings.http_port):  # fmt: skip
                start_own_agent(fleet, LACKING, tmp_path, key_file, models_dir)
                await fleet.wait_agents(time.monotonic() + START_TIMEOUT_S)
                policy = fleet.coordinator.book.policy
                await until(
                    "the lacking phone's status",
                    lambda: policy._device_drafts.get(LACKING.device_id) == (),
                )
                async with httpx.AsyncClient() as client:
                    for prompt in prompts[:SESSIONS]:
                        run = await answer(fleet, client, LACKING, _request(prompt, "hybrid", 0))
                        seen["lacking"].append((prompt, run))
                        if any(r.draft_model == WANTED for r in run[1]):
                            break
                        if fetches_for(fleet, LACKING.device_id):
                            # Installed: the next session may open on it once the status says so.
                            await until(
                                "the status listing the fetched drafter",
                                lambda: WANTED in policy._device_drafts[LACKING.device_id],
                            )
                seen["fetches"] = fetches_for(fleet, LACKING.device_id)
                seen["installed"] = installed(tmp_path, LACKING)
        return seen

    seen = asyncio.run(main())

    for prompt, (reply, _) in seen["lacking"]:
        assert reply["token_ids"] == list(target_answer(prompt["prompt"], MAX_TOKENS))
    rounds = [r for _, (_, session_rounds) in seen["lacking"] for r in session_rounds]
    # The policy asked for the drafter, saying why (a direct round's decision is recorded on
    # the rounds its verifier answers until the next one); one fetch went, and it went through.
    asking = [r for r in rounds if r.policy and _asks(r.policy)]
    assert asking, _table(rounds)
    assert len({r.policy["decision"]["reason"] for r in asking}) == 1, _table(rounds)
    reason = asking[0].policy["decision"]["reason"]
    assert f"{WANTED} would give " in reason and "fetching it for this device" in reason, reason
    assert asking[0].policy["draft_model"] != WANTED  # drafting on with what the phone has
    assert [(o.draft, o.ok) for o in seen["fetches"]] == [(WANTED, True)], seen["fetches"]
    assert WANTED in seen["installed"]
    # A later round drafted on the phone with the fetched drafter.
    asked_at = next(i for i, r in enumerate(rounds) if r.policy and _asks(r.policy))
    first_use = next(i for i, r in enumerate(rounds) if r.draft_model == WANTED)
    assert rounds[first_use].mode is Mode.DISTRIBUTED
    assert first_use > asked_at
    assert all(r.draft_model != WANTED for r in rounds[: asked_at + 1])
