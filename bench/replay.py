"""`specfleet bench replay`: committed tokens per target pass of many drafters, in seconds.

Greedy speculative decoding commits exactly the target's own greedy output, so once that output
is known, every round of a drafter follows from its drafts alone (`replay_greedy`): the target
decodes each prompt once, and each (drafter, k) is then replayed along those answers in the
drafter's own time. This is how drafter settings are tuned (on bench/prompts/tune.jsonl, never
on the shared benchmark prompts); `specfleet bench models` measures the same counts in real
speculative decoding, with wall-clock speedups.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.models import RunTotals, add_drafter_run_arguments, drafter_run, solve_alpha
from core.report import add_json_argument, format_table, write_json

DEFAULT_JSON = Path("bench-results/replay.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_argument(parser, DEFAULT_JSON)
    add_drafter_run_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from core.errors import CommandError
    from inference.drafters import DrafterError, default_k, make_proposer
    from inference.proposers import wants_features
    from inference.runtime import FeatureRuntime
    from inference.sampling import SamplingParams
    from inference.speculative import decode_target, replay_greedy
    from modelbuild.target_build import load_target

    prompts, models_dir, names, windows = drafter_run(args)

    target, tokenizer = load_target(models_dir, threads=args.threads)
    greedy = SamplingParams(temperature=0.0)
    prompt_ids = [tokenizer.apply_chat_template(p.prompt) for p in prompts]
    answers = [
        decode_target(target, ids, args.max_tokens, greedy, tokenizer.eos_id).tokens
        for ids in tqdm(prompt_ids, desc="target answers", unit="prompt")
    ]

    # A feature drafter is handed the target's features along each answer as its verdicts would
    # carry them: one prefill of prompt + answer each, taken once for every such drafter.
    hidden: list[Any] | None = None
    rows: list[dict[str, Any]] = []
    for name in names:
        try:
            proposer = make_proposer(name, models_dir, threads=args.threads)
        except DrafterError as exc:
            raise CommandError(str(exc)) from exc
        feature_drafting = wants_features(proposer)
        if hidden is None and feature_drafting:
            if not (isinstance(target, FeatureRuntime) and target.has_hidden):
                raise CommandError(f"{name} drafts from features the target does not output")
            hidden = [
                target.forward_batch_hidden([([*ids, *answer], target.new_cache())])[0][1]
                for ids, answer in tqdm(
                    list(zip(prompt_ids, answers, strict=True)), desc="features", unit="prompt"
                )
            ]
        features = hidden if feature_drafting else None
        for k in windows or [default_k(name)]:
            per_task: dict[str, RunTotals] = defaultdict(RunTotals)
            started = time.perf_counter()
            for i, (prompt, ids, answer) in enumerate(
                zip(prompts, prompt_ids, answers, strict=True)
            ):
                result = replay_greedy(
                    proposer, ids, answer, k, args.max_tokens,
                    hidden=None if features is None else features[i],
                )  # fmt: skip
                per_task[prompt.task].add(result)
                per_task["all"].add(result)
            t = per_task["all"]
            tokens, passes, drafted = t.tokens, t.passes, t.drafted
            rows.append(
                {
                    "drafter": name,
                    "k": k,
                    "tokens_per_pass": tokens / passes,
                    "drafted_per_pass": drafted / passes,
                    "acceptance_of_drafted": t.accepted / drafted if drafted else 0.0,
                    "alpha_eff": solve_alpha(tokens / passes, k),
                    "alpha_eff_at_mean_draft": solve_alpha(tokens / passes, drafted / passes),
                    "draft_ms_per_token": t.draft_ms / drafted if drafted else 0.0,
                    "tokens_per_pass_by_task": {
                        task: totals.tokens / totals.passes
                        for task, totals in sorted(per_task.items())
                        if task != "all"
                    },
                    "replay_s": time.perf_counter() - started,
                }
            )
            print(f"replayed {name} k={k} in {rows[-1]['replay_s']:.1f} s", flush=True)

    document = {
        "target": target.name,
        "prompts_file": str(args.prompts),
        "n_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "target_tokens": sum(len(a) for a in answers),
        "rows": rows,
    }
    print(report(document))
    if args.json is not None:
        write_json(args.json, document)
        print(f"wrote {args.json}")
    return 0


def report(document: dict[str, Any]) -> str:
    tasks = sorted({t for row in document["rows"] for t in row["tokens_per_pass_by_task"]})
    table = format_table(
        (
            "drafter",
            "k",
            "tok/pass",
            *(f"{t}" for t in tasks),
            "drafted/pass",
            "accepted/drafted",
            "alpha_eff",
            "(at drafted/pass)",
            "draft ms/token",
        ),
        [
            (
                row["drafter"],
                row["k"],
                row["tokens_per_pass"],
                *(row["tokens_per_pass_by_task"].get(t, float("nan")) for t in tasks),
                row["drafted_per_pass"],
                row["acceptance_of_drafted"],
                row["alpha_eff"],
                row["alpha_eff_at_mean_draft"],
                row["draft_ms_per_token"],
            )
            for row in document["rows"]
        ],
    )
    return (
        f"greedy speculative decoding replayed along the target's answers: "
        f"{document['n_prompts']} prompts from {document['prompts_file']}, up to "
        f"{document['max_tokens']} new tokens each ({document['target_tokens']} target tokens); "
        f"tok/pass per task after the overall one\n{table}"
    )
