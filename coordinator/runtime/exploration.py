"""Host drafters tried once: a drafter the verifier hosts offer that no cloud round has drafted
with yet gets a stream's rounds up to the policy's next decision (after round 8), so that it is
rated on what it does. That decision ends the try; the stream runs on, with the drafter it
chooses (a `StreamRedraft` where it chooses another): a try cut at the decision always ended its
stream, and the session's next round waited a bus round trip for the next one, a pass behind
the others (`bench e2e` at 16: one more pass a wave).

Before any round of it, a drafter is rated on priors: its acceptance is what the device's other
drafters see on the task (DraftWants.unseen_alpha), so a drafter that costs more a token than
the copying `hybrid` could never be rated above it, whatever it accepts: `hybrid+eagle-h1`,
2.07 tokens a pass in bench models where `hybrid` makes 1.84 a round in bench e2e, was never
drafted with in cloud mode. So a session the policy moves to cloud mode opens its stream with an
untried host drafter (the best rated of them), one session per drafter at a time; its rounds
teach the fleet's acceptance, fill and cost of it, and from then on it is rated with the others.

Only in cloud mode: a host stream's window is the verifier's choice pass by pass, so a drafter
that does badly costs a few narrow windows, and a loaded verifier, which keeps its sessions
plain, explores nothing. A drafter offered behind the copying tiers too (`eagle-h1` beside
`hybrid+eagle-h1`) is tried in the hybrid only: the tiers propose first, for next to nothing,
and the hybrid did better than its drafter alone in every bench models run (hybrid+eagle-h1
1.72x, eagle-h1 1.13x), so cloud rounds are not offered it alone (`host_offer`). TFLite
builds are not offered on the host where the ONNX build of the same draft is: the same model,
slower on a server.

Pure, like the policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from coordinator.runtime.decisions import Candidate
from inference.drafters import HYBRID_PREFIX
from inference.drafts import TFLITE_SUFFIX


def host_offer(host_drafts: Iterable[str]) -> list[str]:
    """The host's drafters as cloud candidates: each once, a TFLite build left out where its
    ONNX twin is offered (`hybrid+draft-l1-tflite` beside `hybrid+draft-l1`), and a drafter
    alone where its hybrid is offered (`eagle-h1` beside `hybrid+eagle-h1`): the hybrid did
    better than its drafter alone in every bench models run, and a stream keeps the drafter it
    opened with (bench e2e: `eagle-h1` alone on a summary, rated on priors at the opening, made
    1.16 tokens a round for the whole answer where the hybrid makes 3.3)."""
    names = dict.fromkeys(host_drafts)
    return [
        d
        for d in names
        if not (d.endswith(TFLITE_SUFFIX) and d[: -len(TFLITE_SUFFIX)] in names)
        and f"{HYBRID_PREFIX}{d}" not in names
    ]


@dataclass
class HostExploration:
    """Which host drafters cloud rounds have drafted with, and which sessions are trying one."""

    tried: set[str] = field(default_factory=set)
    exploring: dict[str, str] = field(default_factory=dict)  # drafter -> the session trying it

    def observe(self, draft: str) -> None:
        """A cloud round drafted with `draft` (a window of at least one token)."""
        self.tried.add(draft)

    def pick(
        self, session_id: str, cloud: Sequence[Candidate], opens: bool = True
    ) -> Candidate | None:
        """The untried drafter the session's stream should try, or None; `opens`: whether the
        decision opens a stream (one that moves the session to cloud mode). A stream drafts
        with the drafter it opened with, so a later decision of it would try nothing. The
        session's next decision ends its try: the drafter counts as tried then, even if the
        verifier drafted no window of it (it judged none worth it), and that decision tries
        nothing."""
        ended = [draft for draft, session in self.exploring.items() if session == session_id]
        for draft in ended:
            del self.exploring[draft]
            self.tried.add(draft)
        if ended or not opens:
            return None
        # A drafter alone beside its hybrid is not among them (host_offer).
        untried = [
            c
            for c in cloud
            if c.k > 0 and c.draft_model not in self.tried and c.draft_model not in self.exploring
        ]
        if not untried:
            return None
        best = max(untried, key=lambda c: c.tokens_per_s)
        self.exploring[best.draft_model] = session_id
        return best

    def forget_session(self, session_id: str) -> None:
        """A session that ended: a drafter it was trying is free for another to try."""
        for draft in [d for d, session in self.exploring.items() if session == session_id]:
            del self.exploring[draft]
