"""`specfleet generate`: decode one prompt in this process, target alone or with a drafter."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inference.speculative import DecodeResult

MODES = ("target", "speculative")
DEFAULT_DRAFT = "hybrid"
DEFAULT_MAX_TOKENS = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the user's message")
    parser.add_argument(
        "--mode", choices=MODES, default="speculative", help="target alone, or speculative"
    )
    parser.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help="drafter: lookup, ngram, hybrid, a draft model's name, or hybrid+NAME "
        f"(default: {DEFAULT_DRAFT})",
    )
    parser.add_argument("--k", type=int, default=None, help="tokens drafted per round")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 for greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the K likeliest")
    parser.add_argument("--seed", type=int, default=0, help="sampling is reproducible from it")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )
    parser.add_argument("--ngram", type=Path, default=None, help="n-gram table file")
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads")


def run(args: argparse.Namespace) -> int:
    from core.errors import CommandError
    from inference.artifacts import default_models_dir
    from inference.drafters import (
        DEFAULT_NGRAM_TABLE,
        DrafterError,
        default_k,
        drafter_names,
        make_proposer,
    )
    from inference.sampling import SamplingParams

    if args.max_tokens < 1:
        raise CommandError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.k is not None and args.k < 1:
        raise CommandError(f"--k must be >= 1, got {args.k}")
    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    models_dir: Path = args.models_dir or default_models_dir()
    speculative = args.mode == "speculative"
    if speculative and args.draft not in drafter_names(models_dir):
        known = ", ".join(drafter_names(models_dir))
        raise CommandError(f"unknown drafter {args.draft!r}; known: {known}")
    k = args.k if args.k is not None else default_k(args.draft)

    from inference.speculative import decode_speculative, decode_target
    from modelbuild.target_build import load_target

    target, tokenizer = load_target(models_dir, threads=args.threads)
    proposer = None
    if speculative:
        try:
            proposer = make_proposer(
                args.draft,
                models_dir,
                temperature=params.temperature,
                ngram_path=args.ngram or DEFAULT_NGRAM_TABLE,
                threads=args.threads,
            )
        except DrafterError as exc:
            raise CommandError(str(exc)) from exc
    prompt_ids = tokenizer.apply_chat_template(args.prompt)

    stream = None
    if not args.json:
        detokenizer = tokenizer.detokenizer()

        def stream(tokens: list[int]) -> None:
            text = detokenizer.push([t for t in tokens if t != tokenizer.eos_id])
            sys.stdout.write(text)
            sys.stdout.flush()

    if proposer is None:
        result = decode_target(
            target, prompt_ids, args.max_tokens, params, tokenizer.eos_id, on_tokens=stream
        )
    else:
        result = decode_speculative(
            target, proposer, prompt_ids, k, args.max_tokens, params, tokenizer.eos_id, stream
        )
    text = tokenizer.decode(result.tokens)
    if args.json:
        document = result_document(result, text, prompt_ids, args, k if speculative else 0)
        print(json.dumps(document, indent=2))
    else:
        sys.stdout.write(detokenizer.flush() + "\n")
        print(summary_line(result), file=sys.stderr)
    return 0


def summary_line(result: DecodeResult) -> str:
    n = len(result.tokens)
    rate = n / (result.decode_ms / 1e3) if result.decode_ms > 0 else float("nan")
    return (
        f"{n} tokens in {result.decode_ms:.0f} ms after a {result.prefill_ms:.0f} ms prefill "
        f"({rate:.1f} tok/s); {result.target_passes} target passes, "
        f"{result.tokens_per_pass:.2f} tokens/pass, accepted {result.n_accepted}/"
        f"{result.n_drafted} drafted; stopped by {result.stopped_by}"
    )


def result_document(
    result: DecodeResult, text: str, prompt_ids: list[int], args: argparse.Namespace, k: int
) -> dict[str, Any]:
    return {
        "mode": args.mode,
        "draft": args.draft if args.mode == "speculative" else None,
        "k": k,
        "sampling": {
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "seed": args.seed,
        },
        "prompt": args.prompt,
        "prompt_ids": prompt_ids,
        "token_ids": result.tokens,
        "text": text,
        "stopped_by": result.stopped_by,
        "rounds": [
            {
                "k": r.k,
                "n_accepted": r.n_accepted,
                "draft_ms": round(r.draft_ms, 3),
                "verify_ms": round(r.verify_ms, 3),
            }
            for r in result.rounds
        ],
        "totals": {
            "n_tokens": len(result.tokens),
            "target_passes": result.target_passes,
            "n_drafted": result.n_drafted,
            "n_accepted": result.n_accepted,
            "tokens_per_pass": result.tokens_per_pass,
            "prefill_ms": result.prefill_ms,
            "decode_ms": result.decode_ms,
            "draft_ms": result.draft_ms,
            "verify_ms": result.verify_ms,
            "tokens_per_s": len(result.tokens) / (result.decode_ms / 1e3)
            if result.decode_ms > 0
            else None,
        },
    }
