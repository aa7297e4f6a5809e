"""Sessions rebuilt round by round from the database: text with token provenance, terminal and
JSON replay, and `--verify`, which re-runs the target on the recorded drafts."""

from __future__ import annotations

import enum
import json
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from coordinator.db.models import DecodingSession, Round, SessionMode, SessionStatus
from coordinator.runtime.metrics import RoundLegs

if TYPE_CHECKING:
    from inference.runtime import Runtime
    from inference.sampling import SparseDraftProbs
    from inference.tokenizer import ChatTokenizer

# A long gap between two rounds (a device offline for a minute) is replayed this long at most.
MAX_REPLAY_GAP_S = 3.0
# Drafters whose proposals are deterministic: their q' is one-hot, so nothing needs storing.
DETERMINISTIC_DRAFTERS = frozenset({"lookup", "ngram", "hybrid"})


class TokenKind(str, enum.Enum):
    """Where a committed token came from."""

    ACCEPTED = "accepted"  # drafted, and accepted by the target
    CORRECTED = "corrected"  # the target's token in place of a rejected draft token
    TARGET = "target"  # the target's bonus token after a fully accepted draft, or a plain step
    PROVISIONAL = "provisional"  # drafted offline, shown before the target saw it, then accepted


class ReplayError(Exception):
    """A session that cannot be replayed; the message says why."""


class SessionNotFoundError(ReplayError, LookupError):
    def __init__(self, session_id: uuid.UUID) -> None:
        super().__init__(f"no session {session_id}")
        self.session_id = session_id


@dataclass(frozen=True)
class RoundRecord:
    """One stored round, detached from the ORM."""

    index: int
    base_len: int
    draft_tokens: tuple[int, ...]  # [k]
    draft_model: str | None
    k: int
    n_accepted: int
    next_token: int
    committed_len: int
    provisional: bool
    mode: SessionMode  # who drafted: the device, or the verifier host (cloud)
    q_ids: tuple[tuple[int, ...], ...] | None  # [k, K]
    q_probs: tuple[tuple[float, ...], ...] | None  # [k, K]
    verifier_id: str | None
    policy: dict[str, Any] | None
    legs: RoundLegs
    created_at: datetime

    @classmethod
    def from_row(cls, row: Round) -> RoundRecord:
        return cls(
            index=row.round_index,
            base_len=row.base_len,
            draft_tokens=tuple(row.draft_tokens),
            draft_model=row.draft_model,
            k=row.k,
            n_accepted=row.n_accepted,
            next_token=row.next_token,
            committed_len=row.committed_len,
            provisional=row.provisional,
            mode=row.mode,
            q_ids=None if row.q_ids is None else tuple(tuple(r) for r in row.q_ids),
            q_probs=None if row.q_probs is None else tuple(tuple(r) for r in row.q_probs),
            verifier_id=row.verifier_id,
            policy=row.policy,
            legs=RoundLegs(
                draft_ms=row.t_draft_ms,
                uplink_ms=row.t_uplink_ms,
                queue_ms=row.t_queue_ms,
                verify_ms=row.t_verify_ms,
                downlink_ms=row.t_downlink_ms,
            ),
            created_at=row.created_at,
        )

    @property
    def committed_tokens(self) -> tuple[int, ...]:
        """What this round committed: the accepted prefix and the target's token, cut where the
        session stopped (an accepted eos, or max_tokens)."""
        tokens = (*self.draft_tokens[: self.n_accepted], self.next_token)
        return tokens[: max(0, self.committed_len - self.base_len)]

    @property
    def rejected_tokens(self) -> tuple[int, ...]:
        """Drafted and not kept: rejected, or past the point where the session stopped."""
        return self.draft_tokens[self.n_accepted + (1 if self.last_is_drafted else 0) :]

    @property
    def last_is_drafted(self) -> bool:
        """The round's last token is the draft's own: the session stopped on it (an accepted eos,
        or max_tokens), so the coordinator stored it as `next_token`. A target's correction is
        never the token it rejected, since p_prime is 0 there."""
        return self.n_accepted < self.k and self.next_token == self.draft_tokens[self.n_accepted]

    @property
    def kinds(self) -> tuple[TokenKind, ...]:
        drafted = TokenKind.PROVISIONAL if self.provisional else TokenKind.ACCEPTED
        if self.last_is_drafted:
            own = drafted
        else:
            own = TokenKind.CORRECTED if self.n_accepted < self.k else TokenKind.TARGET
        kinds = (*([drafted] * self.n_accepted), own)
        return kinds[: len(self.committed_tokens)]

    @property
    def total_ms(self) -> float | None:
        measured = [ms for _, ms in self.legs.items()]
        return sum(measured) if measured else None


