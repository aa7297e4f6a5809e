"""A small calibration for the simulator's tests: a verifier whose passes cost a known amount."""

from __future__ import annotations

import pytest

from sim.inputs import Calibration, PositionRates, VerifierProfile

PASS_MS = 20.0  # every pass, whatever its shape: the tests can count


def flat_profile(ms: float = PASS_MS, cv: float = 0.0) -> VerifierProfile:
    return VerifierProfile(
        passes=[(b, t, ms) for b in (1, 2, 4, 8, 16, 32) for t in (1, 2, 3, 5, 9)],
        prefill_fixed_ms=0.0,
        prefill_ms_per_token=0.0,
        pass_cv=cv,
    )


def make_calibration(**overrides: object) -> Calibration:
    values: dict[str, object] = {
        "verifiers": {"cpu": flat_profile()},
        "acceptance": {"hybrid": {"*": PositionRates(fill=[1.0] * 16, accept=[0.5] * 16)}},
        "host_draft_ms_per_token": {"hybrid": 0.0},
        "device_draft_ms_per_token": {"bench": {"hybrid": 0.0}},
        "answer_tokens": {"chat": [40]},
        "prompt_tokens": {"chat": [30]},
        "round_service_ms": [1.0],
        "agent_turn_ms": 0.0,
        "coordinator_round_ms": 0.0,
        "open_ms": 0.0,
        "broker_hop_ms": 0.0,
    }
    values.update(overrides)
    return Calibration.model_validate(values)


@pytest.fixture
def calibration() -> Calibration:
    return make_calibration()
