"""Calibration from a real database's rounds, and the command's one-line refusals."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session as DbSession

from broker.messages import Mode
from coordinator.db.models import (
    DecodingSession,
    Device,
    DeviceKind,
    Round,
    SessionStatus,
)
from sim.calibrate import calibrate, fit_coordinator_round_ms
from specfleet.cli import main
from tests.sim.conftest import flat_profile

# Rounds of a window of 4: the drafter always fills it; the target accepts 2 of 4.
ROUNDS = 30


def _store(engine: Engine) -> None:
    with DbSession(engine) as db, db.begin():
        db.add(Device(id="dev-1", kind=DeviceKind.PI, credential_hash="x"))
        db.flush()
        session_id = uuid.uuid4()
        db.add(
            DecodingSession(
                id=session_id, device_id="dev-1", task_type="code", prompt="p",
                prompt_ids=list(range(20)), temperature=0.0, top_p=1.0, seed=1, max_tokens=90,
                mode=Mode.DISTRIBUTED, draft_model="hybrid", k=4,
                status=SessionStatus.FINISHED, committed_ids=list(range(90)), committed_len=110,
            )
        )  # fmt: skip
        db.flush()
        for i in range(ROUNDS):
            db.add(
                Round(
                    session_id=session_id, round_index=i, base_len=20 + 3 * i,
                    draft_tokens=[1, 2, 3, 4], draft_model="hybrid", k=4,
                    mode=Mode.DISTRIBUTED, n_accepted=2, next_token=5,
                    committed_len=23 + 3 * i, t_draft_ms=2.0, policy={"k": 4},
                )
            )  # fmt: skip


def test_calibration_reads_acceptance_lengths_and_costs(db_engine: Engine) -> None:
    _store(db_engine)
    url = db_engine.url.render_as_string(hide_password=False)
    calibration = calibrate(url, flat_profile())
    rates = calibration.acceptance["hybrid"]["code"]
    assert rates.rounds == ROUNDS
    assert rates.fill[0] == pytest.approx((ROUNDS + 2) / (ROUNDS + 4))  # the prior, 0.5 x 4
    assert all(rate > 0.9 for rate in rates.fill[:4])
    assert rates.accept[0] > 0.9 and rates.accept[1] > 0.9 and rates.accept[2] < 0.2
    assert calibration.answer_tokens == {"code": [90]}
    assert calibration.prompt_tokens == {"code": [20]}
    assert calibration.device_draft_ms_per_token == {"bench": {"hybrid": 0.5}}
    assert any("benchmark JSON" in line for line in calibration.unfit)


def test_calibrating_an_empty_database_is_refused_in_one_line(
    sqlite_engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(flat_profile().model_dump_json())
    url = sqlite_engine.url.render_as_string(hide_password=False)
    status = main(["sim", "calibrate", "--database-url", url, "--profile", str(profile),
                   "--out", str(tmp_path / "cal.json")])  # fmt: skip
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specfleet sim: ") and "no drafted rounds" in err
    assert "\n" not in err


def test_a_bad_fleet_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.sim.conftest import make_calibration

    cal = tmp_path / "cal.json"
    cal.write_text(make_calibration().model_dump_json())
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[[devices]]\nname = "pi"\ncount = -3\n')
    workload = tmp_path / "workload.toml"
    workload.write_text("sessions_per_s = 1.0\n")
    status = main(["sim", "run", "--calibration", str(cal), "--fleet", str(fleet),
                   "--workload", str(workload), "--verifiers", "1"])  # fmt: skip
    assert status == 2
    assert capsys.readouterr().err.strip() == (
        "specfleet sim: fleet.toml: devices.0.count: Input should be greater than or equal to 1"
    )


def test_host_drafting_is_fitted_per_pass_as_a_plus_b_n() -> None:
    """Rows of one pass share its verify time; each row's draft time is its share. Passes of 1,
    2 and 4 rows of a head at 1 ms a step plus 0.5 a row per window token (windows of 2): a = 1,
    b = 0.5. A drafter seen at one batch size only is priced per row."""
    from sim.calibrate import RecordedRound, fit_host_drafting

    rounds = []
    for pass_ms, rows in ((50.0, 1), (60.0, 2), (70.0, 4)):
        share = (1.0 + 0.5 * rows) * 2 / rows
        for i in range(rows):
            rounds.append(
                RecordedRound(f"s{i}", 3, "cloud", "hybrid+eagle-h1", 2, 1, 2, share, pass_ms, rows)
            )
    for i in range(3):
        rounds.append(RecordedRound(f"l{i}", 5, "cloud", "lookup", 1, 0, 2, 0.2, 40.0 + i, 1))
    rounds.append(RecordedRound("d", 1, "distributed", "hybrid", 4, 2, 4, 2.0, 30.0, 1))
    terms = fit_host_drafting(rounds)
    assert terms["hybrid+eagle-h1"] == pytest.approx((1.0, 0.5))
    assert terms["lookup"] == pytest.approx((0.0, 0.1))
    assert "hybrid" not in terms  # drafted on a device


def test_acceptance_is_fitted_per_benchmark_prompt_and_pulled_toward_its_task() -> None:
    """Two chat prompts: the drafter's windows of 2 always held on one and never on the other.
    Each prompt's table follows its own rounds, pulled toward the task's rates (which pool
    both); a prompt with under PROMPT_MIN_ROUNDS rounds, or a session the JSON does not name,
    gets none."""
    from sim.calibrate import (
        PROMPT_MIN_ROUNDS,
        RecordedRound,
        RecordedSession,
        fit_acceptance,
        fit_prompt_acceptance,
    )

    sessions = [RecordedSession(f"s{i}", "chat", 40, 10, 10, True) for i in range(4)]
    rounds = []
    for i in range(40):
        rounds.append(RecordedRound("s0", i, "distributed", "hybrid", 2, 2, 2, 0.1))
        rounds.append(RecordedRound("s1", i, "distributed", "hybrid", 2, 0, 2, 0.1))
    rounds += [
        RecordedRound("s2", i, "distributed", "hybrid", 2, 2, 2, 0.1)
        for i in range(PROMPT_MIN_ROUNDS - 1)
    ]
    rounds += [RecordedRound("s3", i, "distributed", "hybrid", 2, 0, 2, 0.1) for i in range(20)]
    document = {
        "sessions": [
            {"session_id": "s0", "prompt_id": "chat-01"},
            {"session_id": "s1", "prompt_id": "chat-02"},
            {"session_id": "s2", "prompt_id": "chat-03"},
        ]
    }
    acceptance = fit_acceptance(sessions, rounds)
    task = acceptance["hybrid"]["chat"].accept[0]
    by_prompt = fit_prompt_acceptance(sessions, rounds, [document], acceptance)["hybrid"]
    assert set(by_prompt) == {"chat-01", "chat-02"}
    assert task < by_prompt["chat-01"].accept[0] < 1.0
    assert 0.0 < by_prompt["chat-02"].accept[0] < task
    assert by_prompt["chat-01"].accept[0] > 0.85 and by_prompt["chat-02"].accept[0] < 0.15
    assert by_prompt["chat-01"].rounds == 40


def _run(arm: str, sessions: int, coordinator_ms_per_token: float, **fields: Any) -> dict[str, Any]:
    return {"arm": arm, "sessions": sessions, "label": f"{arm} x{sessions}",
            "cpu_ms_per_token": {"coordinator": coordinator_ms_per_token}} | fields  # fmt: skip


def test_the_coordinators_time_per_streamed_round_comes_from_bench_e2es_cpu_by_process() -> None:
    """Its CPU over the adaptive arm's widest level of mostly streamed rounds, less its CPU per
    second with no round to serve (over plain serving's waves), per round; a document without
    such a run gives nothing, and the median of several is taken."""
    plain = _run("plain", 16, 0.2, tokens=1000, wall_s=10.0)
    adaptive = _run("adaptive", 16, 2.0, tokens=1000, rounds=1000, wall_s=11.0,
                    round_modes={"plain": 950, "cloud": 40, "distributed": 10})  # fmt: skip
    narrow = _run("adaptive", 4, 9.0, tokens=400, rounds=400, wall_s=4.0,
                  round_modes={"plain": 400})  # fmt: skip
    # 2,000 ms busy, less 20 ms a second over 11 s, over 1,000 rounds.
    assert fit_coordinator_round_ms([{"runs": [plain, narrow, adaptive]}]) == pytest.approx(1.78)
    devices = _run("adaptive", 32, 2.0, tokens=1000, rounds=1000, wall_s=9.0,
                   round_modes={"distributed": 900, "plain": 100})  # fmt: skip
    assert fit_coordinator_round_ms([{"runs": [devices]}]) is None
    assert fit_coordinator_round_ms([{"runs": [{"arm": "adaptive", "sessions": 16}]}]) is None
    alone = {"runs": [_run("adaptive", 16, 1.0, tokens=500, rounds=500, wall_s=5.0,
                           round_modes={"cloud": 500})]}  # fmt: skip
    assert fit_coordinator_round_ms([alone]) == pytest.approx(1.0)
    assert fit_coordinator_round_ms([alone, {"runs": [plain, adaptive]}, alone]) == 1.0