@dataclass(frozen=True)
class SessionRecord:
    """One stored session and its rounds in order, detached from the ORM."""

    id: uuid.UUID
    device_id: str
    task_type: str
    prompt: str
    prompt_ids: tuple[int, ...]
    temperature: float
    top_p: float
    seed: int
    max_tokens: int
    mode: SessionMode
    draft_model: str | None
    k: int
    status: SessionStatus
    committed_ids: tuple[int, ...]  # the generated tokens (the prompt excluded)
    committed_len: int  # prompt plus generated
    created_at: datetime
    finished_at: datetime | None
    rounds: tuple[RoundRecord, ...]

    @classmethod
    def from_rows(cls, row: DecodingSession, rounds: Sequence[Round]) -> SessionRecord:
        return cls(
            id=row.id,
            device_id=row.device_id,
            task_type=row.task_type,
            prompt=row.prompt,
            prompt_ids=tuple(row.prompt_ids),
            temperature=row.temperature,
            top_p=row.top_p,
            seed=row.seed,
            max_tokens=row.max_tokens,
            mode=row.mode,
            draft_model=row.draft_model,
            k=row.k,
            status=row.status,
            committed_ids=tuple(row.committed_ids),
            committed_len=row.committed_len,
            created_at=row.created_at,
            finished_at=row.finished_at,
            rounds=tuple(RoundRecord.from_row(r) for r in rounds),
        )


def load_session(sessions: sessionmaker[Session], session_id: uuid.UUID) -> SessionRecord:
    with sessions() as db:
        row = db.get(DecodingSession, session_id)
        if row is None:
            raise SessionNotFoundError(session_id)
        rounds = db.scalars(
            sa.select(Round).where(Round.session_id == session_id).order_by(Round.round_index)
        ).all()
        return SessionRecord.from_rows(row, rounds)


def find_session(sessions: sessionmaker[Session], prefix: str) -> uuid.UUID:
    """A session id from its full text or a unique prefix of it (as operators copy them)."""
    text = prefix.strip().lower()
    try:
        return uuid.UUID(text)
    except ValueError:
        pass
    if not 4 <= len(text) <= 36 or any(c not in "0123456789abcdef-" for c in text):
        raise ReplayError(f"{prefix!r} is not a session id (a UUID, or 4+ of its first digits)")
    with sessions() as db:
        ids = [
            session_id
            for session_id in db.scalars(sa.select(DecodingSession.id))
            if str(session_id).startswith(text)
        ]
    if not ids:
        raise ReplayError(f"no session id starts with {text!r}")
    if len(ids) > 1:
        raise ReplayError(f"{len(ids)} sessions start with {text!r}; give more of the id")
    return ids[0]


# --- token text and provenance -------------------------------------------------------------------


class TokenDecoder(Protocol):
    """The target's tokenizer, as far as replay needs it (ChatTokenizer is one)."""

    def detokenizer(self, prefix_ids: Sequence[int] = ()) -> _Detokenizer: ...


