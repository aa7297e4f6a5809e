"""Host streams: sessions whose rounds the verifier runs by itself, one per batched pass.

A stream opens with a VerifyRequest that carries a `StreamSpec` (cloud or plain mode). From then
on every pass of the worker holds one round of each stream it has room for, next to the drafts
that devices sent, with no bus round trip between a session's rounds: the results go to the
coordinator, which persists each round before its verdict leaves, while the next pass already
runs. A result the coordinator never persisted (a crash, a move) is computed again from the
committed tokens, deterministically, so running ahead of persistence loses nothing (a feature
head drafts from the features its host holds, so a sampled round of one may come out otherwise,
from the same distribution: the lost one was never published).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from broker.messages import MAX_CLOUD_K, StreamRedraft, StreamSpec, VerifyRequest
from inference.drafters import DEFAULT_K, HYBRID
from inference.speculative import apply_stop_rules
from verifier.goodput import PRIOR_ACCEPT, StreamRow

S = TypeVar("S")

# How far an adaptive stream's long match in its context may copy in a pass of its own row
# alone, whatever window the pass chose: a device's hybrid window. A lone row's position costs
# the target ~1.6 ms (~7% of its pass) where a token of it costs ~14 (bench e2e at one session,
# this CPU), and the long match's tokens are mostly right: at one session the adaptive arm's
# windows of 1-3 took 9-25 rounds for answers the fixed drafter's windows of 8 took in 7-17.
COPY_REACH = DEFAULT_K[HYBRID]


def pass_turn(
    ready: Sequence[S],
    room: int,
    pass_index: int,
    last_pass: Callable[[S], int],
    first_round: Callable[[S], bool],
    beside_device_rows: bool,
) -> list[S]:
    """The streams of pass `pass_index` among `ready`: up to `room`, those that waited longest
    first (by the pass that last ran them).

    A pass of streams alone that opens sessions (their prompts prefilled one after another)
    leaves the streams that ran the pass just before to the next one, where they join the
    opened sessions' rows: run beside the prefills, they were a forward of their own (a lone
    row's costs about 30 ms on this CPU, as much as 13 rows more in a batch), each wave of
    sessions opening one more forward than plain serving, which prefills first and then decodes
    every session together. A stream sits out at most one pass in a row; beside a device's
    round none does, that forward running anyway. The verifier's rule (`HostStreams.turn`), and
    the simulator's."""
    chosen = sorted(ready, key=last_pass)[: max(0, room)]
    if not beside_device_rows and any(first_round(s) for s in chosen):
        chosen = [s for s in chosen if first_round(s) or last_pass(s) != pass_index - 1]
    return chosen


def cut_window(window: int, left: int) -> int:
    """`window` cut so that its accepted tokens and the target's own fit in the `left` tokens
    the answer may still take: the worker's cut of a stream's round, and the inference
    process's of the rounds it runs on (`verifier.child.run_steps`)."""
    room = left - 1
    return max(0, window if window < room else room)


def copy_reach(window: int, own_reach: int, left: int) -> int | None:
    """How far a drafted round's long match may run past `window` when the round is its pass's
    only row (`VerifyRequest.cloud_reach`): `own_reach` cut to what the answer has left; None
    for a plain round, or where it reaches no further than the window."""
    far = cut_window(own_reach, left)
    return far if window > 0 and far > window else None


