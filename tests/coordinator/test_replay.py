"""Replay from the database: rebuilding a session's text round by round, the terminal and JSON
streams, `specfleet replay`, and `--verify`, which re-runs the real target on recorded drafts."""

from __future__ import annotations

import functools
import io
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
from dashboard_rows import StoredSession, add_fleet, add_session, chat_tokenizer, recent
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from broker.messages import Mode
from coordinator import replay
from coordinator.db.engine import make_sessionmaker
from coordinator.db.models import DecodingSession, Round, SessionStatus, utcnow
from inference.artifacts import default_models_dir
from inference.drafters import make_proposer
from inference.onnx_runtime import OnnxRuntime
from inference.proposers import Candidates, Proposer
from inference.sampling import SamplingParams
from inference.speculative import decode_speculative
from modelbuild.target_build import load_target
from specfleet import cli

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def specfleet(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Run:
    """`specfleet ARGS...` in-process -> (exit status, stdout, stderr)."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("specfleet.commands",))

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            status = cli.main(list(argv))
        except SystemExit as exc:
            status = int(exc.code or 0)
        out, err = capsys.readouterr()
        return status, out, err

    return run


@pytest.fixture
def sessions(db_engine: Engine) -> sessionmaker[Session]:
    sessions = make_sessionmaker(db_engine)
    add_fleet(sessions, recent(5))
    return sessions


@pytest.fixture
def stored(sessions: sessionmaker[Session]) -> StoredSession:
    return add_session(sessions, created_at=recent(30))


def test_rebuild_gives_the_text_and_each_tokens_provenance(
    sessions: sessionmaker[Session], stored: StoredSession
) -> None:
    record = replay.load_session(sessions, stored.id)
    result = replay.rebuild(record, chat_tokenizer())
    assert result.problems == ()
    assert list(result.generated_ids) == stored.generated
    assert [t.kind.value for s in result.steps for t in s.tokens] == stored.kinds
    assert result.text == chat_tokenizer().decode(stored.generated)
    assert result.alpha == pytest.approx(stored.accepted / stored.drafted)
    # Round 2 is provisional: 3 drafted offline and accepted, then the target's correction.
    kinds = [t.kind for t in result.steps[2].tokens]
    assert kinds == [replay.TokenKind.PROVISIONAL] * 3 + [replay.TokenKind.CORRECTED]
    assert [t.token_id for t in result.steps[2].rejected] == list(record.rounds[2].draft_tokens[3:])


def test_without_a_tokenizer_tokens_show_as_ids(
    sessions: sessionmaker[Session], stored: StoredSession
) -> None:
    result = replay.rebuild(replay.load_session(sessions, stored.id), None)
    assert result.steps[0].tokens[0].text == f"⟨{stored.generated[0]}⟩"


def _edit_round(sessions: sessionmaker[Session], session_id: uuid.UUID, index: int) -> Round:
    with sessions() as db:
        row = db.scalar(
            sa.select(Round).where(Round.session_id == session_id, Round.round_index == index)
        )
        assert row is not None
        return row


def test_rebuild_reports_a_missing_round_and_a_wrong_base_len(
    sessions: sessionmaker[Session], stored: StoredSession
) -> None:
    with sessions.begin() as db:
        db.execute(sa.delete(Round).where(Round.session_id == stored.id, Round.round_index == 3))
    problems = replay.rebuild(replay.load_session(sessions, stored.id)).problems
    assert "round 3 is missing (next stored is 4)" in problems
    assert any(p.startswith("round 4: base_len") for p in problems)
    assert any("the rounds rebuild" in p for p in problems)


def test_the_session_stopping_on_an_accepted_draft_token_is_not_a_correction(
    sessions: sessionmaker[Session],
) -> None:
    """The coordinator stores the last kept token as next_token; when the output stopped on a
    drafted token (an accepted eos), that token is the draft's, not a correction."""
    stored = add_session(sessions, created_at=recent(20), pattern=((4, 2, False),))
    with sessions.begin() as db:
        last = db.scalar(
            sa.select(Round)
            .where(Round.session_id == stored.id)
            .order_by(Round.round_index.desc())
            .limit(1)
        )
        assert last is not None
        # As apply_stop_rules leaves it: the eos was drafted at position n_accepted.
        last.draft_tokens = [
            *last.draft_tokens[: last.n_accepted],
            last.next_token,
            *last.draft_tokens[last.n_accepted + 1 :],
        ]
    result = replay.rebuild(replay.load_session(sessions, stored.id))
    assert result.steps[-1].tokens[-1].kind is replay.TokenKind.ACCEPTED
    assert len(result.steps[-1].rejected) == result.steps[-1].round.k - len(result.steps[-1].tokens)


def test_terminal_replay_colours_tokens_and_keeps_the_recorded_pace(
    sessions: sessionmaker[Session], stored: StoredSession
) -> None:
    result = replay.rebuild(replay.load_session(sessions, stored.id), chat_tokenizer())
    waits: list[float] = []
    out = io.StringIO()
    replay.play_terminal(result, out, speed=2.0, color=True, sleep=waits.append)
    text = out.getvalue()
    for kind in ("accepted", "corrected", "provisional"):
        style = replay.ANSI[replay.TokenKind(kind)]
        assert style in text
    assert "legend:" in text
    # Rounds were recorded 60 ms apart (the first 60 ms after the session began): at 2x, 30 ms.
    assert waits == pytest.approx([0.03] * stored.rounds)

    plain = io.StringIO()
    replay.play_terminal(result, plain, speed=0, color=False, sleep=waits.append)
    assert "\x1b[" not in plain.getvalue()
    assert result.text in plain.getvalue()
    assert f"{len(stored.generated)} tokens in {stored.rounds} rounds" in plain.getvalue()
    assert len(waits) == stored.rounds  # speed 0 never waits


def test_long_gaps_are_capped_in_replay(
    sessions: sessionmaker[Session], stored: StoredSession
) -> None:
    with sessions.begin() as db:
        row = db.scalar(
            sa.select(Round).where(Round.session_id == stored.id, Round.round_index == 2)
        )
        assert row is not None
        row.created_at = row.created_at + timedelta(minutes=5)
        later = db.scalars(
            sa.select(Round).where(Round.session_id == stored.id, Round.round_index > 2)
        )
        for other in later:
            other.created_at = other.created_at + timedelta(minutes=5)
    result = replay.rebuild(replay.load_session(sessions, stored.id))
    delays = replay.round_delays(result.steps, result.session.created_at)
    assert delays[2] == replay.MAX_REPLAY_GAP_S
    assert delays[3] == pytest.approx(0.06)


def test_json_lines_one_object_per_round(
    sessions: sessionmaker[Session], stored: StoredSession
) -> None:
    result = replay.rebuild(replay.load_session(sessions, stored.id), chat_tokenizer())
    lines = [json.loads(line) for line in replay.json_lines(result)]
    assert [line["round"] for line in lines] == list(range(stored.rounds))
    assert [t for line in lines for t in line["tokens"]] == stored.generated
    assert [k for line in lines for k in line["kinds"]] == stored.kinds
    assert lines[0]["legs_ms"]["verify"] == 12.0
    assert lines[2]["provisional"] is True
    assert "".join(line["text"] for line in lines) == result.text


def _db_args(db_engine: Engine) -> tuple[str, str]:
    return ("--database-url", db_engine.url.render_as_string(hide_password=False))


def test_replay_command_streams_text_json_and_finds_sessions_by_prefix(
    specfleet: Run, db_engine: Engine, stored: StoredSession
) -> None:
    db = _db_args(db_engine)
    status, out, _ = specfleet("replay", str(stored.id), "--speed", "0", *db)
    assert status == 0
    assert chat_tokenizer().decode(stored.generated) in out
    assert "\x1b[" not in out  # not a terminal: no colour unless asked

    status, out, _ = specfleet("replay", str(stored.id)[:8], "--json", *db)
    assert status == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == stored.rounds

    status, out, _ = specfleet("replay", str(stored.id), "--speed", "0", "--color", "always", *db)
    assert replay.ANSI[replay.TokenKind.CORRECTED] in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("nonsense!",), "is not a session id"),
        (("00000000",), "no session id starts with '00000000'"),
        ((str(uuid.UUID(int=1)),), "no session 00000000-0000-0000-0000-000000000001"),
        (("abcd", "--speed", "-1"), "--speed -1.0: must be 0 or more"),
    ],
)
def test_replay_command_refuses_bad_input_in_one_line(
    specfleet: Run, db_engine: Engine, args: tuple[str, ...], message: str
) -> None:
    status, _, err = specfleet("replay", *args, *_db_args(db_engine))
    assert status == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1


