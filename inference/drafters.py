"""Drafters by name: the built-in lookup, n-gram and hybrid ones, and the neural drafts on disk.

Names: `lookup`, `ngram`, `hybrid` (lookup, then the n-gram table), every draft model and every
feature head in the models directory by its manifest name, and `hybrid+NAME` (lookup, the
table, then that draft or head). A feature head drafts from the target's features, which come
with verdicts; alone, it falls back to `hybrid` while it has none.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference.proposers import (
    FeatureHeadStep,
    FeatureProposer,
    HybridProposer,
    NeuralProposer,
    NGramTable,
    NGramTableProposer,
    PromptLookupProposer,
    Proposer,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from inference.runtime import Runtime

LOOKUP = "lookup"
NGRAM = "ngram"
HYBRID = "hybrid"
BUILTIN_DRAFTERS = (LOOKUP, NGRAM, HYBRID)
HYBRID_PREFIX = "hybrid+"

# Committed beside the code, and rebuilt by `specfleet models build-ngram`.
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_NGRAM_TABLE = REPO_ROOT / "models" / "ngram" / "target-4gram.ngram"

# Settings and windows chosen on bench/prompts/tune.jsonl with the target's greedy answers
# (never on the shared benchmark prompts).
LOOKUP_MAX_NGRAM = 3
LOOKUP_MIN_NGRAM = 1
NGRAM_MIN_CONTEXT = 1
NEURAL_TOP_K = 8  # K of the sparse q' a sampling draft sends
DEFAULT_K = {LOOKUP: 2, NGRAM: 2, HYBRID: 8}
# The hybrid's first tier: a match of 3-4 tokens in the context, whose continuation is copied
# as far as the window lets it; the one tier that may reach past a pass's window
# (`HybridProposer.reaching`).
LONG_MATCH = "lookup-long"
DEFAULT_NEURAL_K = 2
HYBRID_NEURAL_MIN_CONFIDENCE = 0.3
HYBRID_NEURAL_MAX_TOKENS = 2
HYBRID_NEURAL_BEFORE = "lookup-1"  # the copying tier a hybrid's neural draft goes before
# A feature head in a hybrid: where it goes among the copying tiers, its confidence gate, how
# far it drafts, and whether later tiers fill a proposal short of k. Chosen on
# bench/prompts/tune.jsonl with `bench replay`'s rounds (the target's features handed over as
# verdicts carry them), k = 8, the retrained head: tokens per target pass, and the speedup the
# pass costs of `bench models` on this CPU predict (each verified position +2.8% of a decode
# step, a head step 4.6%; the measured 1.44x of the first row came out at 1.436):
#   before ngram-3, gate 0.2, 8 tokens, filled     2.039 tok/pass, 7.0 drafted, ~1.44x
#   before ngram-3, gate 0.2, 8 tokens             2.028, 5.0, ~1.53x
#   before ngram-3, gate 0.3, 4 tokens (shipped)   1.959, 3.2, ~1.65x
#   before lookup-1, gate 0.3, 4 tokens (first)    1.920, 3.8, ~1.64x
# (hybrid alone 1.768; the head first 1.851). Drafting further buys tokens per pass that this
# CPU's passes charge more for than they give.
HYBRID_HEAD_BEFORE = "ngram-3"
HYBRID_HEAD_MIN_CONFIDENCE = 0.3
HYBRID_HEAD_MAX_TOKENS = 4
HYBRID_HEAD_FILL = False
LOOKUP_2_MAX_TOKENS = 5
LOOKUP_1_MAX_TOKENS = 2
# A 3-token table context chains on while its contexts are in the table; past 4 tokens only
# through continuations that make up at least half of what followed their context.
NGRAM_3_GATE_AFTER = 4
NGRAM_3_MIN_SHARE = 0.5


class DrafterError(Exception):
    """An unknown drafter name, or one whose files are missing."""


def draft_model_names(models_dir: Path, vocab: str | None = None) -> list[str]:
    """The manifest name of every built draft: `draft-l2` (ONNX), `draft-l2-tflite` (LiteRT);
    with `vocab`, only the drafts of that vocabulary (a target's `vocab_sha256`)."""
    from inference.artifacts import with_vocab
    from inference.drafts import list_drafts

    return sorted(
        draft.manifest.name
        for draft in list_drafts(models_dir)
        if vocab is None or with_vocab(draft.directory, draft.manifest).vocab_sha256 == vocab
    )


def head_names(models_dir: Path, vocab: str | None = None) -> list[str]:
    """The manifest name of every built feature head: `eagle-h1` (ONNX), `eagle-h1-tflite`;
    with `vocab`, only the heads of that vocabulary."""
    from inference.artifacts import with_vocab
    from inference.feature_head import list_heads

    return sorted(
        head.manifest.name
        for head in list_heads(models_dir)
        if vocab is None or with_vocab(head.directory, head.manifest).vocab_sha256 == vocab
    )


def drafter_names(models_dir: Path, vocab: str | None = None) -> list[str]:
    """The names `make_proposer` accepts for this models directory (and vocabulary)."""
    models = [*draft_model_names(models_dir, vocab), *head_names(models_dir, vocab)]
    return [*BUILTIN_DRAFTERS, *models, *(HYBRID_PREFIX + name for name in models)]


def default_k(name: str) -> int:
    """The window a drafter runs best at (hybrids cap each tier themselves, so they take 8)."""
    if name.startswith(HYBRID_PREFIX):
        return DEFAULT_K[HYBRID]
    return DEFAULT_K.get(name, DEFAULT_NEURAL_K)


def is_head(models_dir: Path, name: str) -> bool:
    """Whether `name` (or the model behind `hybrid+name`) is a built feature head."""
    return name.removeprefix(HYBRID_PREFIX) in head_names(models_dir)


def load_head(models_dir: Path, name: str, threads: int | None = None) -> FeatureHeadStep:
    """A built feature head by manifest name, in the runtime its format needs."""
    from inference.feature_head import FeatureHead, FeatureHeadError, list_heads

    for head in list_heads(models_dir):
        if head.manifest.name == name:
            try:
                return FeatureHead.load(head.directory, threads=threads)
            except FeatureHeadError as exc:
                raise DrafterError(str(exc)) from exc
    known = ", ".join(drafter_names(models_dir))
    raise DrafterError(f"unknown drafter {name!r}; known: {known}")


def load_draft_runtime(models_dir: Path, name: str, threads: int | None = None) -> Runtime:
    """A built draft by manifest name, in the runtime its format needs."""
    from inference.drafts import DraftError, list_drafts, load_draft

    for draft in list_drafts(models_dir):
        if draft.manifest.name == name:
            try:
                return load_draft(models_dir, name, draft.format, threads=threads)
            except DraftError as exc:
                raise DrafterError(str(exc)) from exc
    known = ", ".join(drafter_names(models_dir))
    raise DrafterError(f"unknown drafter {name!r}; known: {known}")


def load_ngram_table(path: Path = DEFAULT_NGRAM_TABLE) -> NGramTable:
    """The table at `path`, loaded once per process and file version and shared read-only by
    every drafter: the shipped table takes seconds to load and tens of MB in memory."""
    if not path.exists():
        raise DrafterError(
            f"no n-gram table at {path}; build it with `specfleet models build-ngram`"
        )
    stat = path.stat()
    return _load_table(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _load_table(path: Path, mtime_ns: int, size: int) -> NGramTable:
    return NGramTable.load(path)


def make_proposer(
    name: str,
    models_dir: Path,
    *,
    temperature: float = 0.0,
    ngram_path: Path = DEFAULT_NGRAM_TABLE,
    threads: int | None = None,
    load_runtime: Callable[[str], Runtime] | None = None,
    load_head_step: Callable[[str], FeatureHeadStep] | None = None,
) -> Proposer:
    """A fresh drafter of the given name; a neural one samples at `temperature` from top-K q'.
    `load_runtime` gives a draft's runtime by name (to share one loaded model between drafters
    with caches of their own), `load_head_step` a feature head (stateless, so any number of
    drafters share one); by default each drafter loads its own."""
    heads = head_names(models_dir)

    def lookup() -> Proposer:
        return PromptLookupProposer(LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM)

    def ngram() -> Proposer:
        return NGramTableProposer(load_ngram_table(ngram_path), min_context=NGRAM_MIN_CONTEXT)

    def neural(draft_name: str, **options: Any) -> NeuralProposer:
        if load_runtime is not None:
            runtime = load_runtime(draft_name)
        else:
            runtime = load_draft_runtime(models_dir, draft_name, threads)
        return NeuralProposer(runtime, temperature=temperature, top_k=NEURAL_TOP_K, **options)

    def head(head_name: str, fallback: Proposer | None, **options: Any) -> FeatureProposer:
        if load_head_step is not None:
            step = load_head_step(head_name)
        else:
            step = load_head(models_dir, head_name, threads)
        return FeatureProposer(
            step, fallback, temperature=temperature, top_k=NEURAL_TOP_K, name=head_name, **options
        )

    if name == LOOKUP:
        return lookup()
    if name == NGRAM:
        return ngram()
    if name == HYBRID:
        return HybridProposer(
            tiered_copying(load_ngram_table(ngram_path)), name=HYBRID, reaching=(LONG_MATCH,)
        )
    if name.startswith(HYBRID_PREFIX):
        # The draft steps in where copying has only weak evidence: after the long matches and
        # the 3-token table contexts, before the 1-token match, for at most a few tokens, and
        # only when it is itself fairly sure of them.
        tiers = tiered_copying(load_ngram_table(ngram_path))
        model = name[len(HYBRID_PREFIX) :]
        if model in heads:
            # A feature head goes further, and earlier: after the matches of two tokens or more
            # (before the table), and what a tier proposes short of k the tiers after it fill
            # (the head chains on through copied tokens). Without a feature the head proposes
            # nothing and the copying tiers go on alone.
            feature_draft = head(
                model,
                None,
                min_confidence=HYBRID_HEAD_MIN_CONFIDENCE,
                min_tokens=0,
                max_tokens=HYBRID_HEAD_MAX_TOKENS,
            )
            at = next(i for i, tier in enumerate(tiers) if tier.name == HYBRID_HEAD_BEFORE)
            return HybridProposer(
                [*tiers[:at], feature_draft, *tiers[at:]],
                fill=HYBRID_HEAD_FILL,
                name=name,
                reaching=(LONG_MATCH,),
            )
        draft = neural(
            model,
            min_confidence=HYBRID_NEURAL_MIN_CONFIDENCE,
            min_tokens=0,
            max_tokens=HYBRID_NEURAL_MAX_TOKENS,
        )
        at = next(i for i, tier in enumerate(tiers) if tier.name == HYBRID_NEURAL_BEFORE)
        return HybridProposer([*tiers[:at], draft, *tiers[at:]], name=name, reaching=(LONG_MATCH,))
    if name in heads:
        # No feature yet (a first round, a rewind, local mode): the hybrid drafts instead.
        fallback = HybridProposer(tiered_copying(load_ngram_table(ngram_path)), name=HYBRID)
        return head(name, fallback)
    return neural(name)


def tiered_copying(table: NGramTable) -> list[Proposer]:
    """Copying drafters from the most to the least reliable evidence, each capped accordingly.

    A long match in the context predicts far ahead; a 3-token table context chains on for as
    long as its contexts are in the table (and, past four tokens, the table is sure of them);
    a single token of either only the next one or two.
    Measured on the tuning prompts with the shipped table, in the hybrid's order (each tier
    proposing only where the ones before it had nothing), the first proposed token is right
    about 0.66 of the time after a 3-4 token match, 0.5 after 2 tokens, 0.47 for a 3-token
    table context (0.37 for draft-l1 next, when it is sure enough), 0.18 after a 1-token match
    and about 0.1 for the shorter table contexts, while verifying a few more positions costs
    the target only a few percent more than a decode step.
    """
    return [
        PromptLookupProposer(4, 3, name=LONG_MATCH),
        PromptLookupProposer(2, 2, max_tokens=LOOKUP_2_MAX_TOKENS, name="lookup-2"),
        NGramTableProposer(
            table,
            min_context=3,
            min_share=NGRAM_3_MIN_SHARE,
            gate_after=NGRAM_3_GATE_AFTER,
            name="ngram-3",
        ),
        PromptLookupProposer(1, 1, max_tokens=LOOKUP_1_MAX_TOKENS, name="lookup-1"),
        NGramTableProposer(table, min_context=2, max_tokens=2, name="ngram-2"),
        NGramTableProposer(table, min_context=1, max_tokens=1, name="ngram-1"),
    ]
