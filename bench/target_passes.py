"""What a batched target pass costs with its rows' caches kept in the last pass, against
stacking every row's cache into a new batch before each pass (what any pass after a rollback
did before rows stayed in their pass).

Both ways run the same passes, in turns, on caches prefilled from the same random prompts: each
pass feeds every row k drafted tokens after its last one (random ids), and a row then keeps a
random number of them (0..k, as a verdict leaves it) plus one. The stacked way takes every cache
out of its pass before each pass. Per (rows, k): each way's median pass, their ratio, and the
largest difference between the two ways' logits (a different kernel shape moves the last bits:
it must stay within LOGIT_TOLERANCE).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from core.report import add_json_argument, format_table, int_list, median, write_json

DEFAULT_JSON = Path("bench-results/target-passes.json")
PROMPT_TOKENS = (60, 140)  # each row's prompt length is drawn from this range
TOKEN_IDS = (1000, 5000)  # random prompt and draft ids are drawn from this range
LOGIT_TOLERANCE = 1e-3  # as tests/inference/test_onnx_runtime.py allows between kernel shapes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_argument(parser, DEFAULT_JSON)
    parser.add_argument("--rows", default="4,16", help="comma-separated batch sizes (4,16)")
    parser.add_argument("--k", default="0,1,3", help="comma-separated windows (0,1,3)")
    parser.add_argument("--passes", type=int, default=12, help="passes per way (default 12)")
    parser.add_argument("--turns", type=int, default=2, help="turns of both ways (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="runtime threads (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="prompts, drafts and acceptance")
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from core.errors import CommandError
    from modelbuild.target_build import load_target

    rows_list = int_list(args.rows, "--rows", least=2)
    windows = int_list(args.k, "--k", least=0)
    if args.passes < 2 or args.turns < 1:
        raise CommandError("--passes must be at least 2 and --turns at least 1")
    runtime, _ = load_target(args.models_dir, threads=args.threads)
    runtime.forward([1, 2], runtime.new_cache())  # the first pass pays for warm-up

    results: list[dict[str, Any]] = []
    total = len(rows_list) * len(windows) * args.turns * 2
    with tqdm(total=total, desc="target passes", unit="run", file=sys.stderr) as bar:
        for rows in rows_list:
            for k in windows:
                times: dict[str, list[float]] = {"in_place": [], "stacked": []}
                worst = 0.0
                for turn in range(args.turns):
                    seed = args.seed * 1000 + turn
                    order = ("in_place", "stacked") if turn % 2 == 0 else ("stacked", "in_place")
                    last = {}
                    for way in order:
                        way_ms, last[way] = _passes(
                            runtime, rows, k, args.passes, seed, stack=way == "stacked"
                        )
                        times[way] += way_ms
                        bar.update()
                    diff = float(np.abs(last["in_place"] - last["stacked"]).max())
                    worst = max(worst, diff)
                in_place, stacked = median(times["in_place"]), median(times["stacked"])
                results.append(
                    {
                        "rows": rows,
                        "k": k,
                        "in_place_ms": in_place,
                        "stacked_ms": stacked,
                        "ratio": in_place / stacked,
                        "max_logit_diff": worst,
                    }
                )

    headers = ["rows", "k", "in place ms", "stacked every pass ms", "in place / stacked",
               "max |logit diff|"]  # fmt: skip
    table = [
        [r["rows"], r["k"], r["in_place_ms"], r["stacked_ms"], r["ratio"], r["max_logit_diff"]]
        for r in results
    ]
    print(format_table(headers, table))
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "target-passes",
                "passes": args.passes,
                "turns": args.turns,
                "threads": args.threads,
                "seed": args.seed,
                "prompt_tokens": list(PROMPT_TOKENS),
                "results": results,
            },
        )
        print(f"wrote {args.json}")
    return 0 if all(r["max_logit_diff"] <= LOGIT_TOLERANCE for r in results) else 1


def _passes(
    runtime: Any, rows: int, k: int, passes: int, seed: int, *, stack: bool
) -> tuple[list[float], npt.NDArray[np.float32]]:
    """Prefill `rows` prompts, then `passes` passes of k + 1 tokens a row; the times of all but
    the first (it stacks the prefilled rows either way) and every row's last logits of every
    pass # [passes, rows, vocab]."""
    rng = random.Random(seed)
    caches = []
    for _ in range(rows):
        cache = runtime.new_cache()
        length = rng.randrange(*PROMPT_TOKENS)
        runtime.forward([rng.randrange(*TOKEN_IDS) for _ in range(length)], cache)
        caches.append(cache)
    times: list[float] = []
    last: list[npt.NDArray[np.float32]] = []
    for index in range(passes):
        if stack:
            for cache in caches:
                cache._detach()
        lengths = [cache.length for cache in caches]
        requests = [([rng.randrange(*TOKEN_IDS) for _ in range(k + 1)], c) for c in caches]
        t0 = time.perf_counter()
        logits = runtime.forward_batch(requests)
        if index:
            times.append((time.perf_counter() - t0) * 1e3)
        last.append(np.stack([row[-1] for row in logits]))
        for cache, length in zip(caches, lengths, strict=True):
            cache.trim(length + rng.randrange(0, k + 1) + 1)
    return times, np.stack(last)