# --- --verify on sessions decoded by the real target --------------------------------------------


@functools.cache
def _target() -> OnnxRuntime:
    target, _ = load_target(default_models_dir())
    return target


@dataclass
class _Recorder:
    """A drafter that remembers what it proposed, so rounds can be stored as the bus stores them."""

    inner: Proposer
    last: Candidates | None = None

    @property
    def name(self) -> str:
        return self.inner.name

    def get_candidates(
        self, context_ids: list[int], k: int, rng: np.random.Generator | None = None
    ) -> Candidates:
        self.last = self.inner.get_candidates(context_ids, k, rng)
        return self.last

    def update_candidate_strategy(self, n_accepted: int) -> None:
        self.inner.update_candidate_strategy(n_accepted)

    def rollback(self, committed_len: int) -> None:
        self.inner.rollback(committed_len)


PROMPT = "Repeat exactly, twice: the quick brown fox jumps over the lazy dog."


def record_session(
    sessions: sessionmaker[Session],
    drafter: str,
    *,
    temperature: float,
    seed: int = 11,
    max_tokens: int = 40,
    store_q: bool = True,
) -> uuid.UUID:
    """Decode with the real target and a real drafter; store the rounds as the coordinator does
    (the last kept token as next_token, q' as the draft sent it)."""
    tokenizer = chat_tokenizer()
    prompt_ids = tokenizer.apply_chat_template(PROMPT)
    recorder = _Recorder(make_proposer(drafter, default_models_dir(), temperature=temperature))
    rows: list[Round] = []
    session_id = uuid.uuid4()
    committed_len = len(prompt_ids)

    def on_tokens(kept: list[int]) -> None:
        nonlocal committed_len
        candidates, recorder.last = recorder.last, None
        draft = [] if candidates is None else candidates.tokens.tolist()
        q = None if candidates is None or not store_q else candidates.q
        rows.append(
            Round(
                session_id=session_id,
                round_index=len(rows),
                base_len=committed_len,
                draft_tokens=draft,
                draft_model=drafter,
                k=len(draft),
                n_accepted=len(kept) - 1,
                next_token=kept[-1],
                committed_len=committed_len + len(kept),
                q_ids=None if q is None else q.ids.tolist(),
                q_probs=None if q is None else q.probs.tolist(),
                created_at=utcnow(),
            )
        )
        committed_len += len(kept)

    params = SamplingParams(temperature=temperature, seed=seed)
    result = decode_speculative(
        _target(), recorder, prompt_ids, 4, max_tokens, params, tokenizer.eos_id, on_tokens
    )
    with sessions.begin() as db:
        db.add(
            DecodingSession(
                id=session_id,
                device_id="pi-1",
                task_type="chat",
                prompt=PROMPT,
                prompt_ids=prompt_ids,
                temperature=temperature,
                top_p=1.0,
                seed=seed,
                max_tokens=max_tokens,
                mode=Mode.DISTRIBUTED,
                draft_model=drafter,
                k=4,
                status=SessionStatus.FINISHED,
                committed_ids=result.tokens,
                committed_len=len(prompt_ids) + len(result.tokens),
                finished_at=utcnow(),
            )
        )
        db.flush()
        db.add_all(rows)
    return session_id