class _Detokenizer(Protocol):
    def push(self, ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


def target_tokenizer(models_dir: Path, target: str | None = None) -> ChatTokenizer | None:
    """The tokenizer of the target named `target` in `models_dir` (None: the first target
    there), or None when there is no such target."""
    from inference.artifacts import ArtifactError, list_models
    from inference.tokenizer import ChatTokenizer

    try:
        targets = [d for d, m in list_models(models_dir) if m.role == "target"]
    except ArtifactError:
        return None
    if target is not None:
        targets = [d for d in targets if d.name == target]
    return ChatTokenizer.load(targets[0]) if targets else None


def token_pieces(
    decoder: TokenDecoder | None, prefix_ids: Sequence[int], tokens: Sequence[int]
) -> list[str]:
    """The text each token adds after `prefix_ids`; a piece is "" while a character is split
    across tokens, and the whole character comes with the token that completes it."""
    if decoder is None:
        return [f"⟨{t}⟩" for t in tokens]
    # A few tokens of context are enough for the leading-space rules of byte-level BPE.
    detok = decoder.detokenizer(list(prefix_ids[-4:]))
    pieces = [detok.push([t]) for t in tokens]
    if pieces:
        pieces[-1] += detok.flush()
    return pieces


@dataclass(frozen=True)
class ReplayToken:
    token_id: int
    kind: TokenKind
    text: str


@dataclass(frozen=True)
class ReplayStep:
    """One round as replay shows it."""

    round: RoundRecord
    tokens: tuple[ReplayToken, ...]  # what the round committed
    rejected: tuple[ReplayToken, ...]  # drafted and thrown away (kind: what they would have been)
    committed_len: int  # after the round


@dataclass(frozen=True)
class Rebuild:
    """A session put back together from its rounds alone."""

    session: SessionRecord
    steps: tuple[ReplayStep, ...]
    generated_ids: tuple[int, ...]
    problems: tuple[str, ...]  # gaps, overlaps, or disagreement with the stored committed_ids

    @property
    def text(self) -> str:
        return "".join(t.text for step in self.steps for t in step.tokens)

    @property
    def n_drafted(self) -> int:
        return sum(step.round.k for step in self.steps)

    @property
    def n_accepted(self) -> int:
        return sum(step.round.n_accepted for step in self.steps)

    @property
    def alpha(self) -> float | None:
        """Accepted / drafted tokens over the session; None when nothing was drafted."""
        return self.n_accepted / self.n_drafted if self.n_drafted else None

    @property
    def duration_s(self) -> float | None:
        if not self.steps:
            return None
        end = self.session.finished_at or self.steps[-1].round.created_at
        return max(0.0, (end - self.session.created_at).total_seconds())

    @property
    def tokens_per_s(self) -> float | None:
        duration = self.duration_s
        return len(self.generated_ids) / duration if duration else None


def rebuild(record: SessionRecord, decoder: TokenDecoder | None = None) -> Rebuild:
    """Concatenate the rounds' verdicts and check them against the stored committed tokens."""
    problems: list[str] = []
    committed = list(record.prompt_ids)
    steps: list[ReplayStep] = []
    expected_index = 0
    for rnd in record.rounds:
        if rnd.index != expected_index:
            problems.append(f"round {expected_index} is missing (next stored is {rnd.index})")
        expected_index = rnd.index + 1
        if rnd.base_len != len(committed):
            problems.append(
                f"round {rnd.index}: base_len {rnd.base_len}, but {len(committed)} tokens were "
                "committed before it"
            )
        if not 0 <= rnd.n_accepted <= rnd.k or rnd.k != len(rnd.draft_tokens):
            problems.append(
                f"round {rnd.index}: n_accepted {rnd.n_accepted} and k {rnd.k} do not fit "
                f"{len(rnd.draft_tokens)} drafted tokens"
            )
        tokens = rnd.committed_tokens
        if rnd.committed_len != rnd.base_len + len(tokens):
            problems.append(
                f"round {rnd.index}: committed_len {rnd.committed_len} is not base_len "
                f"{rnd.base_len} plus what it accepted"
            )
        pieces = token_pieces(decoder, committed, tokens)
        rejected_pieces = token_pieces(
            decoder,
            [*committed, *rnd.draft_tokens[: rnd.k - len(rnd.rejected_tokens)]],
            rnd.rejected_tokens,
        )
        drafted_kind = TokenKind.PROVISIONAL if rnd.provisional else TokenKind.ACCEPTED
        committed += tokens
        steps.append(
            ReplayStep(
                round=rnd,
                tokens=tuple(
                    ReplayToken(t, kind, text)
                    for t, kind, text in zip(tokens, rnd.kinds, pieces, strict=True)
                ),
                rejected=tuple(
                    ReplayToken(t, drafted_kind, text)
                    for t, text in zip(rnd.rejected_tokens, rejected_pieces, strict=True)
                ),
                committed_len=len(committed),
            )
        )
    generated = committed[len(record.prompt_ids) :]
    stored = record.committed_ids
    if tuple(generated) != stored:
        first = next(
            (i for i, (a, b) in enumerate(zip(generated, stored, strict=False)) if a != b),
            min(len(generated), len(stored)),
        )
        problems.append(
            f"the rounds rebuild {len(generated)} generated tokens, the session stores "
            f"{len(stored)}; they first differ at position {first}"
        )
    if record.committed_len != len(record.prompt_ids) + len(stored):
        problems.append(
            f"committed_len {record.committed_len} != prompt {len(record.prompt_ids)} + "
            f"{len(stored)} stored tokens"
        )
    return Rebuild(
        session=record,
        steps=tuple(steps),
        generated_ids=tuple(generated),
        problems=tuple(problems),
    )


# --- terminal and JSON replay --------------------------------------------------------------------

ANSI = {
    TokenKind.ACCEPTED: "\x1b[32m",  # green
    TokenKind.CORRECTED: "\x1b[1;33m",  # bold yellow
    TokenKind.TARGET: "",
    TokenKind.PROVISIONAL: "\x1b[4;36m",  # underlined cyan
}
ANSI_REJECTED = "\x1b[9;2;31m"  # struck-through dim red
ANSI_DIM = "\x1b[2m"
ANSI_RESET = "\x1b[0m"


def round_delays(steps: Sequence[ReplayStep], session_start: datetime) -> list[float]:
    """Seconds to wait before showing each round: the recorded gap since the previous one (the
    sum of its legs where the clock says nothing), never more than MAX_REPLAY_GAP_S."""
    delays = []
    previous = session_start
    for step in steps:
        gap = (step.round.created_at - previous).total_seconds()
        if gap <= 0.0:
            gap = (step.round.total_ms or 0.0) / 1e3
        delays.append(min(max(gap, 0.0), MAX_REPLAY_GAP_S))
        previous = step.round.created_at
    return delays


def _colored(token: ReplayToken, color: bool, rejected: bool = False) -> str:
    if not color or not token.text:
        return token.text
    style = ANSI_REJECTED if rejected else ANSI[token.kind]
    return f"{style}{token.text}{ANSI_RESET}" if style else token.text


def play_terminal(
    result: Rebuild,
    out: TextIO,
    *,
    speed: float = 1.0,
    color: bool = True,
    show_rejected: bool = False,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Re-stream the text with its recorded timing (divided by `speed`; 0 means no waiting)."""
    session = result.session
    dim = ANSI_DIM if color else ""
    reset = ANSI_RESET if color else ""
    out.write(
        f"{dim}session {session.id}  device {session.device_id}  task {session.task_type}  "
        f"mode {session.mode.value}  status {session.status.value}{reset}\n"
    )
    out.write(f"{dim}prompt: {session.prompt}{reset}\n\n")
    out.flush()
    delays = round_delays(result.steps, session.created_at)
    for step, delay in zip(result.steps, delays, strict=True):
        if speed > 0 and delay > 0:
            sleep(delay / speed)
        if show_rejected and step.rejected:
            out.write("".join(_colored(t, color, rejected=True) for t in step.rejected))
        out.write("".join(_colored(t, color) for t in step.tokens))
        out.flush()
    out.write("\n\n")
    out.write(summary_line(result, color=color) + "\n")
    if color:
        legend = "  ".join(
            f"{ANSI[kind]}{kind.value}{ANSI_RESET}" for kind in TokenKind if ANSI[kind]
        )
        out.write(f"{dim}legend:{reset} {legend}\n")
    for problem in result.problems:
        out.write(f"problem: {problem}\n")
    out.flush()


def summary_line(result: Rebuild, *, color: bool = False) -> str:
    alpha = f"{result.alpha:.2f}" if result.alpha is not None else "-"
    rate = f"{result.tokens_per_s:.1f}" if result.tokens_per_s is not None else "-"
    counts = {kind: 0 for kind in TokenKind}
    for step in result.steps:
        for token in step.tokens:
            counts[token.kind] += 1
    parts = ", ".join(f"{n} {kind.value}" for kind, n in counts.items() if n)
    text = (
        f"{len(result.generated_ids)} tokens in {len(result.steps)} rounds ({parts}); "
        f"alpha {alpha}; {rate} tokens/s"
    )
    return f"{ANSI_DIM}{text}{ANSI_RESET}" if color else text


def round_document(step: ReplayStep) -> dict[str, Any]:
    """One round as a JSON object (the `--json` line and the API's replay frames)."""
    rnd = step.round
    return {
        "round": rnd.index,
        "base_len": rnd.base_len,
        "committed_len": rnd.committed_len,
        "draft_model": rnd.draft_model,
        "k": rnd.k,
        "draft_tokens": list(rnd.draft_tokens),
        "n_accepted": rnd.n_accepted,
        "next_token": rnd.next_token,
        "provisional": rnd.provisional,
        "mode": rnd.mode.value,
        "tokens": [t.token_id for t in step.tokens],
        "kinds": [t.kind.value for t in step.tokens],
        "text": "".join(t.text for t in step.tokens),
        "rejected_text": "".join(t.text for t in step.rejected),
        "legs_ms": dict(rnd.legs.items()),
        "verifier_id": rnd.verifier_id,
        "policy": rnd.policy,
        "at": rnd.created_at.isoformat(),
    }


def json_lines(result: Rebuild) -> Iterator[str]:
    for step in result.steps:
        yield json.dumps(round_document(step), ensure_ascii=False, sort_keys=True)


# --- verification --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """A stored verdict the target does not reproduce (or a round that could not be checked)."""

    round_index: int
    what: str  # "verdict", "base_len", "malformed" or "unverifiable"
    detail: str


@dataclass
class VerifyReport:
    session_id: uuid.UUID
    rounds: int = 0
    verified: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.rounds == self.verified and not self.mismatches


def _describe(token: int, decoder: TokenDecoder | None) -> str:
    if decoder is None:
        return str(token)
    return f"{token} {token_pieces(decoder, [], [token])[0]!r}"


def _stored_q(rnd: RoundRecord) -> SparseDraftProbs | None:
    """q' as the draft sent it, with rows padded to one width by probability 0."""
    import numpy as np

    from inference.sampling import SparseDraftProbs

    if rnd.q_ids is None or rnd.q_probs is None:
        return None
    width = max(len(row) for row in rnd.q_ids) if rnd.q_ids else 1
    ids = np.zeros((len(rnd.q_ids), width), dtype=np.int64)
    probs = np.zeros((len(rnd.q_ids), width), dtype=np.float64)
    for i, (row_ids, row_probs) in enumerate(zip(rnd.q_ids, rnd.q_probs, strict=True)):
        ids[i, : len(row_ids)] = row_ids
        ids[i, len(row_ids) :] = row_ids[0]  # padding as the verifier pads: probability 0
        probs[i, : len(row_probs)] = row_probs
    return SparseDraftProbs(ids=ids, probs=probs)


def verify_session(
    record: SessionRecord,
    target: Runtime,
    *,
    decoder: TokenDecoder | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
) -> VerifyReport:
    """Re-run the target on every recorded draft and compare with the stored verdicts.

    The verifier's semantics: the target's cache holds the committed tokens but the last; one
    forward pass over [last committed token] + draft gives k+1 rows of logits, and rejection
    sampling with the round's own random stream, round_rng(seed, round, VERIFY), gives the
    verdict. The replay follows the stored path (the cache is trimmed to what was committed),
    so each round is judged in the context the session really had: a verifier that once
    decided differently shows up as that one round. A token rewritten in the database after
    the fact also changes what every later round is judged against.
    """
    from inference.sampling import RngStream, SamplingParams, rejection_sample, round_rng

    params = SamplingParams(temperature=record.temperature, top_p=record.top_p, seed=record.seed)
    report = VerifyReport(session_id=record.id, rounds=len(record.rounds))
    committed = list(record.prompt_ids)
    cache = target.new_cache()
    if len(committed) > 1:
        target.forward(committed[:-1], cache)
    for rnd in record.rounds:
        if on_round is not None:
            on_round(rnd)
        if rnd.base_len != len(committed):
            report.mismatches.append(
                Mismatch(
                    rnd.index,
                    "base_len",
                    f"round {rnd.index}: base_len {rnd.base_len}, but the rounds before it "
                    f"commit {len(committed)} tokens; verification stops here",
                )
            )
            break
        if not 0 <= rnd.n_accepted <= rnd.k or rnd.k != len(rnd.draft_tokens):
            report.mismatches.append(
                Mismatch(
                    rnd.index,
                    "malformed",
                    f"round {rnd.index}: n_accepted {rnd.n_accepted} and k {rnd.k} do not fit "
                    f"{len(rnd.draft_tokens)} drafted tokens; verification stops here",
                )
            )
            break
        q = _stored_q(rnd)
        deterministic = (rnd.draft_model or "") in DETERMINISTIC_DRAFTERS
        if not params.greedy and rnd.k > 0 and q is None and not deterministic:
            report.mismatches.append(
                Mismatch(
                    rnd.index,
                    "unverifiable",
                    f"round {rnd.index}: a sampled draft from {rnd.draft_model!r} without its "
                    "q' stored cannot be re-verified",
                )
            )
            # Keep the cache on the stored path: it must hold what this round committed.
            target.forward([committed[-1], *rnd.draft_tokens[: rnd.n_accepted]], cache)
        else:
            logits = target.forward([committed[-1], *rnd.draft_tokens], cache)
            verdict = rejection_sample(
                list(rnd.draft_tokens),
                q,
                logits,
                params,
                round_rng(record.seed, rnd.index, RngStream.VERIFY),
            )
            reproduced = (*rnd.draft_tokens[: verdict.n_accepted], verdict.next_token)
            stored = rnd.committed_tokens
            # The coordinator cuts the last round where the output stops (eos, max_tokens):
            # there the stored tokens are a prefix of the verdict.
            final = rnd is record.rounds[-1]
            if stored == reproduced or (
                final and 0 < len(stored) < len(reproduced) and reproduced[: len(stored)] == stored
            ):
                report.verified += 1
            else:
                report.mismatches.append(
                    Mismatch(
                        rnd.index,
                        "verdict",
                        f"round {rnd.index} (base_len {rnd.base_len}, k {rnd.k}): stored "
                        f"n_accepted {rnd.n_accepted}, next_token "
                        f"{_describe(rnd.next_token, decoder)}; the target gives n_accepted "
                        f"{verdict.n_accepted}, next_token "
                        f"{_describe(verdict.next_token, decoder)}",
                    )
                )
            cache.trim(rnd.base_len + rnd.n_accepted)
        committed += rnd.committed_tokens
    return report
