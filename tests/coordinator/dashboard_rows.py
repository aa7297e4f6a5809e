"""Rows for the admin API, replay and dashboard tests, written through the ORM into the test's
real database: a small fleet, and finished sessions whose rounds hold every kind of token."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from broker.messages import Mode
from coordinator.db.models import (
    DecodingSession,
    DeploymentState,
    DeviceDeploymentState,
    Round,
    SessionStatus,
)
from coordinator.db.registry import DeviceRegistry
from coordinator.ops.releases import store_release
from coordinator.ops.rollout import Deployments
from inference.artifacts import default_models_dir
from inference.tokenizer import ChatTokenizer
from modelbuild.target_build import ensure_target

PROMPT = "Why is the sky blue?"
ANSWER = (
    "The sky looks blue because the air scatters blue sunlight much more strongly than red "
    "light, so blue reaches our eyes from every direction."
)
# (k, n_accepted, provisional) of each round, repeated until the answer is used up. Together
# they give accepted, corrected, target (bonus and plain steps) and provisional tokens.
ROUND_PATTERN = ((4, 2, False), (3, 3, False), (5, 3, True), (0, 0, False), (4, 4, False))
LEGS_MS = {"draft": 3.0, "uplink": 5.0, "queue": 1.0, "verify": 12.0, "downlink": 5.0}
ROUND_GAP = timedelta(milliseconds=60)


@functools.cache
def chat_tokenizer() -> ChatTokenizer:
    """The real target's tokenizer (the target is built on first use, as the model tests do)."""
    return ChatTokenizer.load(ensure_target(default_models_dir()))


def add_fleet(sessions: sessionmaker[Session], now: datetime) -> DeviceRegistry:
    """jet-1 (lab), phone-1 (field), pi-1 (lab, field; online, with telemetry), pi-2."""
    registry = DeviceRegistry(sessions, hash_iterations=10)
    registry.provision("jet-1", "jetson", ["lab"], hardware={"gpu": "orin"})
    registry.provision("phone-1", "phone", ["field"])
    registry.provision("pi-1", "pi", ["lab", "field"])
    registry.provision("pi-2", "pi")
    registry.mark_online("pi-1", now)
    registry.record_telemetry(
        "pi-1",
        now,
        rtt_ms=14.0,
        cpu_percent=35.0,
        extra={"memory_available_mb": 612.0, "drafts_over_memory": "draft-l2"},
    )
    registry.set_installed_models("pi-1", ["draft-l1", "lookup"])
    return registry


@dataclass(frozen=True)
class StoredSession:
    """What a test may expect of a session it wrote: ids, tokens and each token's provenance."""

    id: uuid.UUID
    prompt_ids: list[int]
    generated: list[int]
    kinds: list[str]
    rounds: int
    drafted: int
    accepted: int
    round_ms: float  # sum of every measured leg of every round


def _wrong_tokens(tokenizer: ChatTokenizer, avoid: int, n: int) -> list[int]:
    """Draft tokens the target rejects: ordinary words that differ from the token it wants."""
    pool = [t for t in tokenizer.encode(" green purple orange violet grey") if t != avoid]
    return (pool * n)[:n]


