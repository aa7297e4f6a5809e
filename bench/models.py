"""`specfleet bench models`: what drafting costs, how often it is accepted, and what it gains.

In one run, on the same prompts and the same process:
- per-token costs: the target at decode, at verification of k = 1..8 drafted tokens (one pass
  over k+1 positions) and at batches of 1/4/16 sequences, each neural draft per runtime, and
  one step of each feature head per runtime;
- greedy acceptance alpha of each drafter per task type, along the target's own greedy path
  (at each position: does the drafter's first proposed token equal the target's?); a feature
  head is handed the target's features of the path, as verdicts hand them over the bus;
- speculative decoding with each drafter: committed tokens per target pass, the prediction
  E = (1 - alpha^(k+1)) / (1 - alpha) of Leviathan et al. from the measured alpha, alpha_eff
  solved from the measured tokens per pass, the drafter's cost per drafted token as a fraction
  of a target decode step, exactness, and the wall-clock speedup over the target alone, whose
  baseline is measured in the same run.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from core.report import add_json_argument, format_table, int_list, median, write_json
from inference.runtime import KVCache, Logits, Runtime
from localfleet.prompts import DEFAULT_PROMPTS, BenchPrompt, read_prompts

if TYPE_CHECKING:
    from inference.proposers import FeatureHeadStep
    from inference.speculative import DecodeResult

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = Path("bench-results/models.json")
VERIFY_KS = tuple(range(1, 9))
BATCHES = (1, 4, 16)
COST_REPEATS = 12
COST_CONTEXT = 64  # positions already in the cache when a cost is measured


def leviathan_expected_tokens(alpha: float, k: float) -> float:
    """E = (1 - alpha^(k+1)) / (1 - alpha): tokens per target pass for acceptance rate alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - float(alpha ** (k + 1))) / (1.0 - alpha)


def solve_alpha(tokens_per_pass: float, k: float) -> float:
    """The alpha whose E(alpha, k) equals the measured tokens per pass (bisection; E rises).

    k may be fractional: a drafter that proposes fewer than k tokens when unsure is also
    judged at its mean proposal length.
    """
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


@dataclass(frozen=True)
class PassShape:
    """One kind of pass to time: `n_new` positions for each of `batch` sequences."""

    label: str
    runtime: Runtime
    n_new: int
    batch: int = 1


def measure_pass_costs(
    shapes: Sequence[PassShape], repeats: int = COST_REPEATS
) -> dict[str, float]:
    """Median milliseconds of each pass shape, COST_CONTEXT positions deep.

    The shapes take turns, one pass each per repeat, so that load from other processes drifting
    during the measurement touches every shape alike and their ratios stay meaningful.
    """
    caches: dict[str, list[KVCache]] = {}
    for shape in shapes:
        caches[shape.label] = []
        for _ in range(shape.batch):
            cache = shape.runtime.new_cache()
            shape.runtime.forward([1 + i % 100 for i in range(COST_CONTEXT)], cache)
            caches[shape.label].append(cache)
    samples: dict[str, list[float]] = {shape.label: [] for shape in shapes}
    for repeat in range(repeats + 1):  # the first round warms up
        for shape in shapes:
            new = [7] * shape.n_new
            start = time.perf_counter()
            shape.runtime.forward_batch([(new, cache) for cache in caches[shape.label]])
            if repeat:
                samples[shape.label].append((time.perf_counter() - start) * 1e3)
            for cache in caches[shape.label]:
                cache.trim(COST_CONTEXT)
    return {label: median(values) for label, values in samples.items()}


class _NoCache:
    """A head is stateless: its 'cache' holds nothing."""

    length = 0

    def trim(self, length: int) -> None:
        """Nothing to drop."""