@pytest.fixture
def pg_sessions(pg_clean_engine: Engine) -> Iterator[sessionmaker[Session]]:
    sessions = make_sessionmaker(pg_clean_engine)
    add_fleet(sessions, recent(5))
    yield sessions


@pytest.mark.parametrize(
    ("drafter", "temperature"),
    [("hybrid", 0.0), ("lookup", 0.9), ("draft-l1", 0.9)],
)
def test_verify_reproduces_every_verdict(
    pg_sessions: sessionmaker[Session], drafter: str, temperature: float
) -> None:
    session_id = record_session(pg_sessions, drafter, temperature=temperature)
    record = replay.load_session(pg_sessions, session_id)
    assert replay.rebuild(record).problems == ()
    drafted = [r for r in record.rounds if r.k > 0]
    assert drafted
    if drafter == "draft-l1":
        # Its rejections resample from norm(max(0, p - q')): reproducing them needs the stored q'.
        assert all(r.q_ids is not None and len(r.q_ids) == r.k for r in drafted)
    else:
        assert sum(r.n_accepted for r in drafted) > 0
    report = replay.verify_session(record, _target(), decoder=chat_tokenizer())
    assert report.mismatches == []
    assert report.ok and report.verified == len(record.rounds)


def test_verify_names_the_round_whose_verdict_was_altered(
    pg_sessions: sessionmaker[Session],
) -> None:
    session_id = record_session(pg_sessions, "hybrid", temperature=0.0)
    record = replay.load_session(pg_sessions, session_id)
    # The last round: a changed token earlier would also change what every later round saw.
    index = record.rounds[-1].index
    with pg_sessions.begin() as db:
        row = db.scalar(
            sa.select(Round).where(Round.session_id == session_id, Round.round_index == index)
        )
        assert row is not None
        stored_token = row.next_token
        row.next_token = chat_tokenizer().encode(" banana")[0]
    report = replay.verify_session(
        replay.load_session(pg_sessions, session_id), _target(), decoder=chat_tokenizer()
    )
    (mismatch,) = report.mismatches
    assert mismatch.round_index == index
    assert mismatch.what == "verdict"
    assert f"round {index} " in mismatch.detail
    assert "' banana'" in mismatch.detail
    assert f"the target gives n_accepted {row.n_accepted}, next_token {stored_token} " in (
        mismatch.detail
    )
    assert report.verified == len(record.rounds) - 1


