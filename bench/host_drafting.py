"""What a pass's cloud drafts cost the verifier host: drafted together (`draft_many`: a feature
head steps every row in one call per step) against one by one (`draft`, each step a call of one
row), on the real target's features.

Each session is a prompt of the set, chat-templated, whose feature (the target's hidden state at
its second-to-last token, from one prefill) is handed to its drafter before every draft, so each
draft chains the head from scratch. Per number of sessions: each way's median time to draft one
window for every session, their ratio, the head calls and rows per call, and whether the two ways
drafted the same windows (they must: a row's result is the same in a batch as alone).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from broker.messages import SamplingSpec, VerifyRequest
from core.report import add_json_argument, format_table, int_list, median, write_json
from localfleet.prompts import DEFAULT_PROMPTS

DEFAULT_JSON = Path("bench-results/host-drafting.json")
DEFAULT_DRAFTER = "hybrid+eagle-h1"
WAYS = ("together", "alone")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_argument(parser, DEFAULT_JSON)
    parser.add_argument(
        "--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL of {id, task, prompt}"
    )
    parser.add_argument("--sessions", default="1,4,16,32", help="comma-separated (1,4,16,32)")
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER, help=f"(default {DEFAULT_DRAFTER})")
    parser.add_argument("--k", type=int, default=4, help="window a session (default 4)")
    parser.add_argument("--rounds", type=int, default=10, help="drafts per way (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="runtime threads (default 1)")
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from core.errors import CommandError
    from inference.artifacts import default_models_dir
    from localfleet.prompts import read_prompts
    from modelbuild.target_build import load_target
    from verifier.drafting import HostDrafters

    sessions_list = int_list(args.sessions, "--sessions", least=1)
    if args.rounds < 2 or args.k < 1:
        raise CommandError("--rounds must be at least 2 and --k at least 1")
    if not args.prompts.is_file():
        raise CommandError(f"no prompts file {args.prompts}")
    prompts = read_prompts(args.prompts)
    if not prompts:
        raise CommandError(f"{args.prompts} holds no prompt")
    models_dir = args.models_dir or default_models_dir()
    names = HostDrafters(models_dir).names
    if args.drafter not in names:
        raise CommandError(f"no drafter {args.drafter} here; there are: {', '.join(names)}")
    runtime, tokenizer = load_target(models_dir, threads=args.threads)
    contexts: list[tuple[int, ...]] = []
    features = []
    for number in tqdm(range(max(sessions_list)), desc="prefills", unit="prompt", file=sys.stderr):
        ids = tokenizer.apply_chat_template(prompts[number % len(prompts)].prompt)
        ((_, hidden),) = runtime.forward_batch_hidden([(ids, runtime.new_cache())])
        contexts.append(tuple(ids))
        features.append(hidden[-2])

    results: list[dict[str, Any]] = []
    with tqdm(
        total=len(sessions_list) * args.rounds * 2, desc="drafts", unit="pass", file=sys.stderr
    ) as bar:
        for n in sessions_list:
            ways = {way: HostDrafters(models_dir, threads=args.threads) for way in WAYS}
            rows: dict[str, list[int]] = {way: [] for way in ways}
            for way, drafters in ways.items():
                _count_head_calls(drafters, args.drafter, rows[way])
            requests = [
                VerifyRequest(
                    request_id=f"s{i}-{r}",
                    session_id=f"s{i}",
                    round=r,
                    context_ids=contexts[i],
                    tokens=(),
                    sampling=SamplingSpec(),
                    cloud_draft=args.drafter,
                    cloud_k=args.k,
                )
                for r in range(args.rounds)
                for i in range(n)
            ]
            times: dict[str, list[float]] = {way: [] for way in ways}
            same = True
            for r in range(args.rounds):
                batch = requests[r * n : (r + 1) * n]
                drafted = {}
                for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                    drafters = ways[way]
                    for i, request in enumerate(batch):
                        drafters.proposer(args.drafter, 0.0, request.session_id)
                        drafters.give_features(request.session_id, features[i], request.context_ids)
                    started = time.perf_counter()
                    drafted[way] = _draft(drafters, batch, together=way == "together")
                    times[way].append((time.perf_counter() - started) * 1e3)
                    bar.update()
                same = same and drafted["together"] == drafted["alone"]
            together, alone = median(times["together"]), median(times["alone"])
            results.append(
                {
                    "sessions": n,
                    "together_ms": together,
                    "alone_ms": alone,
                    "ratio": together / alone,
                    "head_calls_together": len(rows["together"]),
                    "head_calls_alone": len(rows["alone"]),
                    "rows_per_call": sum(rows["together"]) / max(1, len(rows["together"])),
                    "same_windows": same,
                }
            )

    headers = ["sessions", "together ms", "one by one ms", "together / one by one",
               "head calls together / one by one", "rows a call", "same windows"]  # fmt: skip
    table = [
        [
            r["sessions"],
            r["together_ms"],
            r["alone_ms"],
            r["ratio"],
            f"{r['head_calls_together']} / {r['head_calls_alone']}",
            r["rows_per_call"],
            r["same_windows"],
        ]
        for r in results
    ]
    print(f"{args.drafter}, a window of {args.k} for every session, median of {args.rounds}:")
    print(format_table(headers, table))
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "host-drafting",
                "drafter": args.drafter,
                "k": args.k,
                "rounds": args.rounds,
                "threads": args.threads,
                "results": results,
            },
        )
        print(f"wrote {args.json}")
    return 0 if all(r["same_windows"] for r in results) else 1


def _count_head_calls(drafters: Any, drafter: str, rows: list[int]) -> None:
    """Count the rows of each call of the drafter's head (instrumentation, not a stand-in);
    nothing for a drafter without one."""
    name = drafter.removeprefix("hybrid+")
    if name not in drafters._head_names:
        return
    head = drafters._head(name)
    step = head.step

    def counted(features: Any, tokens: Any) -> Any:
        rows.append(int(features.shape[0]))
        return step(features, tokens)

    head.step = counted


def _draft(
    drafters: Any, batch: Sequence[VerifyRequest], *, together: bool
) -> list[tuple[int, ...]]:
    if together:
        windows = drafters.draft_many(batch)
    else:
        windows = [drafters.draft(request) for request in batch]
    out = []
    for window in windows:
        if isinstance(window, Exception):
            raise window
        out.append(window.tokens)
    return out
