"""What the process boundary costs a drafting round: each draft in-process against in its child.

Two drafters of the same draft and window draft the same rounds, one on the runtime in this
process, one on an `IsolatedRuntime` (its child, one pipe round trip per draft step), turn by
turn so that both see the same load on the machine. A round is what the agent does: roll back
to the committed length, feed what the verdict committed, draft k tokens. The verdicts are made
up but the same for both: the first `round % (k + 1)` tokens accepted, then a bonus token. The
windows of both must be identical (the logits are, bit for bit); the table says so.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from core.report import add_json_argument, format_table, median, percentile, write_json

DEFAULT_JSON = Path("bench-results/draft-boundary.json")
PROMPT = (
    "Explain in a few sentences why the sky is blue, and what changes at sunset when the light "
    "crosses more of the atmosphere."
)
BONUS_TOKEN = 13  # any fixed id; the verdict's own token after the accepted ones


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_argument(parser, DEFAULT_JSON)
    parser.add_argument("--rounds", type=int, default=200, help="rounds per draft and window")
    parser.add_argument(
        "--k", default="2,4", help="comma-separated windows (default 2,4; 2 is a draft's own)"
    )
    parser.add_argument(
        "--drafts", default=None, help="comma-separated draft names (default: every built draft)"
    )
    parser.add_argument("--threads", type=int, default=1, help="runtime threads (default 1)")
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )


def run(args: argparse.Namespace) -> int:
    from core.errors import CommandError
    from inference.artifacts import default_models_dir
    from inference.drafts import list_drafts
    from inference.isolated_runtime import DraftChildSpec, IsolatedRuntime
    from inference.proposers import NeuralProposer
    from inference.tokenizer import ChatTokenizer

    models_dir = args.models_dir or default_models_dir()
    drafts = list_drafts(models_dir)
    wanted = None if args.drafts is None else set(args.drafts.split(","))
    chosen = [d for d in drafts if wanted is None or d.manifest.name in wanted]
    if not chosen:
        raise CommandError(f"no drafts to measure in {models_dir} (asked for {args.drafts})")
    if args.rounds < 1:
        raise CommandError("--rounds must be at least 1")
    try:
        windows = [int(k) for k in args.k.split(",")]
    except ValueError:
        raise CommandError(f"--k takes comma-separated integers, not {args.k!r}") from None
    if min(windows) < 1:
        raise CommandError("every window in --k must be at least 1")
    prompt_ids = ChatTokenizer.load(chosen[0].directory).apply_chat_template(PROMPT)

    results: list[dict[str, Any]] = []
    for draft in chosen:
        from inference.drafts import load_draft

        name = draft.manifest.name
        local = load_draft(models_dir, name, draft.format, threads=args.threads)
        isolated = IsolatedRuntime(DraftChildSpec(models_dir, name, draft.format, args.threads))
        isolated.start()
        try:
            if not isolated.wait_ready(60.0):
                raise CommandError(f"draft {name}: its child did not load within 60 s")
            for k in windows:
                pair = (NeuralProposer(local), NeuralProposer(isolated))
                times = _rounds(pair, prompt_ids, k, args.rounds)
                results.append(_row(name, draft.format, k, times, isolated.vocab_size))
                print(f"{name} k={k}: done", flush=True)
        finally:
            isolated.stop()

    headers = [
        "draft",
        "k",
        "in-process p50 ms",
        "isolated p50 ms",
        "boundary p50 ms",
        "per step ms",
        "isolated p99 ms",
        "reply KB",
        "same windows",
    ]
    table = [
        [
            r["draft"],
            r["k"],
            r["in_process_p50_ms"],
            r["isolated_p50_ms"],
            r["boundary_p50_ms"],
            r["boundary_per_step_ms"],
            r["isolated_p99_ms"],
            r["reply_kb_per_step"],
            "yes" if r["same_windows"] else "NO",
        ]
        for r in results
    ]
    print(format_table(headers, table))
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "draft-boundary",
                "rounds": args.rounds,
                "threads": args.threads,
                "prompt_tokens": len(prompt_ids),
                "results": results,
            },
        )
        print(f"wrote {args.json}")
    return 0 if all(r["same_windows"] for r in results) else 1


def _rounds(pair: tuple[Any, Any], prompt_ids: list[int], k: int, rounds: int) -> dict[str, Any]:
    """Draft `rounds` rounds with both drafters in turn; each one's round times and windows."""
    contexts = [list(prompt_ids), list(prompt_ids)]
    times: list[list[float]] = [[], []]
    windows: list[list[list[int]]] = [[], []]
    for index in range(rounds):
        for side in (index % 2, 1 - index % 2):  # who goes first alternates
            proposer, context = pair[side], contexts[side]
            proposer.rollback(len(context))
            t0 = time.perf_counter()
            tokens = proposer.get_candidates(context, k).tokens.tolist()
            times[side].append((time.perf_counter() - t0) * 1e3)
            windows[side].append(tokens)
            accepted = index % (k + 1)
            context += [*tokens[:accepted], BONUS_TOKEN]
    return {"times": times, "same": windows[0] == windows[1]}


def _row(name: str, fmt: str, k: int, measured: dict[str, Any], vocab: int) -> dict[str, Any]:
    local, isolated = measured["times"]
    boundary = [b - a for a, b in zip(local, isolated, strict=True)]
    return {
        "draft": name,
        "format": fmt,
        "k": k,
        "in_process_p50_ms": median(local),
        "isolated_p50_ms": median(isolated),
        "boundary_p50_ms": median(boundary),
        "boundary_per_step_ms": median(boundary) / k,  # a round is k draft steps
        "in_process_p99_ms": percentile(local, 99),
        "isolated_p99_ms": percentile(isolated, 99),
        "reply_kb_per_step": vocab * 4 / 1024,  # one row of float32 logits
        "same_windows": measured["same"],
    }