class HeadStepPass:
    """One step of a feature head dressed as a one-position pass, so that its cost takes turns
    with the target's and the drafts' in `measure_pass_costs`."""

    def __init__(self, head: FeatureHeadStep) -> None:
        self.head = head
        self.name = head.name
        self.vocab_size = int(head.vocab_ids.shape[0])
        self._feature = np.ones((1, head.hidden_size), dtype=np.float32)

    def new_cache(self) -> _NoCache:
        return _NoCache()

    def forward(self, token_ids: Sequence[int], cache: KVCache) -> Logits:
        _, logits = self.head.step(self._feature, [int(token_ids[-1])])
        return logits

    def forward_batch(self, requests: Sequence[tuple[Sequence[int], KVCache]]) -> list[Logits]:
        return [self.forward(ids, cache) for ids, cache in requests]


@dataclass
class RunTotals:
    """What one decoding configuration produced over all prompts."""

    decode_ms: float = 0.0
    total_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    tokens: int = 0
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    exact: bool = True

    def add(self, result: DecodeResult) -> None:
        """Count one prompt's decoding in."""
        self.decode_ms += result.decode_ms
        self.total_ms += result.total_ms
        self.draft_ms += result.draft_ms
        self.verify_ms += result.verify_ms
        self.tokens += len(result.tokens)
        self.passes += result.target_passes
        self.drafted += result.n_drafted
        self.accepted += result.n_accepted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_argument(parser, DEFAULT_JSON)
    add_drafter_run_arguments(parser)