@dataclass
class HostStream:
    """One session's stream: where it stands and how far it may go."""

    opening: VerifyRequest  # the request that opened it (request_id, sampling, drafter, cap)
    spec: StreamSpec
    received_at: float  # time.perf_counter() of its opening
    round: int
    context: list[int]  # the committed sequence, prompt included, as this stream has it
    generated: int = 0  # tokens committed by this stream's rounds
    rounds_done: int = 0
    last_pass: int = -1  # the pass that last ran a round of it, for fair turns
    finished: bool = False  # its session's answer ended (eos or max_new), not just the stream
    # A drafter the coordinator chose since (StreamRedraft), taken at the stream's next turn:
    # the rounds of a pass in flight keep the drafter they were drafted with.
    redraft: StreamRedraft | None = None

    @classmethod
    def open(cls, request: VerifyRequest, received_at: float) -> HostStream:
        assert request.stream is not None
        return cls(
            opening=request,
            spec=request.stream,
            received_at=received_at,
            round=request.round,
            context=list(request.context_ids),
        )

    @property
    def session_id(self) -> str:
        return self.opening.session_id

    @property
    def draft(self) -> str | None:
        """The drafter of its rounds now (None: plain decoding)."""
        return self.opening.cloud_draft

    def take_redraft(self) -> None:
        """The drafter chosen since its last turn, from this round on."""
        redraft, self.redraft = self.redraft, None
        if redraft is None:
            return
        self.opening = self.opening.model_copy(
            update={"cloud_draft": redraft.cloud_draft, "cloud_k": redraft.cloud_k}
        )
        self.spec = self.spec.model_copy(update={"alpha": redraft.alpha})

    @property
    def request_id(self) -> str:
        return self.opening.request_id

    @property
    def cap(self) -> int:
        """The widest window of its next round: the stream's cap, cut so that the accepted
        tokens plus the target's own fit in what the session may still generate."""
        return cut_window(self._own_window, self.spec.max_new - self.generated)

    def window(self, k: int) -> int:
        """Its rounds' window in a pass that chose k: `cap` before the cut to what its answer
        has left (adaptive: k within its cap; fixed: its own window)."""
        own = self._own_window
        return (k if k < own else own) if self.spec.adaptive else own

    @property
    def _own_window(self) -> int:
        """Its drafter's window, MAX_CLOUD_K at most (0: it drafts nothing)."""
        if self.draft is None or self.opening.cloud_k is None:
            return 0
        return min(self.opening.cloud_k, MAX_CLOUD_K)

    @property
    def rounds_left(self) -> int:
        """Plain rounds it may still run: one a token, within its rounds and its session's
        max_new (where `advance` would end it)."""
        return min(self.spec.rounds - self.rounds_done, self.spec.max_new - self.generated)

    def row(self) -> StreamRow:
        prior = PRIOR_ACCEPT if self.spec.alpha is None else self.spec.alpha
        return StreamRow(self.draft, self.spec.task_type, self.cap, prior, self.session_id)

    @property
    def adaptive(self) -> bool:
        return self.spec.adaptive

    @property
    def first_round(self) -> bool:
        """Its next round is its session's first: the round prefills the prompt, in a forward
        of its own (`VerifierCore`), and commits the first token from it."""
        return self.round == 0 and self.rounds_done == 0

    def request(self, k: int) -> VerifyRequest:
        """This round as the core verifies it: drafted here with a window of k (0: plain), or
        its own fixed window; an adaptive stream's long match may reach further (`copy_reach`)."""
        left = self.spec.max_new - self.generated
        window = cut_window(self.window(k), left)
        return self.opening.model_copy(
            update={
                "round": self.round,
                "context_ids": tuple(self.context),
                "cloud_draft": self.draft if window > 0 else None,
                "cloud_k": window if window > 0 else None,
                "cloud_reach": copy_reach(window, COPY_REACH if self.spec.adaptive else 0, left),
                "stream": None,
            }
        )

    def advance(self, drafted: tuple[int, ...], n_accepted: int, next_token: int) -> bool:
        """Take a verified round; True while the stream goes on."""
        kept, finished = apply_stop_rules(
            self.generated,
            list(drafted[:n_accepted]),
            next_token,
            self.spec.max_new,
            self.spec.eos_id,
        )
        self.context += kept
        self.generated += len(kept)
        self.round += 1
        self.rounds_done += 1
        self.finished = finished
        return not finished and self.rounds_done < self.spec.rounds


@dataclass
class HostStreams:
    """The streams of one worker, by session (a session has at most one)."""

    by_session: dict[str, HostStream] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.by_session)

    def open(self, stream: HostStream) -> HostStream | None:
        """Open a stream; the one it replaces for the same session, if any."""
        replaced = self.by_session.pop(stream.session_id, None)
        self.by_session[stream.session_id] = stream
        return replaced

    def stop(self, session_id: str, request_id: str | None = None) -> HostStream | None:
        """End a session's stream (only the one opened by `request_id`, when given)."""
        stream = self.by_session.get(session_id)
        if stream is None or (request_id is not None and stream.request_id != request_id):
            return None
        return self.by_session.pop(session_id)

    def redraft(self, message: StreamRedraft) -> HostStream | None:
        """Give a stream the drafter the coordinator chose, from its next turn on; None when no
        stream of that request runs (it ended meanwhile)."""
        stream = self.by_session.get(message.session_id)
        if stream is None or stream.request_id != message.request_id:
            return None
        stream.redraft = message
        return stream

    def is_current(self, stream: HostStream) -> bool:
        return self.by_session.get(stream.session_id) is stream

    def turn(self, room: int, pass_index: int, busy: Iterable[str]) -> list[HostStream]:
        """Up to `room` streams for this pass (`pass_turn`); a session whose device-drafted
        round is in the pass already sits this one out."""
        taken = set(busy)
        ready = [s for s in self.by_session.values() if s.session_id not in taken]
        chosen = pass_turn(
            ready,
            room,
            pass_index,
            lambda s: s.last_pass,
            lambda s: s.first_round,
            beside_device_rows=bool(taken),
        )
        for stream in chosen:
            stream.last_pass = pass_index
            stream.take_redraft()
        return chosen
