"""A rebuilt session played on a terminal at the pace it ran, or written as JSON lines."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, TextIO

from coordinator.replay.rebuild import Rebuild, ReplayStep, ReplayToken
from coordinator.replay.records import TokenKind

if TYPE_CHECKING:
    pass


# A long gap between two rounds (a device offline for a minute) is replayed this long at most.
MAX_REPLAY_GAP_S = 3.0


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
