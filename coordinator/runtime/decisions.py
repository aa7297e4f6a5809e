"""A decision of the adaptive policy: the candidates rated, the mode chosen with its
margins, and what goes on the round."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from broker import messages as m

MODE_SWITCH_MARGIN = 1.2  # the other mode must promise 20% more tokens/s before we switch


MODE_DWELL_ROUNDS = 3  # decisions a session stays in a mode before it may leave it again


# A drafter counts as cheap within this factor (plus a small absolute slack) of the cheapest.
CHEAP_DRAFT_FACTOR = 1.5


CHEAP_DRAFT_SLACK_MS = 0.1


class Candidate(NamedTuple):
    """One (mode, drafter, window) rated. Immutable; a NamedTuple rather than a frozen dataclass
    because a decision builds several, and a frozen dataclass took three times as long."""

    draft_model: str
    alpha: float
    draft_ms_per_token: float
    k: int
    expected_tokens: float
    round_ms: float
    tokens_per_s: float
    mode: m.Mode = m.Mode.DISTRIBUTED
    drafted: float = 0.0  # n(k): the tokens the drafter is expected to propose in a window of k
    # Distributed: the tokens the verifier's host streams lose to this window (policy module's
    # docstring); tokens_per_s is (expected_tokens - streams_lost) / round_ms.
    streams_lost: float = 0.0


def opening_candidate(decision: Decision) -> Candidate | None:
    """Where an adaptive session opens: what a decision with `opening` chose (the best candidate
    of all, the session having no mode to keep, or a host drafter to try) when it is a host
    mode, else None (it opens distributed and its device drafts)."""
    if decision.mode not in m.HOST_MODES:
        return None
    return next(
        c
        for c in decision.candidates
        if c.mode is decision.mode and c.draft_model == decision.draft_model
    )


def choose_draft(
    candidates: Sequence[Candidate],
    top: Candidate,
    current_draft: str,
    margin: float,
    opening: bool = False,
) -> tuple[Candidate, str]:
    """The drafter within the mode chosen, and why. A switch needs its own margin: the current
    drafter (first in distributed mode, and in cloud mode when the host has it) stays unless
    `top` promises `margin` times its tokens/s; at an opening, or when the current drafter is
    not a candidate, `top`."""
    current = next((c for c in candidates if c.draft_model == current_draft), None)
    if (
        current is not None
        and not opening
        and (
            top.draft_model == current.draft_model
            or top.tokens_per_s <= current.tokens_per_s * margin
        )
    ):
        return (
            current,
            f"keep {current.draft_model}: {current.tokens_per_s:.1f} tok/s predicted",
        )
    reason = f"switch to {top.draft_model}: {top.tokens_per_s:.1f} tok/s predicted"
    if current is not None:
        reason += f" over {current.tokens_per_s:.1f} with {current.draft_model}"
    return top, reason


def choose_mode(
    current: m.Mode, best: dict[m.Mode, Candidate], rounds_in_mode: int
) -> tuple[m.Mode, str]:
    """The mode of the next round, with hysteresis, and why.

    `best` holds each available mode's best candidate. The current mode stays unless it is no
    longer available, or another promises MODE_SWITCH_MARGIN times its tokens/s and the session
    has spent MODE_DWELL_ROUNDS decisions in it.
    """
    if not best:
        raise ValueError("no mode has a candidate")
    if current not in best:
        mode = max(best, key=lambda mode: best[mode].tokens_per_s)
        return mode, f"{current.value} unavailable, {mode.value}"
    here = best[current]
    other = max(
        (c for mode, c in best.items() if mode is not current),
        key=lambda c: c.tokens_per_s,
        default=None,
    )
    if other is None:
        return current, f"{current.value} (the only mode)"
    pays = other.tokens_per_s > here.tokens_per_s * MODE_SWITCH_MARGIN
    if pays and rounds_in_mode >= MODE_DWELL_ROUNDS:
        return other.mode, (
            f"{other.mode.value}: {other.tokens_per_s:.1f} tok/s predicted over "
            f"{here.tokens_per_s:.1f} in {current.value}"
        )
    if pays:
        return current, (
            f"{current.value} for {MODE_DWELL_ROUNDS - rounds_in_mode} more round(s) before "
            f"{other.mode.value} ({other.tokens_per_s:.1f} over {here.tokens_per_s:.1f} tok/s)"
        )
    return current, f"{current.value}"


def host_worth(
    best: dict[m.Mode, Candidate], plain: Candidate
) -> tuple[dict[m.Mode, Candidate], str]:
    """Each mode's best candidate as the modes are compared, cloud mode's worth at least `plain`
    decoding's tokens/s; and the note for the mode's reason where that floor counted ("" where
    nothing changes). An adaptive session's host stream has each pass's window chosen by its
    verifier, k = 0 among them, so where the host can draft plain mode offers nothing cloud mode
    lacks (the policy offers no plain mode then), and plain mode took the drafter away from the
    passes where a window pays (bench e2e at 16 sessions: with most streams plain, a window was
    priced for the whole padded pass and scored on the few rows that could draft). The drafter
    is still chosen on what its windows promise."""
    cloud = best.get(m.Mode.CLOUD)
    if cloud is None or cloud.tokens_per_s >= plain.tokens_per_s:
        return best, ""
    note = (
        f" (its windows promise {cloud.tokens_per_s:.1f} tok/s, plain passes "
        f"{plain.tokens_per_s:.1f}: the verifier runs a window only where one pays)"
    )
    return {**best, m.Mode.CLOUD: cloud._replace(tokens_per_s=plain.tokens_per_s)}, note


@dataclass(frozen=True)
class Decision:
    """One choice with everything it was made from, so replay can explain it."""

    mode: m.Mode
    draft_model: str
    k: int
    min_confidence: float | None
    # inputs
    device_id: str
    task_type: str
    current_draft: str
    current_mode: m.Mode
    rounds_in_mode: int
    rtt_ms: float
    queue_ms: float
    verifier_load: float
    verify_coefficients: tuple[float, ...]  # a, b, c, d, e of t_verify
    candidates: tuple[Candidate, ...]
    reason: str
    # The device limit that kept drafting off it (too hot, battery low, power saver), if any.
    device_limit: str | None = None
    # A drafter the device lacks, rated better than what it has: to be fetched for it.
    fetch: str | None = None
    # The host streams beside the session on its verifier, which a device window holds up.
    streams_beside: float = 0.0

    @property
    def policy(self) -> m.Policy:
        return m.Policy(
            mode=self.mode,
            draft_model=self.draft_model,
            k=self.k,
            min_confidence=self.min_confidence,
        )

    def to_json(self) -> dict[str, Any]:
        """The round's `policy` column: the Policy's fields, and under `decision` its inputs."""
        # Field by field rather than dataclasses.asdict, whose deep copies cost a millisecond a
        # round here, on the path of every verdict.
        inputs: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in m.Policy.model_fields
        }
        inputs["verify_coefficients"] = list(self.verify_coefficients)
        inputs["current_mode"] = self.current_mode.value
        inputs["candidates"] = [{**c._asdict(), "mode": c.mode.value} for c in self.candidates]
        return {**self.policy.model_dump(mode="json"), "decision": inputs}


def spare_the_device(distributed: list[Candidate], host: Sequence[Candidate]) -> list[Candidate]:
    """The distributed candidates left to a device past a limit: none where a host mode is on
    offer (the host drafts, or nobody does), else its cheapest drafters."""
    if host or not distributed:
        return []
    cheapest = min(c.draft_ms_per_token for c in distributed)
    bound = cheapest * CHEAP_DRAFT_FACTOR + CHEAP_DRAFT_SLACK_MS
    return [c for c in distributed if c.draft_ms_per_token <= bound]
