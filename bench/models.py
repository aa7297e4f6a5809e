"""`specfleet bench models`: what drafting costs, how often it is accepted, and what it gains.

In one run, on the same prompts and the same process:
- per-token costs: the target at decode, at verification of k = 1..8 drafted tokens (one pass
  over k+1 positions) and at batches of 1/4/16 sequences, and each neural draft per runtime;
- greedy acceptance alpha of each drafter per task type, along the target's own greedy path
  (at each position: does the drafter's first proposed token equal the target's?);
- speculative decoding with each drafter: committed tokens per target pass, the prediction
  E = (1 - alpha^(k+1)) / (1 - alpha) of Leviathan et al. from the measured alpha, alpha_eff
  solved from the measured tokens per pass, the drafter's cost per drafted token as a fraction
  of a target decode step, exactness, and the wall-clock speedup over the target alone, whose
  baseline is measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.report import format_table, median, write_json

if TYPE_CHECKING:
    from inference.runtime import Runtime

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO_ROOT.parent / "shared" / "bench" / "prompts.jsonl"
DEFAULT_JSON = Path("bench-results/models.json")
VERIFY_KS = tuple(range(1, 9))
BATCHES = (1, 4, 16)
COST_REPEATS = 12
COST_CONTEXT = 64  # positions already in the cache when a cost is measured


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    task: str
    prompt: str


def read_prompts(path: Path) -> list[BenchPrompt]:
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
            prompts.append(
                BenchPrompt(str(fields["id"]), str(fields["task"]), str(fields["prompt"]))
            )
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a prompt record ({exc})") from exc
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def leviathan_expected_tokens(alpha: float, k: int) -> float:
    """E = (1 - alpha^(k+1)) / (1 - alpha): tokens per target pass for acceptance rate alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def solve_alpha(tokens_per_pass: float, k: int) -> float:
    """The alpha whose E(alpha, k) equals the measured tokens per pass (bisection; E rises)."""
    if tokens_per_pass <= 1.0:
        return 0.0
    if tokens_per_pass >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if leviathan_expected_tokens(mid, k) < tokens_per_pass:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def forward_cost_ms(runtime: Runtime, n_new: int, batch: int = 1) -> float:
    """One pass over `n_new` new positions per sequence, `batch` sequences, COST_CONTEXT deep."""
    caches = []
    for _ in range(batch):
        cache = runtime.new_cache()
        runtime.forward([1 + i % 100 for i in range(COST_CONTEXT)], cache)
        caches.append(cache)
    new = [7] * n_new
    samples = []
    for _ in range(COST_REPEATS + 1):  # the first pass warms up
        start = time.perf_counter()
        runtime.forward_batch([(new, cache) for cache in caches])
        samples.append((time.perf_counter() - start) * 1e3)
        for cache in caches:
            cache.trim(COST_CONTEXT)
    return median(samples[1:])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        type=Path,
        nargs="?",
        const=DEFAULT_JSON,
        default=None,
        help=f"write the results as JSON (default path {DEFAULT_JSON})",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument(
        "--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL of {id, task, prompt}"
    )
    parser.add_argument(
        "--drafters",
        default=None,
        help="comma-separated drafter names (default: every drafter available)",
    )
    parser.add_argument(
        "--k",
        default=None,
        help="comma-separated windows to run each drafter at (default: each drafter's own k)",
    )
    parser.add_argument("--limit", type=int, default=None, help="use the first N prompts only")
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads")