def add_session(
    sessions: sessionmaker[Session],
    *,
    device_id: str = "pi-1",
    created_at: datetime,
    answer: str = ANSWER,
    task_type: str = "qa",
    status: SessionStatus = SessionStatus.FINISHED,
    mode: Mode = Mode.DISTRIBUTED,
    draft_model: str = "lookup",
    pattern: Sequence[tuple[int, int, bool]] = ROUND_PATTERN,
    temperature: float = 0.0,
) -> StoredSession:
    """A session whose rounds commit `answer` (plus eos) in the shapes of `pattern`."""
    tokenizer = chat_tokenizer()
    prompt_ids = tokenizer.apply_chat_template(PROMPT)
    answer_ids = [*tokenizer.encode(answer), tokenizer.eos_id]
    session_id = uuid.uuid4()
    rounds: list[Round] = []
    kinds: list[str] = []
    position = 0
    at = created_at
    drafted = accepted = 0
    round_ms = 0.0
    while position < len(answer_ids):
        k, n_accepted, provisional = pattern[len(rounds) % len(pattern)]
        left = len(answer_ids) - position
        n_accepted = min(n_accepted, left - 1)
        k = max(k, n_accepted) if k else 0
        right = answer_ids[position : position + n_accepted]
        target_token = answer_ids[position + n_accepted]
        draft = right + _wrong_tokens(tokenizer, target_token, k - n_accepted)
        drafted_kind = "provisional" if provisional else "accepted"
        kinds += [drafted_kind] * n_accepted + ["corrected" if n_accepted < k else "target"]
        at = at + ROUND_GAP
        base_len = len(prompt_ids) + position
        rounds.append(
            Round(
                session_id=session_id,
                round_index=len(rounds),
                base_len=base_len,
                draft_tokens=draft,
                draft_model=draft_model if k else None,
                k=k,
                n_accepted=n_accepted,
                next_token=target_token,
                committed_len=base_len + n_accepted + 1,
                provisional=provisional,
                verifier_id="verifier-0",
                policy={
                    "mode": mode.value,
                    "draft_model": draft_model,
                    "k": 4 if len(rounds) < 2 else 6,
                },
                t_draft_ms=LEGS_MS["draft"] if k else None,
                t_uplink_ms=LEGS_MS["uplink"],
                t_queue_ms=LEGS_MS["queue"],
                t_verify_ms=LEGS_MS["verify"],
                t_downlink_ms=LEGS_MS["downlink"],
                created_at=at,
            )
        )
        drafted += k
        accepted += n_accepted
        round_ms += sum(LEGS_MS.values()) - (0.0 if k else LEGS_MS["draft"])
        position += n_accepted + 1
    finished = status in (SessionStatus.FINISHED, SessionStatus.CANCELLED, SessionStatus.FAILED)
    row = DecodingSession(
        id=session_id,
        device_id=device_id,
        task_type=task_type,
        prompt=PROMPT,
        prompt_ids=prompt_ids,
        temperature=temperature,
        top_p=1.0,
        seed=1234,
        max_tokens=256,
        mode=mode,
        draft_model=draft_model,
        k=4,
        status=status,
        committed_ids=answer_ids,
        committed_len=len(prompt_ids) + len(answer_ids),
        created_at=created_at,
        updated_at=at,
        finished_at=at if finished else None,
    )
    with sessions.begin() as db:
        db.add(row)
        db.flush()
        db.add_all(rounds)
    return StoredSession(
        id=session_id,
        prompt_ids=prompt_ids,
        generated=answer_ids,
        kinds=kinds,
        rounds=len(rounds),
        drafted=drafted,
        accepted=accepted,
        round_ms=round_ms,
    )


def recent(seconds: float = 60.0) -> datetime:
    return datetime.now(timezone.utc) - timedelta(seconds=seconds)


@dataclass(frozen=True)
class StoredRollouts:
    """Two rollouts of one draft release: `done` reached every lab device, `rolling` is mid-way."""

    done: int
    rolling: int
    model: str
    sha256: str
    version: int


def add_rollouts(sessions: sessionmaker[Session], home: Path, draft: str) -> StoredRollouts:
    """The release of `draft` stored under `home`, then rolled out through coordinator.rollout
    as `specfleet models deploy` does, each device's outcome recorded as its ack would be."""
    stored = store_release(home, default_models_dir() / draft)
    deployments = Deployments(sessions)
    model_id = deployments.register_model(stored, str(stored.path))
    sha = stored.release.sha256

    def rollout(targets: list[str], waves: list[list[str]], wave_percent: float) -> int:
        return deployments.create(
            model_id=model_id,
            artifact_sha256=sha,
            targets=targets,
            waves=waves,
            wave_percent=wave_percent,
            abort_at_percent=60.0,
            actor="cli",
        )

    installed, rolled_back = DeviceDeploymentState.INSTALLED, DeviceDeploymentState.ROLLED_BACK
    done = rollout(["lab"], [["jet-1"], ["pi-1"]], 50.0)
    for wave, device_id in enumerate(("jet-1", "pi-1")):
        deployments.start_wave(done, wave, [device_id])
        deployments.record_device(done, device_id, installed, "installed", model_name=draft)
    deployments.finish(done, DeploymentState.DONE, {"waves_run": 2})

    rolling = rollout(["phone-1", "pi-2", "lab"], [["jet-1"], ["phone-1"], ["pi-1", "pi-2"]], 34.0)
    deployments.start_wave(rolling, 0, ["jet-1"])
    deployments.record_device(rolling, "jet-1", installed, "already_installed", model_name=draft)
    deployments.start_wave(rolling, 1, ["phone-1"])
    deployments.record_device(
        rolling, "phone-1", rolled_back, "smoke: RuntimeError: no memory", model_name=draft
    )
    return StoredRollouts(done, rolling, draft, sha, stored.release.version)
