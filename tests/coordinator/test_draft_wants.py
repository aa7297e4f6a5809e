"""The adaptive policy wants a drafter the device lacks: what the fleet can deliver, how a
lacking drafter is rated (the fleet's acceptance by task, its class's draft cost, the device's
free memory), when it is asked for, and the back-off after a failed fetch (DraftFetches)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from broker import messages as m
from coordinator.ops.releases import store_release
from coordinator.runtime import draft_fetches
from coordinator.runtime.draft_fetches import DraftFetches
from coordinator.runtime.draft_wants import (
    DEVICE_MEMORY_MARGIN_MB,
    FETCH_MARGIN,
    Deliverable,
    deliverable_drafts,
)
from coordinator.runtime.policy import AdaptivePolicy, RoundObservation
from inference.artifacts import default_models_dir, load_manifest
from inference.resident import MB, resident_bytes

PEER = "peer-1"  # a phone that has draft-l1
PHONE = "phone-1"  # a phone that lacks it
PI = "pi-1"  # another class of device
WANTED = "draft-l1"
DRAFT_MB = 200.0


def _round(device: str, draft: str, n_accepted: int, t_draft_ms: float, i: int) -> RoundObservation:
    return RoundObservation(
        session_id=f"{device}-{draft}-{i}",
        device_id=device,
        draft_model=draft,
        task_type="chat",
        k=4,
        n_accepted=n_accepted,
        t_draft_ms=t_draft_ms,
        t_uplink_ms=10.0,
        t_queue_ms=1.0,
        t_verify_ms=30.0,
        verifier_load=1.0,
        window=4,
    )


def _policy(peer_accepts: int = 4, peer_ms: float = 12.0) -> AdaptivePolicy:
    """The peer ran draft-l1 (accepting `peer_accepts` of 4 at `peer_ms` a round); the phone
    has nothing installed and its hybrid accepts 1 of 4."""
    policy = AdaptivePolicy()
    wants = policy.wants
    wants.deliverable = {WANTED: _deliverable(WANTED), "draft-l2": _deliverable("draft-l2")}
    for device, kind in ((PEER, "phone"), (PHONE, "phone"), (PI, "pi")):
        wants.kinds[device] = kind
    policy.set_device_drafts(PEER, [WANTED])
    policy.set_device_drafts(PHONE, [])
    for i in range(20):
        policy.observe(_round(PEER, WANTED, peer_accepts, peer_ms, i))
        policy.observe(_round(PHONE, "hybrid", 1, 0.8, i))
    return policy


def _deliverable(name: str) -> Deliverable:
    return Deliverable(name, DRAFT_MB)


def _decide(policy: AdaptivePolicy, session: str = "s1", draft: str = "hybrid") -> Any:
    return policy.decide(session, PHONE, "chat", draft, 1.0)


def test_the_fleet_delivers_the_decoder_drafts_built_or_released_here(tmp_path: Path) -> None:
    models_dir = default_models_dir()
    if not (models_dir / WANTED / "manifest.json").is_file():
        pytest.skip(f"{WANTED} is not built in {models_dir}")
    built = deliverable_drafts(tmp_path / "home", models_dir)
    roles = {p.parent.name: load_manifest(p.parent) for p in models_dir.glob("*/manifest.json")}
    expected = {n for n, man in roles.items() if man.role == "draft" and man.kind == "decoder"}
    assert set(built) == expected and WANTED in built
    assert "eagle-h1" not in built  # a feature head runs beside the target, not on a device
    manifest = roles[WANTED]
    assert built[WANTED].resident_mb == resident_bytes(manifest, isolated=True) / MB
    assert built[WANTED].prior_alpha == manifest.extra["valid_top1"]
    assert built[WANTED].family == WANTED
    if "draft-l1-tflite" in built:
        assert built["draft-l1-tflite"].family == WANTED  # the same drafter for LiteRT
    # Released here, its directory gone from the models directory: still deliverable.
    home = tmp_path / "home2"
    store_release(home, models_dir / WANTED)
    released = deliverable_drafts(home, tmp_path / "empty")
    assert set(released) == {WANTED}
    assert released[WANTED].resident_mb == built[WANTED].resident_mb


def test_a_lacking_drafter_rated_past_the_margin_is_fetched_once_then_used() -> None:
    policy = _policy()
    decision = _decide(policy)
    # Rated on the fleet's acceptance and the phone class's draft cost; the session keeps
    # drafting with what the device has.
    assert decision.fetch == WANTED
    assert decision.draft_model != WANTED
    assert f"{WANTED} would give " in decision.reason
    assert decision.reason.endswith(": fetching it for this device")
    assert decision.to_json()["decision"]["fetch"] == WANTED
    # Deterministic: the same inputs give the same decision, word for word.
    assert _policy() is not policy and _decide(_policy()).to_json() == decision.to_json()
    # The book asks the fetcher and says so: not asked again while the fetch runs, nor any
    # other drafter for the device (draft-l2, on its build's figure, also beats hybrid here).
    policy.wants.fetching(PHONE, WANTED)
    policy.wants.deliverable["draft-l2"] = Deliverable("draft-l2", DRAFT_MB, prior_alpha=0.9)
    again = _decide(policy)
    assert again.fetch is None
    policy.wants.deliverable["draft-l2"] = _deliverable("draft-l2")
    assert f"being fetched for this device: {WANTED}" in again.reason
    # Installed and verified (the device's status lists it): rated with the others, chosen;
    # another build of the same drafter (for another runtime) is not fetched on top of it.
    policy.wants.deliverable["draft-l1-tflite"] = Deliverable(
        "draft-l1-tflite", DRAFT_MB, prior_alpha=0.99, family=WANTED
    )
    policy.set_device_drafts(PHONE, [WANTED])
    installed = _decide(policy)
    assert installed.fetch is None and "fetch" not in installed.reason
    assert installed.draft_model == WANTED


def test_the_lacking_drafter_is_rated_from_the_fleet_and_the_device_class() -> None:
    policy = _policy(peer_ms=12.0)
    assert policy.alpha(PHONE, WANTED, "chat") == pytest.approx(policy.alpha(PEER, WANTED, "chat"))
    rated = {c.draft_model: c for c in _decide(policy).candidates}
    assert WANTED not in rated  # the device lacks it: no candidate to switch to
    # Same class: the peer's cost; another class: the prior (8 ms a token).
    phone = policy._candidate(m.Mode.DISTRIBUTED, PHONE, WANTED, "chat", 20.0, 1.0, 1.0)
    pi = policy._candidate(m.Mode.DISTRIBUTED, PI, WANTED, "chat", 20.0, 1.0, 1.0)
    assert phone.draft_ms_per_token == pytest.approx(3.0)
    assert pi.draft_ms_per_token == pytest.approx(8.0)


def test_with_no_device_having_run_it_a_drafter_is_rated_on_its_builds_acceptance() -> None:
    policy = AdaptivePolicy()
    policy.wants.deliverable = {WANTED: Deliverable(WANTED, DRAFT_MB, prior_alpha=0.56)}
    policy.set_device_drafts(PHONE, [])
    for i in range(20):
        policy.observe(_round(PHONE, "hybrid", 0, 0.8, i))
    # Neither the phone nor the fleet ran draft-l1: its build's figure, not hybrid's misses.
    assert policy.alpha(PHONE, WANTED, "chat") == pytest.approx(0.56)
    decision = _decide(policy)
    assert decision.fetch == WANTED, decision.reason
    # Once the fleet has run it, what the fleet saw wins over the build's figure.
    for i in range(20):
        policy.observe(_round(PEER, WANTED, 0, 12.0, i))
    assert policy.alpha(PHONE, WANTED, "chat") < 0.1


def test_a_drafter_not_past_the_margin_or_not_fitting_is_not_fetched() -> None:
    # As good as what the device has: no fetch, nothing said.
    poor = _policy(peer_accepts=1)
    decision = _decide(poor)
    assert decision.fetch is None and "fetch" not in decision.reason
    best_installed = max(
        (c for c in decision.candidates if c.mode is m.Mode.DISTRIBUTED),
        key=lambda c: c.tokens_per_s,
    )
    rated = poor._candidate(m.Mode.DISTRIBUTED, PHONE, WANTED, "chat", 20.0, 1.0, 1.0)
    assert rated.tokens_per_s <= best_installed.tokens_per_s * FETCH_MARGIN
    # Past the margin but the device's free memory does not hold it with the margin.
    policy = _policy()
    free = DRAFT_MB + DEVICE_MEMORY_MARGIN_MB - 1
    policy.observe_telemetry(PHONE, m.Telemetry(device_id=PHONE, at=1.0, memory_available_mb=free))
    decision = _decide(policy)
    assert decision.fetch is None
    assert f"{WANTED} needs {DRAFT_MB:.0f} MB, {free:.0f} MB free: not fetched" in decision.reason
    # A device whose status was never heard may have it: nothing is fetched.
    unheard = _policy()
    del unheard._device_drafts[PHONE]
    assert _decide(unheard).fetch is None
    # A hot device is spared: it fetches nothing.
    hot = _policy()
    hot.observe_telemetry(PHONE, m.Telemetry(device_id=PHONE, at=1.0, thermal_c=95.0))
    assert hot.device_limit(PHONE) is not None and _decide(hot).fetch is None


def test_a_failed_fetch_backs_off_and_the_policy_stops_asking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fetcher's device refuses the release: the device stays as it was, the policy leaves
    the drafter out while the fetch backs off, then asks once more (the back-off doubles)."""
    models_dir = default_models_dir()
    if not (models_dir / WANTED / "manifest.json").is_file():
        pytest.skip(f"{WANTED} is not built in {models_dir}")
    monkeypatch.setattr(draft_fetches, "FETCH_BACKOFF_S", 0.5)
    sent: list[tuple[str, str]] = []

    async def refuse(device_id: str, name: m.CommandName, args: dict[str, Any], _: float) -> Any:
        sent.append((device_id, args["name"]))
        return m.CommandAck(command_id="c", device_id=device_id, ok=False, error="check: no room")

    async def main() -> tuple[list[Any], DraftFetches]:
        policy = _policy()
        fetches = DraftFetches(tmp_path, models_dir, "http://127.0.0.1:9/api/v1", refuse, policy)
        seen = []

        async def round_() -> Any:  # what AdaptiveBook._decide does with a decision
            decision = _decide(policy)
            if decision.fetch is not None:
                policy.wants.fetching(PHONE, decision.fetch)
                fetches.want(PHONE, decision.fetch)
            seen.append(decision)
            await asyncio.sleep(0.05)
            return decision

        while len(sent) < 1 or not fetches.outcomes:
            await round_()
        for _ in range(3):  # backing off: left out, not asked
            await round_()
        while len(sent) < 2 or len(fetches.outcomes) < 2:  # the back-off ends: asked once more
            await round_()
        await fetches.aclose()
        return seen, fetches

    decisions, fetches = asyncio.run(main())
    outcomes = fetches.outcomes
    assert sent == [(PHONE, WANTED), (PHONE, WANTED)]
    assert [o.ok for o in outcomes] == [False, False]
    assert all("check: no room" in o.detail for o in outcomes)
    asks = [i for i, d in enumerate(decisions) if d.fetch == WANTED]
    assert len(asks) == 2 and asks[0] == 0
    between = decisions[asks[0] + 1 : asks[1]]
    assert between and all(d.fetch is None and d.draft_model != WANTED for d in between)
    assert all(WANTED not in {c.draft_model for c in d.candidates} for d in decisions)
    # The second failure backs off twice as long, and the policy leaves the drafter out.
    failures = fetches._failed[(PHONE, WANTED)]
    assert failures.count == 2
    assert fetches.backing_off(PHONE, WANTED) == "check: no room"
    last = _decide(fetches.observer)  # type: ignore[arg-type]
    assert last.fetch is None and "fetch" not in last.reason