def add_drafter_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What the benchmarks of drafters on a prompt set share: prompts, drafters, windows."""
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


class DrafterRun(NamedTuple):
    """The checked arguments of a benchmark of drafters on a prompt set."""

    prompts: list[BenchPrompt]
    models_dir: Path
    names: list[str]
    windows: list[int] | None  # None: each drafter's own k


def drafter_run(args: argparse.Namespace) -> DrafterRun:
    """Prompts, models directory, drafter names and windows from `add_drafter_run_arguments`,
    each checked; a bad one is a CommandError."""
    from core.errors import CommandError
    from inference.artifacts import default_models_dir
    from inference.drafters import drafter_names

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
    windows = None if args.k is None else int_list(args.k, "--k")
    return DrafterRun(prompts, models_dir, names, windows)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from core.errors import CommandError
    from inference.drafters import (
        DrafterError,
        default_k,
        load_draft_runtime,
        load_head,
        make_proposer,
    )
    from inference.drafts import list_drafts
    from inference.feature_head import list_heads
    from inference.proposers import wants_features
    from inference.sampling import SamplingParams
    from inference.speculative import decode_speculative, decode_target, greedy_acceptance
    from modelbuild.target_build import load_target

    prompts, models_dir, names, windows = drafter_run(args)

    greedy = SamplingParams(temperature=0.0)
    target, tokenizer = load_target(models_dir, threads=args.threads)
    eos = tokenizer.eos_id
    prompt_ids = [tokenizer.apply_chat_template(p.prompt) for p in prompts]

    drafts = list_drafts(models_dir)
    draft_runtimes: dict[str, Runtime] = {}
    draft_errors: dict[str, str] = {}
    for draft in drafts:
        try:
            draft_runtimes[draft.manifest.name] = load_draft_runtime(
                models_dir, draft.manifest.name, args.threads
            )
        except (DrafterError, ImportError) as exc:
            # A runtime that cannot load here (no LiteRT wheel, say) is reported, not fatal.
            draft_errors[draft.manifest.name] = str(exc)
    shapes = [PassShape("decode", target, 1)]
    shapes += [PassShape(f"verify-{k}", target, k + 1) for k in VERIFY_KS]
    shapes += [PassShape(f"batch-{b}", target, 1, b) for b in BATCHES]
    shapes += [PassShape(f"draft-{name}", rt, 1) for name, rt in draft_runtimes.items()]
    heads = list_heads(models_dir)
    head_steps: dict[str, Runtime] = {}
    for head in heads:
        try:
            head_steps[head.manifest.name] = HeadStepPass(
                load_head(models_dir, head.manifest.name, args.threads)
            )
        except (DrafterError, ImportError) as exc:
            draft_errors[head.manifest.name] = str(exc)
    shapes += [PassShape(f"head-{name}", step, 1) for name, step in head_steps.items()]
    print(f"timing {len(shapes)} pass shapes, {COST_REPEATS} turns each ...")
    cost_ms = measure_pass_costs(shapes)
    decode_ms = cost_ms["decode"]
    costs: dict[str, Any] = {
        "target": {
            "decode_ms": decode_ms,
            "verify_ms": {str(k): cost_ms[f"verify-{k}"] for k in VERIFY_KS},
            "batch_ms": {str(b): cost_ms[f"batch-{b}"] for b in BATCHES},
        },
        "drafts": {},
    }
    for draft in drafts:
        name = draft.manifest.name
        if name in draft_errors:
            costs["drafts"][name] = {"format": draft.format, "error": draft_errors[name]}
        else:
            ms = cost_ms[f"draft-{name}"]
            costs["drafts"][name] = {
                "format": draft.format,
                "head_size": draft_runtimes[name].vocab_size,
                "ms_per_token": ms,
                "fraction_of_target_decode": ms / decode_ms,
            }

    costs["heads"] = {}
    for head in heads:
        name = head.manifest.name
        if name in draft_errors:
            costs["heads"][name] = {"format": head.format, "error": draft_errors[name]}
        else:
            ms = cost_ms[f"head-{name}"]
            costs["heads"][name] = {
                "format": head.format,
                "head_size": head_steps[name].vocab_size,
                "ms_per_token": ms,
                "fraction_of_target_decode": ms / decode_ms,
            }

    def proposer(name: str) -> Any:
        try:
            return make_proposer(name, models_dir, threads=args.threads)
        except DrafterError as exc:
            raise CommandError(str(exc)) from exc

    # Decoding: the target alone and every (drafter, k) take turns on each prompt, the order
    # rotating from prompt to prompt, so that drifting load affects the baseline like the rest.
    configs: list[tuple[str, int]] = [("", 0)]
    configs += [(name, k) for name in names for k in (windows or [default_k(name)])]
    drafters = {config: proposer(config[0]) for config in configs[1:]}
    totals = {config: RunTotals() for config in configs}
    baseline_tokens: list[list[int]] = []
    for index, ids in enumerate(tqdm(prompt_ids, desc="decoding", unit="prompt")):
        turn = configs[index % len(configs) :] + configs[: index % len(configs)]
        outputs: dict[tuple[str, int], list[int]] = {}
        for config in turn:
            if config == ("", 0):
                result = decode_target(target, ids, args.max_tokens, greedy, eos)
            else:
                result = decode_speculative(
                    target, drafters[config], ids, config[1], args.max_tokens, greedy, eos
                )
            outputs[config] = result.tokens
            totals[config].add(result)
        baseline_tokens.append(outputs[("", 0)])
        for config in configs[1:]:
            totals[config].exact &= outputs[config] == outputs[("", 0)]

    base = totals[("", 0)]
    baseline = {
        "tokens": base.tokens,
        "decode_s": base.decode_ms / 1e3,
        "total_s": base.total_ms / 1e3,
        "tokens_per_s": base.tokens / (base.decode_ms / 1e3),
        "decode_ms_per_token": base.decode_ms / base.tokens,
    }

    # Acceptance along the target's greedy path (no timing, so it needs no interleaving); a
    # feature drafter gets the target's features of the path at each position.
    acceptance: dict[str, dict[str, float]] = {}
    for name in names:
        drafter = proposer(name)
        feature_drafting = wants_features(drafter)
        per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for prompt, ids, tokens in tqdm(
            list(zip(prompts, prompt_ids, baseline_tokens, strict=True)),
            desc=f"alpha {name}",
            unit="prompt",
        ):
            hidden = None
            if feature_drafting:
                path = [*ids, *tokens]
                ((_, hidden),) = target.forward_batch_hidden([(path, target.new_cache())])
            matches, positions = greedy_acceptance(drafter, ids, tokens, hidden=hidden)
            per_task[prompt.task][0] += matches
            per_task[prompt.task][1] += positions
        acceptance[name] = {task: m / n for task, (m, n) in sorted(per_task.items()) if n}
        all_m = sum(m for m, _ in per_task.values())
        all_n = sum(n for _, n in per_task.values())
        acceptance[name]["all"] = all_m / all_n if all_n else 0.0

    speculative: list[dict[str, Any]] = []
    for (name, k), t in ((c, totals[c]) for c in configs[1:]):
        alpha = acceptance[name]["all"]
        tokens_per_pass = t.tokens / t.passes
        draft_ms_per_token = t.draft_ms / t.drafted if t.drafted else float("nan")
        speculative.append(
            {
                "drafter": name,
                "k": k,
                "exact": t.exact,
                "alpha": alpha,
                "tokens_per_pass": tokens_per_pass,
                "predicted_tokens_per_pass": leviathan_expected_tokens(alpha, k),
                "alpha_eff": solve_alpha(tokens_per_pass, k),
                "alpha_eff_at_mean_draft": solve_alpha(tokens_per_pass, t.drafted / t.passes),
                "drafted_per_pass": t.drafted / t.passes,
                "drafted": t.drafted,
                "accepted": t.accepted,
                "acceptance_of_drafted": t.accepted / t.drafted if t.drafted else 0.0,
                "draft_ms_per_token": draft_ms_per_token,
                "draft_cost_fraction": draft_ms_per_token / baseline["decode_ms_per_token"],
                "verify_ms_per_pass": t.verify_ms / t.passes,
                "decode_s": t.decode_ms / 1e3,
                "total_s": t.total_ms / 1e3,
                "tokens_per_s": t.tokens / (t.decode_ms / 1e3),
                "speedup": base.decode_ms / t.decode_ms,
                "speedup_with_prefill": base.total_ms / t.total_ms,
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
    models = [("draft", document["costs"]["drafts"]), ("head", document["costs"].get("heads", {}))]
    for kind, built in models:
        for name, draft in built.items():
            label = f"{kind} {name} ({draft['format']})"
            if "error" in draft:
                cost_rows.append((label, "n/a", draft["error"]))
            else:
                cost_rows.append((label, draft["ms_per_token"], draft["fraction_of_target_decode"]))
    tasks = sorted({t for row in document["acceptance"].values() for t in row if t != "all"})
    acceptance_rows = [
        (name, *(row.get(t, float("nan")) for t in tasks), row["all"])
        for name, row in document["acceptance"].items()
    ]
    base = document["baseline"]
    spec_rows = [
        ("target alone", "-", "-", "-", 1.0, "-", "-", "-", "-", base["tokens_per_s"], 1.0, "yes")
    ]
    spec_rows += [
        (
            row["drafter"],
            row["k"],
            row["alpha"],
            row["drafted_per_pass"],
            row["tokens_per_pass"],
            row["predicted_tokens_per_pass"],
            row["alpha_eff"],
            row["alpha_eff_at_mean_draft"],
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
            "speculative decoding, greedy, against the target alone in the same run (draft cost:\n"
            "ms per drafted token / ms per target decode step; speedup: decode wall clock)\n"
            + format_table(
                (
                    "drafter",
                    "k",
                    "alpha",
                    "drafted/pass",
                    "tok/pass",
                    "E(alpha,k)",
                    "alpha_eff",
                    "(at drafted/pass)",
                    "draft cost",
                    "tok/s",
                    "speedup",
                    "exact",
                ),
                spec_rows,
            ),
        ]
    )
