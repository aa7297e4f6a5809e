"""Feature drafting across real processes: verdicts bring the target's features to a head.

A coordinator, a verifier and an agent on a private Mosquitto; the agent holds a tiny untrained
head (random weights of the target's hidden size) beside the target. A listener on the bus reads
every draft and verdict of the device. Sessions drafted by the head, alone and behind the copying
tiers, must answer as the target alone does; their drafts ask for features and their verdicts
carry the target's hidden state at h_{n-1}, as a target-alone pass computes it; a session whose
drafter does not ask sees no feature byte, nor does a cloud session (the host hands its head the
features of the same pass in memory); a sampled session finishes and rebuilds from its rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rounds_check import assert_rounds_rebuild
from test_dsd_bus import shared_prompts, target_answer

from broker import messages as m
from broker.client import BrokerAddress, ConnectOptions, connect
from broker.mosquitto import PrivateMosquitto
from broker.topics import DeviceChannel, device_topic
from core.settings import Settings
from inference.feature_head import random_head_weights
from inference.features import features_from_wire
from localfleet.demo import ask
from localfleet.fleet import START_TIMEOUT_S, AgentSpec, local_fleet
from modelbuild.head_build import build_head
from modelbuild.target_build import ensure_target, load_target

MAX_TOKENS = 20
HEAD = "eagle-random"
AGENT = AgentSpec("feature-device", "other", "hybrid", "onnx")


def _models_dir(home: Path) -> Path:
    """The target (linked from the default models directory, built there once) and a random
    head built for it."""
    models = home / "models"
    models.mkdir(parents=True)
    target_dir = ensure_target()
    (models / target_dir.name).symlink_to(target_dir, target_is_directory=True)
    runtime, _ = load_target()
    ids = np.arange(0, runtime.vocab_size, 16)
    weights = random_head_weights(
        runtime.hidden_size, ids, 1, vocab_size=runtime.vocab_size, intermediate_size=64, name=HEAD
    )
    build_head(models, weights, models / target_dir.name)
    return models


async def _listen(url: str, seen: dict[str, list[m.Message]], ready: asyncio.Event) -> None:
    """Every draft and verdict of the device, by session, as they cross the broker."""
    topics = [
        device_topic(AGENT.device_id, c) for c in (DeviceChannel.DRAFT, DeviceChannel.VERDICT)
    ]
    options = ConnectOptions(client_id=f"listener-{uuid.uuid4().hex[:8]}")
    async with connect(BrokerAddress.from_url(url), options) as client:
        for topic in topics:
            await client.subscribe(topic)
        ready.set()
        async for incoming in client.messages():
            message = m.decode(incoming.payload)
            if isinstance(message, m.Draft | m.Verdict):
                seen[message.session_id].append(message)


def test_feature_rounds_over_the_bus(tmp_path: Path) -> None:
    prompts = shared_prompts()[:2]
    requests = [
        {"draft": HEAD, "k": 4},
        {"draft": f"hybrid+{HEAD}", "k": 8},
        {"draft": "lookup", "k": 4},
        {"draft": HEAD, "mode": "cloud", "k": 4},  # the host drafts: no features on the bus
    ]

    async def main() -> tuple[list[dict[str, Any]], dict[str, list[m.Message]], dict[str, Any]]:
        settings = Settings(home=tmp_path / "home", coordinator_id=f"c-{uuid.uuid4().hex[:8]}")
        _models_dir(tmp_path / "home")
        seen: dict[str, list[m.Message]] = defaultdict(list)
        with PrivateMosquitto(tcp_nodelay=True) as mosquitto:
            ready = asyncio.Event()
            listener = asyncio.create_task(_listen(mosquitto.url, seen, ready), name="listener")
            await ready.wait()
            async with local_fleet(
                settings,
                [AGENT],
                ["feature-verifier"],
                workdir=tmp_path / "fleet",
                external_broker=mosquitto.url,
            ) as fleet:
                await fleet.wait_agents(time.monotonic() + START_TIMEOUT_S)
                answers: list[dict[str, Any]] = []
                async with httpx.AsyncClient() as client:
                    port = fleet.agent_ports[AGENT.device_id]
                    for prompt in prompts:
                        for fields in requests:
                            request = {
                                "prompt": prompt["prompt"],
                                "task_type": prompt["task"],
                                "max_tokens": MAX_TOKENS,
                                **fields,
                            }
                            summary = await ask(client, port, request, AGENT.device_id, False)
                            answers.append({**summary, "prompt": prompt, **fields})
                    sampled = {
                        "prompt": prompts[0]["prompt"],
                        "max_tokens": MAX_TOKENS,
                        "draft": HEAD,
                        "k": 4,
                        "temperature": 0.8,
                        "seed": 7,
                    }
                    sampled_answer = await ask(client, port, sampled, AGENT.device_id, False)
                await asyncio.sleep(0.5)  # the last verdicts reach the listener
                with fleet.coordinator.sessions() as db:
                    for answer in [*answers, sampled_answer]:
                        assert_rounds_rebuild(db, answer["session_id"], answer["token_ids"])
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
        return answers, seen, sampled_answer

    answers, seen, sampled_answer = asyncio.run(main())

    target, tokenizer = load_target()
    for answer in answers:
        assert answer["status"] == "finished", answer
        prompt_ids = tokenizer.apply_chat_template(answer["prompt"]["prompt"])
        expected = list(target_answer(answer["prompt"]["prompt"], MAX_TOKENS))
        assert answer["token_ids"] == expected, answer["draft"]
        messages = seen[answer["session_id"]]
        drafts = [d for d in messages if isinstance(d, m.Draft)]
        verdicts = [v for v in messages if isinstance(v, m.Verdict)]
        assert verdicts
        if answer["draft"] == "lookup" or answer.get("mode") == "cloud":
            # (A cloud session's stream starts at its open: its device sends no draft at all.)
            assert all(d.want_features is None for d in drafts)
            assert all(v.features is None for v in verdicts)
            continue
        assert drafts and all(d.want_features for d in drafts)
        sequence = [*prompt_ids, *expected]
        ((_, hidden),) = target.forward_batch_hidden([(sequence, target.new_cache())])
        for verdict in verdicts:
            if verdict.finished:
                assert verdict.features is None
                continue
            assert verdict.features is not None, verdict
            # h_{n-1}: the hidden state at the second-to-last committed position.
            features = features_from_wire(verdict.features)
            np.testing.assert_allclose(
                features, hidden[verdict.committed_len - 2], rtol=2e-3, atol=2e-3
            )
    assert sampled_answer["status"] == "finished"
    sampled_drafts = [d for d in seen[sampled_answer["session_id"]] if isinstance(d, m.Draft)]
    assert all(d.want_features and d.q_ids is not None for d in sampled_drafts if d.tokens)