def test_a_sampled_neural_draft_without_its_q_is_unverifiable(
    pg_sessions: sessionmaker[Session],
) -> None:
    session_id = record_session(
        pg_sessions, "draft-l1", temperature=0.9, max_tokens=12, store_q=False
    )
    record = replay.load_session(pg_sessions, session_id)
    report = replay.verify_session(record, _target())
    drafted = [r for r in record.rounds if r.k > 0]
    assert [m.what for m in report.mismatches] == ["unverifiable"] * len(drafted)
    assert report.verified == len(record.rounds) - len(drafted)
    assert not report.ok


def test_replay_verify_command(
    specfleet: Run, pg_clean_engine: Engine, pg_sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    session_id = record_session(pg_sessions, "hybrid", temperature=0.0)
    db = _db_args(pg_clean_engine)
    # Each run loads the target afresh, as an operator's would: two runs keep the test short.
    status, out, _ = specfleet("replay", str(session_id), "--verify", "--json", *db)
    assert status == 0, out
    report = json.loads(out)
    assert (report["ok"], report["mismatches"]) == (True, [])
    assert report["verified"] == report["rounds"] > 0

    record = replay.load_session(pg_sessions, session_id)
    index = next(r.index for r in record.rounds if r.n_accepted < r.k)
    with pg_sessions.begin() as db_session:
        db_session.execute(
            sa.update(Round)
            .where(Round.session_id == session_id, Round.round_index == index)
            .values(n_accepted=Round.n_accepted + 1)
        )
    status, out, _ = specfleet("replay", str(session_id), "--verify", *db)
    assert status == 1
    assert out.startswith(f"MISMATCH round {index} ")
    assert "NOT reproduced" in out
