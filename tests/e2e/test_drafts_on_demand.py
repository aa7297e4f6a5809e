"""Drafts on demand and memory admission, across real processes: a real Mosquitto, the
coordinator with its database and the artifact API, a verifier with the real target, agents.

- A session asks for a draft its device lacks: the device drafts with its copying tiers while
  the coordinator sends the draft's signed release; the device installs it (signature, sha256,
  vocabulary, smoke draft), and the draft drafts the next session's rounds. Every answer is the
  target's own.
- A fetch the device must refuse (a release signed with another key, an artifact altered in the
  store) leaves the device as it was, the session answers exactly, and the coordinator does not
  send the same draft to it again while it backs off.
- Memory admission: an agent whose /proc says 100 MB are free refuses to load draft-l2; its
  session drafts with the copying hybrid, each round records why, and its telemetry tells the
  policy which drafts do not fit.
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
    device_notes,
    fetches_for,
    installed,
    on_demand_settings,
    start_agent,
    start_own_agent,
    until,
)
from test_dsd_bus import shared_prompts, target_answer

from broker.mosquitto import PrivateMosquitto
from coordinator.ops.releases import (
    artifact_path,
    load_or_create_release_key,
    release_public_key_pem,
    store_release,
)
from inference.artifacts import default_models_dir
from localfleet.fleet import START_TIMEOUT_S, AgentSpec, local_fleet

MAX_TOKENS = 24
FETCHED = "draft-l1"  # sent whole and installed
ALTERED = "draft-l2"  # its stored artifact is altered: the device must refuse it
GOOD = AgentSpec("od-good", "phone", "hybrid", "none")
WRONG_KEY = AgentSpec("od-wrong-key", "phone", "hybrid", "none")
ALTERED_STORE = AgentSpec("od-altered", "phone", "hybrid", "none")
LOW_MEMORY = AgentSpec("od-low-memory", "phone", "hybrid", "none")


def _request(prompt: dict[str, str], draft: str) -> dict[str, Any]:
    return {
        "prompt": prompt["prompt"],
        "task_type": prompt["task"],
        "max_tokens": MAX_TOKENS,
        "draft": draft,
        "k": 4,
        "mode": "distributed",
    }


def test_drafts_on_demand_and_memory_admission(tmp_path: Path) -> None:
    models_dir = default_models_dir()
    for name in (FETCHED, ALTERED):
        if not (models_dir / name / "manifest.json").is_file():
            pytest.skip(f"{name} is not built in {models_dir}")
    prompts = shared_prompts()
    settings, key_file = on_demand_settings(tmp_path, models_dir)
    home = settings.home
    # Another coordinator's key: what that device checks our signatures with.
    wrong_key = tmp_path / "wrong-key.pub.pem"
    wrong_key.write_bytes(release_public_key_pem(tmp_path / "another-coordinator"))
    # ALTERED is released before the fleet starts, then one byte of its stored artifact flips.
    altered = store_release(home, models_dir / ALTERED)
    stored = artifact_path(home, altered.release.sha256)
    body = bytearray(stored.read_bytes())
    body[len(body) // 2] ^= 0xFF
    stored.write_bytes(bytes(body))
    load_or_create_release_key(home)
    proc_root = tmp_path / "proc"
    proc_root.mkdir()
    (proc_root / "meminfo").write_text(
        "MemTotal:        4000000 kB\nMemFree:           50000 kB\nMemAvailable:     102400 kB\n"
    )

    async def main() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        with PrivateMosquitto(tcp_nodelay=True) as mosquitto:
            async with local_fleet(
                settings, [], ["od-verifier"], workdir=tmp_path / "fleet",
                external_broker=mosquitto.url,
            ) as fleet, artifact_api(fleet, settings.http_port):  # fmt: skip
                start_own_agent(fleet, GOOD, tmp_path, key_file, models_dir)
                start_own_agent(fleet, WRONG_KEY, tmp_path, wrong_key, models_dir)
                start_own_agent(fleet, ALTERED_STORE, tmp_path, key_file, models_dir)
                start_agent(fleet, LOW_MEMORY, tmp_path, "--proc-root", str(proc_root))
                await fleet.wait_agents(time.monotonic() + START_TIMEOUT_S)
                async with httpx.AsyncClient() as client:
                    # (a) the device lacks FETCHED: asked for, fetched, installed, then used.
                    first = await answer(fleet, client, GOOD, _request(prompts[0], FETCHED))
                    await until("the fetch", lambda: fetches_for(fleet, GOOD.device_id))
                    second = await answer(fleet, client, GOOD, _request(prompts[1], FETCHED))
                    seen["good"] = (first, second, fetches_for(fleet, GOOD.device_id))
                    # (b) refused fetches leave the device as it was; no second try meanwhile.
                    for spec, draft in ((WRONG_KEY, FETCHED), (ALTERED_STORE, ALTERED)):
                        runs = [await answer(fleet, client, spec, _request(prompts[0], draft))]
                        await until("the fetch", lambda s=spec: fetches_for(fleet, s.device_id))
                        runs.append(await answer(fleet, client, spec, _request(prompts[1], draft)))
                        seen[spec.device_id] = (runs, fetches_for(fleet, spec.device_id))
                    # (c) too little memory for draft-l2: the copying hybrid drafts, and says why.
                    policy = fleet.coordinator.book.policy
                    await until(
                        "the memory telemetry",
                        lambda: policy.memory_note(LOW_MEMORY.device_id) is not None,
                    )
                    seen["memory_note"] = policy.memory_note(LOW_MEMORY.device_id)
                    seen["low"] = await answer(
                        fleet, client, LOW_MEMORY, _request(prompts[0], ALTERED)
                    )
                seen["models"] = {
                    spec.device_id: installed(tmp_path, spec)
                    for spec in (GOOD, WRONG_KEY, ALTERED_STORE)
                }
        return seen

    seen = asyncio.run(main())
    expected = [list(target_answer(p["prompt"], MAX_TOKENS)) for p in prompts[:2]]

    # (a) The first session drafted with the copying hybrid while the draft was fetched, and
    # said so on its rounds; the second drafted with the installed draft. Both exact.
    (first, first_rounds), (second, second_rounds), fetched = seen["good"]
    assert first["token_ids"] == expected[0] and second["token_ids"] == expected[1]
    assert [o.ok for o in fetched] == [True], fetched
    assert first_rounds[0].draft_model == "hybrid"
    assert device_notes(first_rounds)[0] == f"{FETCHED} is not on this device (fetching it)"
    assert {r.draft_model for r in second_rounds} == {FETCHED}
    assert not device_notes(second_rounds)
    assert seen["models"][GOOD.device_id] == [FETCHED]

    # (b) Refused: the device is as it was, the answers exact, and one fetch only was sent.
    for spec, reason in (
        (WRONG_KEY, "signature: signature does not verify with the release key"),
        (ALTERED_STORE, "check: sha256 mismatch: the artifact was altered"),
    ):
        runs, outcomes = seen[spec.device_id]
        assert [answer["token_ids"] for answer, _ in runs] == expected
        assert len(outcomes) == 1 and not outcomes[0].ok, outcomes
        assert reason in outcomes[0].detail, outcomes[0].detail
        assert seen["models"][spec.device_id] == []
        for _, rounds in runs:
            assert {r.draft_model for r in rounds} == {"hybrid"}
        # The first session's rounds wait for the fetch, until it fails (a refusal can come
        # back before the first window is drafted); the second's say that it failed, and why.
        first_notes, second_notes = (device_notes(rounds) for _, rounds in runs)
        waiting = [note.endswith("is not on this device (fetching it)") for note in first_notes]
        until_failed = waiting.index(False) if False in waiting else len(waiting)
        assert first_notes and not any(waiting[until_failed:]), first_notes
        assert all(reason in note for note in first_notes[until_failed:]), first_notes
        assert second_notes and all(
            "is not on this device: its fetch failed (" in note and reason in note
            for note in second_notes
        ), second_notes

    # (c) draft-l2 does not fit: refused at load, the hybrid drafts, every round says why, the
    # answer is exact, and the policy heard which drafts do not fit.
    low, low_rounds = seen["low"]
    assert low["token_ids"] == expected[0]
    assert {r.draft_model for r in low_rounds} == {"hybrid"}
    notes = device_notes(low_rounds)
    assert len(notes) == len(low_rounds)
    assert all(
        note.startswith(f"memory: {ALTERED} needs ") and "100 MB available (margin 64 MB)" in note
        for note in notes
    ), notes
    assert seen["memory_note"] is not None and ALTERED in seen["memory_note"]
