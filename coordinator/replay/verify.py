"""`replay --verify`: the target run again on the recorded drafts, every verdict compared."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coordinator.replay.rebuild import DETERMINISTIC_DRAFTERS, TokenDecoder, token_pieces
from coordinator.replay.records import RoundRecord, SessionRecord

if TYPE_CHECKING:
    from inference.runtime import Runtime
    from inference.sampling import SparseDraftProbs


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
