"""A session rebuilt round by round: its text, with where each token came from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from coordinator.replay.records import RoundRecord, SessionRecord, TokenKind

if TYPE_CHECKING:
    from inference.tokenizer import ChatTokenizer


# Drafters whose proposals are deterministic: their q' is one-hot, so nothing needs storing.
DETERMINISTIC_DRAFTERS = frozenset({"lookup", "ngram", "hybrid"})


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
