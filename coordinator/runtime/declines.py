"""Host drafters whose windows a lone stream's verifier keeps running plainly.

The policy rates a host drafter on its acceptance by (device, drafter, task), learned from the
rounds it drafted; a round the verifier ran at k = 0 teaches it nothing (a plain round drafted
nothing, by choice). Alone on its verifier a window costs a pass almost nothing, so a stream whose
verifier runs it plainly round after round has a drafter that fails this prompt (its own record
there outweighs the task's), while the coordinator goes on predicting the task's rate: bench e2e
kept a lone session on `hybrid+draft-l1` at k = 0 for 40 rounds, "28.7 tok/s predicted". After
DECLINED_ROUNDS such rounds in a row, the drafter is rated for that session at what it made,
plain decoding's tokens/s, and another host drafter that promises more is chosen. Beside other
rows a plain pass says nothing of the drafter (a window there pays only where it holds for the
whole batch), so only a lone stream's rounds count.

Pure, like the policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from broker import messages as m
from coordinator.runtime.decisions import Candidate
from coordinator.runtime.observations import RoundObservation

DECLINED_ROUNDS = 8  # a stream's decision period (policy.STREAM_DECISION_EVERY)
LONE_LOAD = 0.5  # streams beside on its verifier below which a stream counts as alone


@dataclass
class Declines:
    """Per session in cloud mode: its drafter, and its rounds in a row that drafted nothing the
    verifier ran (k = 0 chosen, or an empty proposal) while it was alone."""

    runs: dict[str, tuple[str, int]] = field(default_factory=dict)

    def observe(self, round_: RoundObservation, modes: Mapping[str, tuple[m.Mode, int]]) -> None:
        """A round of a session; `modes`: the mode the policy last put each session in."""
        session = round_.session_id
        mode = modes.get(session, (None, 0))[0]
        lone = round_.verifier_load < LONE_LOAD
        if mode is not m.Mode.CLOUD or round_.mode not in m.HOST_MODES or not lone:
            self.runs.pop(session, None)
            return
        drafter, count = self.runs.get(session, (round_.draft_model, 0))
        count = count if drafter == round_.draft_model else 0
        self.runs[session] = (round_.draft_model, 0 if round_.k > 0 else count + 1)

    def rate(
        self, session_id: str, cloud: list[Candidate], plain: Candidate
    ) -> tuple[list[Candidate], str | None]:
        """The session's cloud candidates, its declined drafter rated at `plain` decoding's
        tokens/s where it promised more; and a note for the decision's reason, if so."""
        run = self.runs.get(session_id)
        if run is None or run[1] < DECLINED_ROUNDS:
            return cloud, None
        drafter, count = run
        rated = [
            c._replace(tokens_per_s=plain.tokens_per_s)
            if c.draft_model == drafter and c.tokens_per_s > plain.tokens_per_s
            else c
            for c in cloud
        ]
        note = (
            f"{drafter}: its last {count} rounds alone ran plain, rated at plain decoding's "
            f"{plain.tokens_per_s:.1f} tok/s"
        )
        return rated, note

    def forget(self, session_id: str) -> None:
        self.runs.pop(session_id, None)
