"""Bring your own model pair: a llama-family GGUF the test writes (its own vocabulary and chat
template), built into a target, a draft distilled for it, and sessions over the real Mosquitto
whose greedy output is the target's alone, token for token."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from rounds_check import assert_rounds_rebuild

from core.settings import Settings
from inference.artifacts import default_models_dir, load_manifest
from inference.sampling import SamplingParams
from inference.speculative import decode_target
from localfleet.demo import ask
from localfleet.fleet import AgentSpec, LocalFleet, local_fleet
from modelbuild.distill import ensure_drafts
from modelbuild.target_build import ensure_target, load_target
from tests.inference.tiny_gguf import EOS, TinyShape, write_tiny_gguf

SHARED_MOSQUITTO = "mqtt://127.0.0.1:1883"
# A coordinator on the shared Mosquitto: one such module at a time (tests/conftest.py).
pytestmark = pytest.mark.shared_mosquitto
TARGET = "tiny-byo"
DRAFT = f"{TARGET}-draft-l1"
FOREIGN_DRAFT = "draft-l1"  # SmolLM2's: the same architecture, another vocabulary
PROMPTS = (
    "What is the capital of France?",
    "Tell me a story about the world.",
    "Write code to say hello to the world.",
    "the the the and and and",
)
MAX_TOKENS = 24
AGENTS = [
    AgentSpec("byo-neural", "pi", DRAFT, "onnx"),
    AgentSpec("byo-lookup", "phone", "lookup", "none"),
]


def _specfleet(*arguments: str) -> None:
    command = [sys.executable, "-m", "specfleet", *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def byo_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models directory with the tiny target, a draft distilled for it by the commands an
    operator runs, and SmolLM2's draft beside them (which must never serve this target)."""
    root = tmp_path_factory.mktemp("byo-e2e")
    models = root / "models"
    gguf_path = write_tiny_gguf(root / "tiny.gguf", TinyShape(seed=3))
    _specfleet("models", "build-target", "--gguf", str(gguf_path), "--name", TARGET,
               "--models-dir", str(models))  # fmt: skip
    _specfleet("models", "distill", "--target", TARGET, "--models-dir", str(models),
               "--teacher-tokens", "3000", "--minutes", "0.2", "--size", "tiny",
               "--formats", "onnx")  # fmt: skip
    smollm_models = default_models_dir()
    ensure_drafts(smollm_models, ensure_target(smollm_models))
    shutil.copytree(smollm_models / FOREIGN_DRAFT, models / FOREIGN_DRAFT)
    return models


def _target_alone(models: Path) -> dict[str, list[int]]:
    """`specfleet generate --mode target` on the tiny target: greedy, no drafter, no bus."""
    target, tokenizer = load_target(models, name=TARGET)
    return {
        prompt: decode_target(
            target,
            tokenizer.apply_chat_template(prompt),
            MAX_TOKENS,
            SamplingParams(temperature=0.0),
            eos=tokenizer.eos_id,
        ).tokens
        for prompt in PROMPTS
    }


async def _ask_all(fleet: LocalFleet) -> list[dict[str, Any]]:
    async with httpx.AsyncClient() as client:

        async def serve(device_id: str) -> list[dict[str, Any]]:
            answers = []
            for prompt in PROMPTS:
                request = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
                port = fleet.agent_ports[device_id]
                summary = await ask(client, port, request, device_id, stream=False)
                answers.append({**summary, "prompt": prompt, "device_id": device_id})
            return answers

        per_agent = await asyncio.gather(*(serve(spec.device_id) for spec in AGENTS))
    return [answer for answers in per_agent for answer in answers]


async def _refused(fleet: LocalFleet, draft: str) -> str:
    async with httpx.AsyncClient() as client:
        request = {"prompt": "hello", "max_tokens": 4, "draft": draft}
        with pytest.raises(RuntimeError) as refused:
            await ask(client, fleet.agent_ports["byo-neural"], request, "byo-neural", False)
    return str(refused.value)


def test_a_session_on_a_gguf_the_test_wrote_equals_its_target_alone(
    byo_models: Path, tmp_path: Path
) -> None:
    manifest = load_manifest(byo_models / TARGET)
    settings = Settings(
        home=tmp_path / "home",
        models_dir=byo_models,
        target=TARGET,
        coordinator_id=f"coord-byo-{uuid.uuid4().hex[:8]}",
    )

    async def main() -> tuple[list[dict[str, Any]], str]:
        async with local_fleet(
            settings, AGENTS, ["byo-verifier"], workdir=tmp_path / "fleet",
            external_broker=SHARED_MOSQUITTO,
        ) as fleet:  # fmt: skip
            book = fleet.coordinator.book
            # The coordinator knows the target from its manifest and its verifier, not a constant.
            assert book.eos_id == EOS == manifest.config["eos_id"]
            assert book.target_vocab() == manifest.vocab_sha256
            announced = fleet.coordinator.verifiers.announced_target()
            assert announced is not None and announced.target.startswith(f"{TARGET}@")
            assert DRAFT in announced.drafts and FOREIGN_DRAFT not in announced.drafts
            answers = await _ask_all(fleet)
            with fleet.coordinator.sessions() as db:
                for answer in answers:
                    assert_rounds_rebuild(db, answer["session_id"], answer["token_ids"])
            return answers, await _refused(fleet, FOREIGN_DRAFT)

    answers, refusal = asyncio.run(main())
    expected = _target_alone(byo_models)
    assert len(answers) == len(PROMPTS) * len(AGENTS)
    for answer in answers:
        assert answer["token_ids"] == expected[answer["prompt"]], answer["device_id"]
    assert any(len(tokens) == MAX_TOKENS for tokens in expected.values())  # rounds, not one step
    # Both drafters drafted, and the target accepted some of it: speculation, not plain decoding.
    for spec in AGENTS:
        mine = [a for a in answers if a["device_id"] == spec.device_id]
        assert sum(sum(a["drafted"]) for a in mine) > 0, spec.draft
    assert sum(sum(a["accepted"]) for a in answers) > 0
    # A draft of another vocabulary is refused when the session opens, with the reason.
    assert "another vocabulary" in refusal and FOREIGN_DRAFT in refusal
