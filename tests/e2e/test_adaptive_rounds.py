"""Sessions opened without a window get the adaptive policy's choice on verdicts and rounds."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from broker import messages as m
from broker.client import BrokerAddress, BusClient, ConnectOptions, Incoming, connect
from broker.topics import DeviceChannel, device_topic
from coordinator.db.models import Round
from core.settings import Settings
from inference.tokenizer import ChatTokenizer
from localfleet.fleet import local_fleet
from modelbuild.target_build import ensure_target

DEVICE = "adaptive-device"
REPLY_TIMEOUT_S = 60.0
PROMPT = "Translate 'good morning' into French."
ROUNDS = 5
REJECTED_TOKEN = 2  # drafted again and again; the target never agrees this often


async def _replies(client: BusClient) -> AsyncIterator[Any]:
    messages: AsyncIterator[Incoming] = client.messages()
    while True:
        incoming = await asyncio.wait_for(anext(messages), REPLY_TIMEOUT_S)
        if incoming.topic == device_topic(DEVICE, DeviceChannel.VERDICT):
            yield m.decode(incoming.payload)


async def _run_session(
    client: BusClient, replies: AsyncIterator[Any], prompt_ids: list[int], k: int
) -> tuple[str, list[m.Verdict], m.Verdict]:
    """Open a session with window k (0: the coordinator's choice) and draft what it asks."""
    session_id = str(uuid.uuid4())
    opened = m.SessionOpen(
        session_id=session_id,
        prompt=PROMPT,
        prompt_ids=tuple(prompt_ids),
        task_type="unknown",
        max_tokens=64,
        draft_model="lookup",
        k=k,
    )
    await client.publish(device_topic(DEVICE, DeviceChannel.SESSION), m.encode(opened))
    state = await anext(replies)
    assert isinstance(state, m.SessionState)
    policy, base_len = state.policy, len(prompt_ids)
    verdicts: list[m.Verdict] = []
    for round_index in range(ROUNDS):
        assert policy is not None
        draft = m.Draft(
            session_id=session_id,
            round=round_index,
            base_len=base_len,
            tokens=(REJECTED_TOKEN,) * policy.k,
            draft_model=policy.draft_model,
        )
        await client.publish(device_topic(DEVICE, DeviceChannel.DRAFT), m.encode(draft))
        verdict = await anext(replies)
        assert isinstance(verdict, m.Verdict), verdict
        verdicts.append(verdict)
        policy, base_len = verdict.policy, verdict.committed_len
    # The last round once more: its stored verdict, policy included, comes back unchanged.
    await client.publish(device_topic(DEVICE, DeviceChannel.DRAFT), m.encode(draft))
    again = await anext(replies)
    assert isinstance(again, m.Verdict)
    return session_id, verdicts, again


def assert_same_verdict(again: m.Verdict, first: m.Verdict) -> None:
    """A re-sent verdict is the stored one; only its send time is its own (for its downlink)."""
    assert again.model_copy(update={"sent_at": 0.0}) == first.model_copy(update={"sent_at": 0.0})
    assert again.sent_at >= first.sent_at > 0


def test_adaptive_sessions_carry_decisions_and_fixed_ones_keep_their_window(
    tmp_path: Path,
) -> None:
    tokenizer = ChatTokenizer.load(ensure_target())
    prompt_ids = tokenizer.apply_chat_template(PROMPT)

    async def main() -> dict[str, tuple[list[m.Verdict], m.Verdict, list[Round]]]:
        settings = Settings(home=tmp_path / "home")
        async with local_fleet(
            settings, [], ["adaptive-verifier"], workdir=tmp_path / "fleet"
        ) as fleet:
            address = BrokerAddress.from_url(fleet.broker_url)
            options = ConnectOptions(client_id=f"dev-{DEVICE}", protocol="3.1.1")
            runs: dict[str, tuple[str, list[m.Verdict], m.Verdict]] = {}
            async with connect(address, options) as client:
                await client.subscribe(device_topic(DEVICE, DeviceChannel.VERDICT))
                replies = _replies(client)
                runs["adaptive"] = await _run_session(client, replies, prompt_ids, k=0)
                runs["fixed"] = await _run_session(client, replies, prompt_ids, k=3)

            def rounds_of(session_id: str) -> list[Round]:
                with fleet.coordinator.sessions() as db:
                    query = sa.select(Round).where(Round.session_id == uuid.UUID(session_id))
                    return list(db.scalars(query.order_by(Round.round_index)))

            return {
                name: (verdicts, again, await asyncio.to_thread(rounds_of, session_id))
                for name, (session_id, verdicts, again) in runs.items()
            }

    results = asyncio.run(main())

    verdicts, again, rounds = results["adaptive"]
    assert len(rounds) == ROUNDS
    # The verifier holding the session answered every round (direct rounds) and the policy ran
    # off their path: each verdict carries the decision in force when it left, one round or two
    # behind, and its round records that decision.
    assert all(verdict.verifier_id == "adaptive-verifier" for verdict in verdicts)
    decided = [row for row in rounds if "decision" in (row.policy or {})]
    assert len(decided) >= ROUNDS - 2 and rounds[-1] in decided
    for verdict, row in zip(verdicts, rounds, strict=True):
        assert verdict.policy is not None and row.policy is not None
        assert verdict.policy == m.Policy.model_validate(row.policy)
        if row not in decided:
            continue
        assert verdict.policy.min_confidence is not None
        decision = row.policy["decision"]
        assert decision["task_type"] == "translate"  # "unknown" was classified from the prompt
        assert decision["device_id"] == DEVICE
        assert row.t_verify_ms is not None
        assert {c["draft_model"] for c in decision["candidates"]} >= {"lookup", "ngram", "hybrid"}
    assert_same_verdict(again, verdicts[-1])
    # Every drafted token was rejected: a of the drafts used fell below the prior's 0.5, and the
    # verdict carries the window the model found best for the draft it names.
    last = rounds[-1].policy
    assert last is not None
    used = {row.draft_model for row in rounds}
    by_draft = {c["draft_model"]: c for c in last["decision"]["candidates"]}
    assert all(by_draft[name]["alpha"] < 0.4 for name in used), json.dumps(last)
    assert verdicts[-1].policy is not None
    assert by_draft[last["draft_model"]]["k"] == last["k"] == verdicts[-1].policy.k

    verdicts, again, rounds = results["fixed"]
    assert [v.policy.k for v in verdicts if v.policy is not None] == [3] * ROUNDS
    assert all("decision" not in (row.policy or {}) for row in rounds)
    assert_same_verdict(again, verdicts[-1])