def _int_list(text: str, option: str) -> list[int]:
    from specfleet.cli import CommandError

    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise CommandError(f"{option} must be comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise CommandError(f"{option} values must be >= 1, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from inference.artifacts import default_models_dir
    from inference.drafters import (
        DrafterError,
        default_k,
        drafter_names,
        load_draft_runtime,
        make_proposer,
    )
    from inference.drafts import list_drafts
    from inference.sampling import SamplingParams
    from inference.speculative import decode_speculative, decode_target, greedy_acceptance
    from inference.target_build import load_target
    from specfleet.cli import CommandError

    if args.max_tokens < 1:
        raise CommandError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        prompts = read_prompts(args.prompts)
    except (OSError, ValueError) as exc:
        raise CommandError(str(exc)) from exc
    if args.limit is not None:
        prompts = prompts[: args.limit]
    models_dir: Path = args.models_dir or default_models_dir()
    available = drafter_names(models_dir)
    names = available if args.drafters is None else args.drafters.split(",")
    unknown = [name for name in names if name not in available]
    if unknown:
        raise CommandError(f"unknown drafters {unknown}; known: {', '.join(available)}")
    windows = None if args.k is None else _int_list(args.k, "--k")

    greedy = SamplingParams(temperature=0.0)
    target, tokenizer = load_target(models_dir, threads=args.threads)
    eos = tokenizer.eos_id
    prompt_ids = [tokenizer.apply_chat_template(p.prompt) for p in prompts]

    # Costs of single passes.
    costs: dict[str, Any] = {}
    with tqdm(total=1 + len(VERIFY_KS) + len(BATCHES), desc="target costs") as bar:
        decode_ms = forward_cost_ms(target, 1)
        bar.update()
        verify_ms = {}
        for k in VERIFY_KS:
            verify_ms[k] = forward_cost_ms(target, k + 1)
            bar.update()
        batch_ms = {}
        for batch in BATCHES:
            batch_ms[batch] = forward_cost_ms(target, 1, batch)
            bar.update()
    costs["target"] = {
        "decode_ms": decode_ms,
        "verify_ms": {str(k): v for k, v in verify_ms.items()},
        "batch_ms": {str(b): v for b, v in batch_ms.items()},
    }
    draft_costs = {}
    for draft in tqdm(list_drafts(models_dir), desc="draft costs"):
        name = draft.manifest.name
        try:
            runtime = load_draft_runtime(models_dir, name, args.threads)
        except (DrafterError, ImportError) as exc:
            # A runtime that cannot load here (no LiteRT wheel, say) is reported, not fatal.
            draft_costs[name] = {"format": draft.format, "error": str(exc)}
            continue
        ms = forward_cost_ms(runtime, 1)
        draft_costs[name] = {
            "format": draft.format,
            "head_size": runtime.vocab_size,
            "ms_per_token": ms,
            "fraction_of_target_decode": ms / decode_ms,
        }
    costs["drafts"] = draft_costs

    # The target alone: the baseline of the speedups and the greedy path alpha is measured on.
    baseline_tokens: list[list[int]] = []
    baseline_decode_ms = 0.0
    baseline_total_ms = 0.0
    for ids in tqdm(prompt_ids, desc="target alone", unit="prompt"):
        result = decode_target(target, ids, args.max_tokens, greedy, eos)
        baseline_tokens.append(result.tokens)
        baseline_decode_ms += result.decode_ms
        baseline_total_ms += result.total_ms
    n_baseline = sum(len(t) for t in baseline_tokens)
    baseline = {
        "tokens": n_baseline,
        "decode_s": baseline_decode_ms / 1e3,
        "total_s": baseline_total_ms / 1e3,
        "tokens_per_s": n_baseline / (baseline_decode_ms / 1e3),
        "decode_ms_per_token": baseline_decode_ms / n_baseline,
    }

    def proposer(name: str) -> Any:
        try:
            return make_proposer(name, models_dir, threads=args.threads)
        except DrafterError as exc:
            raise CommandError(str(exc)) from exc

    acceptance: dict[str, dict[str, float]] = {}
    alpha_all: dict[str, float] = {}
    for name in names:
        drafter = proposer(name)
        per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for prompt, ids, tokens in tqdm(
            list(zip(prompts, prompt_ids, baseline_tokens, strict=True)),
            desc=f"alpha {name}",
            unit="prompt",
        ):
            matches, positions = greedy_acceptance(drafter, ids, tokens)
            per_task[prompt.task][0] += matches
            per_task[prompt.task][1] += positions
        acceptance[name] = {task: m / n for task, (m, n) in sorted(per_task.items()) if n}
        total_m = sum(m for m, _ in per_task.values())
        total_n = sum(n for _, n in per_task.values())
        alpha_all[name] = total_m / total_n if total_n else 0.0
        acceptance[name]["all"] = alpha_all[name]

    speculative: list[dict[str, Any]] = []
    for name in names:
        for k in windows or [default_k(name)]:
            drafter = proposer(name)
            decode_total = draft_total = verify_total = 0.0
            total_ms = 0.0
            tokens = passes = drafted = accepted = 0
            exact = True
            for ids, reference in tqdm(
                list(zip(prompt_ids, baseline_tokens, strict=True)),
                desc=f"speculative {name} k={k}",
                unit="prompt",
            ):
                result = decode_speculative(target, drafter, ids, k, args.max_tokens, greedy, eos)
                exact &= result.tokens == reference
                decode_total += result.decode_ms
                total_ms += result.total_ms
                draft_total += result.draft_ms
                verify_total += result.verify_ms
                tokens += len(result.tokens)
                passes += result.target_passes
                drafted += result.n_drafted
                accepted += result.n_accepted
            tokens_per_pass = tokens / passes
            draft_ms_per_token = draft_total / drafted if drafted else float("nan")
            speculative.append(
                {
                    "drafter": name,
                    "k": k,
                    "exact": exact,
                    "alpha": alpha_all[name],
                    "tokens_per_pass": tokens_per_pass,
                    "predicted_tokens_per_pass": leviathan_expected_tokens(alpha_all[name], k),
                    "alpha_eff": solve_alpha(tokens_per_pass, k),
                    "drafted": drafted,
                    "accepted": accepted,
                    "acceptance_of_drafted": accepted / drafted if drafted else 0.0,
                    "draft_ms_per_token": draft_ms_per_token,
                    "draft_cost_fraction": draft_ms_per_token / baseline["decode_ms_per_token"],
                    "verify_ms_per_pass": verify_total / passes,
                    "decode_s": decode_total / 1e3,
                    "total_s": total_ms / 1e3,
                    "tokens_per_s": tokens / (decode_total / 1e3),
                    "speedup": baseline_decode_ms / decode_total,
                    "speedup_with_prefill": baseline_total_ms / total_ms,
                }
            )

    document = {
        "target": target.name,
        "prompts_file": str(args.prompts),
        "n_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "costs": costs,
        "baseline": baseline,
        "acceptance": acceptance,
        "speculative": speculative,
    }
    print(report(document))
    if args.json is not None:
        write_json(args.json, document)
        print(f"wrote {args.json}")
    if not all(row["exact"] for row in speculative):
        raise CommandError("greedy speculative output differed from the target alone")
    return 0


def report(document: dict[str, Any]) -> str:
    """The benchmark's tables, as text."""
    target = document["costs"]["target"]
    decode = target["decode_ms"]
    cost_rows: list[Sequence[Any]] = [("target decode (1 position)", decode, 1.0)]
    cost_rows += [
        (f"target verify k={k} ({int(k) + 1} positions)", ms, ms / decode)
        for k, ms in target["verify_ms"].items()
    ]
    cost_rows += [
        (f"target batch {b} x 1 position", ms, ms / decode) for b, ms in target["batch_ms"].items()
    ]
    for name, draft in document["costs"]["drafts"].items():
        if "error" in draft:
            cost_rows.append((f"draft {name} ({draft['format']})", "n/a", draft["error"]))
        else:
            cost_rows.append(
                (
                    f"draft {name} ({draft['format']})",
                    draft["ms_per_token"],
                    draft["fraction_of_target_decode"],
                )
            )
    tasks = sorted({t for row in document["acceptance"].values() for t in row if t != "all"})
    acceptance_rows = [
        (name, *(row.get(t, float("nan")) for t in tasks), row["all"])
        for name, row in document["acceptance"].items()
    ]
    base = document["baseline"]
    spec_rows = [("target alone", "-", "-", 1.0, "-", "-", "-", base["tokens_per_s"], 1.0, "yes")]
    spec_rows += [
        (
            row["drafter"],
            row["k"],
            row["alpha"],
            row["tokens_per_pass"],
            row["predicted_tokens_per_pass"],
            row["alpha_eff"],
            row["draft_cost_fraction"],
            row["tokens_per_s"],
            row["speedup"],
            "yes" if row["exact"] else "NO",
        )
        for row in document["speculative"]
    ]
    return "\n\n".join(
        [
            f"target {document['target']}, {document['n_prompts']} prompts, "
            f"up to {document['max_tokens']} new tokens each",
            format_table(("pass", "ms", "x decode"), cost_rows),
            "greedy acceptance alpha (draft top-1 == target top-1 along the target's path)\n"
            + format_table(("drafter", *tasks, "all"), acceptance_rows),
            "speculative decoding, greedy, against the target alone in the same run\n"
            + format_table(
                (
                    "drafter",
                    "k",
                    "alpha",
                    "tok/pass",
                    "E(alpha,k)",
                    "alpha_eff",
                    "draft cost",
                    "tok/s",
                    "speedup",
                    "exact",
                ),
                spec_rows,
            ),
        ]
    )
