"""`specfleet models train-head`: target features over the teacher text, head training, export.

1. Features: one prefill of the target per teacher answer (prompt + answer) reads its `hidden`
   output, cached on disk in fp16 shards, resumable.
2. Training (torch, under a time budget, checkpointed): EAGLE's recipe with EAGLE-3's
   training-time test, on all but a held-out slice of the teacher answers.
   Beside the teacher text (the target's own greedy answers), the head may also read answers
   written by a small draft, with the target's features and greedy choices over them (EAGLE
   trains on text the target did not write; the labels are the target's all the same): four
   times the positions per CPU second, as a prefill costs a sixth of a batched decode step here.
3. Validation: per-position greedy acceptance of chained drafts (the head fed its own features)
   and the tokens per target pass they would make at windows k = 1..8, plus the training curve;
   all written into the weights' record.
4. Export: `models/heads/<name>/weights.npz` built into ONNX and TFLite (inference/feature_head.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from inference.feature_head import F32, HeadConfig, HeadWeights
from modelbuild.head_build import SHIPPED_HEADS

if TYPE_CHECKING:
    from inference.runtime import FeatureRuntime, Runtime
    from modelbuild.distill import TeacherRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadRecipe:
    """One head size: MLP width, reduced vocabulary V', unrolled steps, peak learning rate."""

    name: str
    intermediate_size: int
    n_vocab: int
    unroll: int
    peak_lr: float


RECIPES: dict[str, HeadRecipe] = {
    "small": HeadRecipe("eagle-h1", intermediate_size=1536, n_vocab=8192, unroll=4, peak_lr=1.5e-3),
    "tiny": HeadRecipe("eagle-t1", intermediate_size=768, n_vocab=4096, unroll=3, peak_lr=1e-3),
}
FEATURES_DIR = "head-features"  # under <models>/distill: fp16 shards of target features
EXTRA_FILE = "head-extra.jsonl"  # under <models>/distill: answers written by a draft
EXTRA_DRAFT = "draft-l2"
# Prompt indices of the draft-written answers: apart from the teacher's (from 0) and from the
# held-out evaluation prompts of `specfleet models distill --evaluate` (from 1,000,000).
EXTRA_PROMPT_START = 500_000
SHARD_RECORDS = 64
MAX_SEQUENCE = 1024  # prompt + answer positions read per prefill
VALID_SHARE = 0.03  # the last answers by prompt index: held out for validation
BATCH_ROWS = 2048  # padded positions per training batch: ~400 updates in 45 minutes here
REG_WEIGHT = 1.0  # feature regression against the cross-entropy (both ~1 at the start)
CHECKPOINT_EVERY_S = 90.0
EVAL_EVERY_S = 300.0
EVAL_STARTS = 1500  # chained-draft starts scored at each curve point (all at the end)
MAX_K = 8


# --- features ------------------------------------------------------------------------------------


@dataclass
class FeatureSet:
    """Per answer: the target's features h_{P-2} .. h_{L-2} and the tokens x_{P-1} .. x_{L-1}.

    Row r pairs (features[r], tokens[r]) as a verdict would (h_{n-1}, x_n); the head's step on
    it should give features[r + 1] and the target's greedy token there, labels[r]. In the
    target's own answers labels[r] is tokens[r + 1]; in a draft's, the target's own choice.
    """

    indices: list[int]  # record index of each answer
    features: list[npt.NDArray[np.float16]]  # each [n + 1, H]
    tokens: list[npt.NDArray[np.int64]]  # each [n + 1]
    labels: list[npt.NDArray[np.int64]]  # each [n]

    def __len__(self) -> int:
        return len(self.indices)

    def positions(self) -> int:
        return sum(len(t) - 1 for t in self.tokens)

    def subset(self, keep: Sequence[int]) -> FeatureSet:
        return FeatureSet(
            [self.indices[i] for i in keep],
            [self.features[i] for i in keep],
            [self.tokens[i] for i in keep],
            [self.labels[i] for i in keep],
        )

    def extend(self, other: FeatureSet) -> None:
        self.indices += other.indices
        self.features += other.features
        self.tokens += other.tokens
        self.labels += other.labels


def answer_features(
    target: FeatureRuntime, record: TeacherRecord
) -> tuple[npt.NDArray[np.float16], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """One prefill of prompt + answer: the features, tokens and labels of `FeatureSet`."""
    sequence = (record.prompt_ids + record.answer_ids)[:MAX_SEQUENCE]
    start = len(record.prompt_ids) - 2  # h_{P-2}, beside x_{P-1}
    if start < 0 or len(sequence) < len(record.prompt_ids) + 1:
        raise ValueError(f"teacher answer {record.index} is too short for features")
    (logits, hidden), *_ = target.forward_batch_hidden([(sequence, target.new_cache())])
    features = hidden[start : len(sequence) - 1].astype(np.float16)
    tokens = np.asarray(sequence[start + 1 :], dtype=np.int64)
    labels = logits[start + 1 : len(sequence) - 1].argmax(-1).astype(np.int64)
    return features, tokens, labels


def collect_features(
    target: FeatureRuntime, records: Sequence[TeacherRecord], directory: Path
) -> FeatureSet:
    """Features of every record, read from the shards in `directory` or computed and added."""
    from tqdm import tqdm

    directory.mkdir(parents=True, exist_ok=True)
    done = read_features(directory)
    have = set(done.indices)
    todo = [r for r in records if r.index not in have]
    shard = len(list(directory.glob("shard-*.npz")))
    pending = FeatureSet([], [], [], [])
    bar = tqdm(total=len(todo), unit="answer", desc="features", mininterval=10)
    for record in todo:
        features, tokens, labels = answer_features(target, record)
        pending.extend(FeatureSet([record.index], [features], [tokens], [labels]))
        bar.update()
        if len(pending) == SHARD_RECORDS or record is todo[-1]:
            _write_shard(directory / f"shard-{shard:05d}.npz", pending)
            done.extend(pending)
            pending, shard = FeatureSet([], [], [], []), shard + 1
    bar.close()
    wanted = {r.index for r in records}
    return done.subset([i for i, index in enumerate(done.indices) if index in wanted])


def _write_shard(path: Path, shard: FeatureSet) -> None:
    lengths = [len(t) for t in shard.tokens]
    partial = path.with_suffix(".partial.npz")
    np.savez(
        partial,
        indices=np.asarray(shard.indices, dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        features=np.concatenate(shard.features),
        tokens=np.concatenate(shard.tokens).astype(np.int32),
        labels=np.concatenate([np.append(labels, -1) for labels in shard.labels]).astype(np.int32),
    )
    partial.replace(path)


def read_features(directory: Path) -> FeatureSet:
    found = FeatureSet([], [], [], [])
    for path in sorted(directory.glob("shard-*.npz")):
        if path.name.endswith(".partial.npz"):
            continue
        with np.load(path) as shard:
            offsets = shard["offsets"]
            features, tokens = shard["features"], shard["tokens"].astype(np.int64)
            # Shards written before labels were kept hold the target's own answers only.
            labels = shard["labels"].astype(np.int64) if "labels" in shard else None
            for i, index in enumerate(shard["indices"]):
                found.indices.append(int(index))
                found.features.append(features[offsets[i] : offsets[i + 1]])
                found.tokens.append(tokens[offsets[i] : offsets[i + 1]])
                found.labels.append(
                    found.tokens[-1][1:]
                    if labels is None
                    else labels[offsets[i] : offsets[i + 1] - 1]
                )
    return found


# --- vocabulary ----------------------------------------------------------------------------------


def rank_vocabulary(records: Sequence[TeacherRecord], vocab_size: int, eos_id: int) -> list[int]:
    """Token ids by how often the target emits them in the teacher answers, EOS first."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for record in records:
        np.add.at(counts, np.asarray(record.answer_ids, dtype=np.int64), 1)
    counts[eos_id] = counts.max() + 1
    return [int(i) for i in np.argsort(-counts, kind="stable")]


def coverage(records: Sequence[TeacherRecord], vocab_ids: Sequence[int]) -> float:
    """Share of the teacher's answer tokens inside a reduced vocabulary."""
    inside = np.zeros(max(max(vocab_ids), max(max(r.answer_ids) for r in records)) + 1, bool)
    inside[np.asarray(vocab_ids)] = True
    hits = sum(int(inside[np.asarray(r.answer_ids)].sum()) for r in records)
    return hits / max(sum(len(r.answer_ids) for r in records), 1)


# --- acceptance ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Acceptance:
    """Greedy acceptance of chained drafts from `starts` (h_{n-1}, x_n) pairs, k up to MAX_K."""

    starts: int
    per_position: list[float]  # alpha_i: P(draft i right | drafts 1..i-1 right), i = 1..MAX_K
    tokens_per_pass: list[float]  # k = 1..MAX_K: 1 + E[accepted drafts within the window]

    def to_json(self) -> dict[str, Any]:
        return {
            "starts": self.starts,
            "per_position": [round(a, 4) for a in self.per_position],
            "tokens_per_pass": [round(t, 3) for t in self.tokens_per_pass],
        }


def chain_starts(valid: FeatureSet, limit: int | None, seed: int = 0) -> tuple[F32, np.ndarray]:
    """(features # [n, H], tokens # [n, MAX_K + 1]): every start with MAX_K true tokens after."""
    features, windows = [], []
    for f, t in zip(valid.features, valid.tokens, strict=True):
        for r in range(len(t) - MAX_K):
            features.append(f[r])
            windows.append(t[r : r + MAX_K + 1])
    starts_f = np.asarray(features, dtype=np.float32)
    starts_t = np.asarray(windows, dtype=np.int64)
    if limit is not None and len(starts_t) > limit:
        keep = np.random.default_rng(seed).choice(len(starts_t), size=limit, replace=False)
        starts_f, starts_t = starts_f[keep], starts_t[keep]
    return starts_f, starts_t


def acceptance(
    step: Any, vocab_ids: npt.NDArray[np.int64], features: F32, windows: np.ndarray
) -> Acceptance:
    """Chain `step(features, tokens) -> (next_features, logits)` MAX_K times from every start,
    feeding it its own features and the true tokens, and count the drafts the target keeps."""
    alive = np.ones(len(windows), dtype=bool)
    accepted = np.zeros(len(windows), dtype=np.int64)
    per_position = []
    current = features
    for i in range(MAX_K):
        current, logits = step(current, windows[:, i])
        drafted = vocab_ids[np.asarray(logits).argmax(-1)]
        right = drafted == windows[:, i + 1]
        per_position.append(float(right[alive].mean()) if alive.any() else 0.0)
        alive &= right
        accepted += alive
    tokens_per_pass = [1.0 + float(np.minimum(accepted, k).mean()) for k in range(1, MAX_K + 1)]
    return Acceptance(len(windows), per_position, tokens_per_pass)


# --- training ------------------------------------------------------------------------------------


def _batches(lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Shuffled batches of answers of similar length, each at most BATCH_ROWS padded positions."""
    rng = np.random.default_rng(seed)
    keys = np.asarray(lengths) + rng.uniform(0, 24, size=len(lengths))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in np.argsort(keys):
        longest = max([lengths[i] for i in current] + [lengths[int(index)]])
        if current and longest * (len(current) + 1) > BATCH_ROWS:
            batches.append(current)
            current = []
        current.append(int(index))
    if current:
        batches.append(current)
    rng.shuffle(batches)  # type: ignore[arg-type]
    return batches


def _collate(data: FeatureSet, indices: Sequence[int], to_column: np.ndarray) -> tuple[Any, ...]:
    """Padded features # [B, T+1, H], tokens # [B, T+1], labels # [B, T] and mask # [B, T]."""
    import torch

    longest = max(len(data.tokens[i]) for i in indices)
    hidden = data.features[indices[0]].shape[1]
    features = np.zeros((len(indices), longest, hidden), dtype=np.float16)
    tokens = np.zeros((len(indices), longest), dtype=np.int64)
    mask = np.zeros((len(indices), longest - 1), dtype=bool)
    for row, i in enumerate(indices):
        n = len(data.tokens[i])
        features[row, :n] = data.features[i]
        tokens[row, :n] = data.tokens[i]
        mask[row, : n - 1] = True
    labels = np.full((len(indices), longest - 1), -1, dtype=np.int64)
    for row, i in enumerate(indices):
        labels[row, : len(data.labels[i])] = to_column[data.labels[i]]
    return (
        torch.from_numpy(features.astype(np.float32)),
        torch.from_numpy(tokens),
        torch.from_numpy(labels),
        torch.from_numpy(mask),
    )


def train_head(
    recipe: HeadRecipe,
    train: FeatureSet,
    valid: FeatureSet,
    vocab_ids: Sequence[int],
    work_dir: Path,
    *,
    minutes: float,
    resume: bool,
    threads: int,
    facts: dict[str, Any],
    init: HeadWeights | None = None,
) -> HeadWeights:
    """Train for `minutes` of wall time (checkpointed every CHECKPOINT_EVERY_S; `resume` goes on
    from the last checkpoint), from `init`'s tensors when given (a head trained before, on less
    text: its reduced vocabulary is `vocab_ids`); returns the trained weights with their record."""
    import torch
    from tqdm import tqdm

    from modelbuild.draft_torch import cosine_lr
    from modelbuild.gguf_source import EMBED, NORM, GgufModel
    from modelbuild.head_torch import HeadModel, head_loss

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    directory = work_dir / recipe.name
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint_path = directory / "checkpoint.pt"
    state: dict[str, Any] | None = None
    if resume and checkpoint_path.exists():
        state = torch.load(checkpoint_path, weights_only=False)
        vocab_ids = state["vocab_ids"]
    ids = np.asarray(vocab_ids, dtype=np.int64)

    source = GgufModel()
    target_weights = source.weights(0)
    embed = target_weights[EMBED]
    config = HeadConfig(
        name=recipe.name,
        hidden_size=source.config.d_model,
        intermediate_size=recipe.intermediate_size,
        vocab_size=source.config.vocab_size,
        rms_eps=source.config.rms_eps,
    )
    model = HeadModel(config, embed, embed[ids], target_weights[NORM])
    if init is not None and state is None:
        model.load_tensors(init.tensors)
    target_rows = torch.from_numpy(embed[ids]).t().contiguous()  # [H, V']: the target's head
    to_column = np.full(config.vocab_size, -1, dtype=np.int64)
    to_column[ids] = np.arange(len(ids))
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.peak_lr, weight_decay=0.0)
    elapsed, step, epoch, position = 0.0, 0, 0, 0
    curve: list[dict[str, Any]] = []
    if state:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        elapsed, step, epoch, position = (
            state["elapsed"], state["step"], state["epoch"], state["position"],
        )  # fmt: skip
        curve = state["curve"]

    eval_features, eval_windows = chain_starts(valid, EVAL_STARTS)

    def torch_step(features: F32, tokens: np.ndarray) -> tuple[F32, F32]:
        with torch.no_grad():
            predicted = model.step(torch.from_numpy(features), torch.from_numpy(tokens))
            return predicted.numpy(), model.logits(predicted).numpy()

    def save() -> None:
        partial = checkpoint_path.with_suffix(".partial")
        torch.save(
            {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "vocab_ids": [int(i) for i in ids], "elapsed": elapsed, "step": step,
                "epoch": epoch, "position": position, "curve": curve,
            },
            partial,
        )  # fmt: skip
        partial.replace(checkpoint_path)

    lengths = [len(t) for t in train.tokens]
    total_s = minutes * 60.0
    bar = tqdm(total=int(total_s), initial=int(elapsed), unit="s", desc=recipe.name, mininterval=5)
    last_save = last_eval = time.monotonic()
    window_loss, window_steps, window_hits, window_rows = 0.0, 0, 0, 0
    while elapsed < total_s:
        batches = _batches(lengths, seed=epoch)
        while position < len(batches) and elapsed < total_s:
            started = time.monotonic()
            lr = cosine_lr(recipe.peak_lr, elapsed / total_s)
            for group in optimizer.param_groups:
                group["lr"] = lr
            features, tokens, labels, mask = _collate(train, batches[position], to_column)
            targets = features[:, 1:]
            with torch.no_grad():
                target_logits = (targets[mask] @ target_rows).float()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                predicted = model.unroll(features[:, :-1], tokens[:, :-1], recipe.unroll)
                loss = torch.zeros(())
                for u, guess in enumerate(predicted):
                    chained = mask.clone()
                    chained[:, :u] = False  # rows without a u-step chain were step 0's already
                    rows = chained[mask]
                    flat = guess[mask]
                    part, hits = head_loss(
                        flat[rows], model.logits(flat[rows]), targets[mask][rows],
                        target_logits[rows], labels[mask][rows], REG_WEIGHT,
                    )  # fmt: skip
                    loss = loss + part / recipe.unroll
                    if u == 0:
                        window_hits += int(hits)
                        window_rows += int(rows.sum())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step, position = step + 1, position + 1
            window_loss += float(loss.item())
            window_steps += 1
            elapsed += time.monotonic() - started
            bar.update(int(elapsed) - bar.n)
            bar.set_postfix(loss=f"{loss.item():.3f}", epoch=epoch, lr=f"{lr:.1e}")
            if time.monotonic() - last_save > CHECKPOINT_EVERY_S:
                save()
                last_save = time.monotonic()
            if time.monotonic() - last_eval > EVAL_EVERY_S or elapsed >= total_s:
                point = acceptance(torch_step, ids, eval_features, eval_windows)
                curve.append({
                    "minutes": round(elapsed / 60, 2), "step": step, "epoch": epoch,
                    "loss": round(window_loss / max(window_steps, 1), 4),
                    "train_top1": round(window_hits / max(window_rows, 1), 4),
                    "valid_alpha1": round(point.per_position[0], 4),
                    "valid_tokens_per_pass_k4": round(point.tokens_per_pass[3], 3),
                })  # fmt: skip
                log.info("%s curve %s", recipe.name, curve[-1])
                window_loss, window_steps, window_hits, window_rows = 0.0, 0, 0, 0
                last_eval = time.monotonic()
        if position >= len(batches):
            epoch, position = epoch + 1, 0
    bar.close()
    save()
    all_features, all_windows = chain_starts(valid, None)
    final = acceptance(torch_step, ids, all_features, all_windows)
    record = {
        **facts,
        "recipe": recipe.__dict__,
        "train_minutes": round(elapsed / 60, 1),
        "train_steps": step,
        "epochs": round(epoch + position / max(len(_batches(lengths, epoch)), 1), 2),
        "train_answers": len(train),
        "train_positions": train.positions(),
        "valid_answers": len(valid),
        "valid_indices": sorted(valid.indices),
        "valid": final.to_json(),
        "curve": curve,
    }
    return HeadWeights(config, model.trained_tensors(), ids, record)


# --- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )
    parser.add_argument("--minutes", type=float, default=40.0, help="training minutes")
    parser.add_argument("--size", choices=sorted(RECIPES), default="small", help="which head")
    parser.add_argument(
        "--resume", action="store_true", help="continue training from the last checkpoint"
    )
    parser.add_argument(
        "--init-from", type=Path, default=None, metavar="WEIGHTS",
        help="start from a trained head's weights.npz (the shipped one, to go on with more "
        "teacher text than it had) rather than from the target's own output rows; its reduced "
        "vocabulary is kept",
    )  # fmt: skip
    parser.add_argument(
        "--extra-minutes", type=float, default=0.0,
        help=f"first write more answers with {EXTRA_DRAFT} for this many minutes (resumes; the "
        "target's features and greedy choices over them are trained on beside the teacher text)",
    )  # fmt: skip
    parser.add_argument(
        "--features-only", action="store_true",
        help="compute (or complete) the cached target features, then stop",
    )  # fmt: skip
    parser.add_argument(
        "--export-only", action="store_true",
        help="skip features and training; rebuild ONNX/TFLite from the trained weights",
    )  # fmt: skip
    parser.add_argument(
        "--weights-dir", type=Path, default=SHIPPED_HEADS,
        help=f"where trained weights are written and read (default: {SHIPPED_HEADS})",
    )  # fmt: skip
    parser.add_argument(
        "--evaluate", action="store_true",
        help="afterwards, time a step against a target decode step and score the built ONNX and "
        "TFLite heads on the held-out answers (table, and JSON in <models>/distill)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default: 2)")


def run(args: argparse.Namespace) -> int:
    from core.errors import CommandError

    if args.minutes <= 0 or args.threads < 1 or args.extra_minutes < 0:
        raise CommandError("--minutes must be > 0, --extra-minutes >= 0 and --threads >= 1")
    if args.features_only and args.export_only:
        raise CommandError("--features-only and --export-only exclude each other")
    from inference.artifacts import default_models_dir, sha256_file
    from inference.feature_head import FeatureHeadError, load_head_weights
    from modelbuild.head_build import build_head
    from modelbuild.target_build import ensure_target

    models_dir: Path = args.models_dir or default_models_dir()
    recipe = RECIPES[args.size]
    target_dir = ensure_target(models_dir)
    weights_path: Path = args.weights_dir / recipe.name / "weights.npz"
    if not args.export_only:
        init = None if args.init_from is None else _initial_head(args.init_from, recipe)
        trained = _features_and_training(args, models_dir, target_dir, recipe, init)
        if trained is None:
            return 0
        from inference.feature_head import save_head_weights

        save_head_weights(weights_path, trained)
        print_record(trained.record)
    if not weights_path.exists():
        raise CommandError(f"no trained weights at {weights_path}; run without --export-only")
    try:
        weights = load_head_weights(weights_path)
        built = build_head(
            models_dir, weights, target_dir, weights_sha256=sha256_file(weights_path)
        )
    except FeatureHeadError as exc:
        raise CommandError(str(exc)) from exc
    for directory in built:
        print(f"built {directory.name} in {directory}")
    if args.evaluate:
        report = evaluate_head(models_dir, target_dir, weights)
        path = models_dir / "distill" / f"{recipe.name}-evaluation.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"written to {path}")
    return 0


def step_ms(head: Any, feature: F32, token: int, steps: int = 300) -> float:
    """Median milliseconds of one head step for one sequence (a drafted token)."""
    features = feature.reshape(1, -1)
    for _ in range(20):
        head.step(features, [token])
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        head.step(features, [token])
        times.append(time.perf_counter() - started)
    return round(float(np.median(times)) * 1000, 3)


def evaluate_head(models_dir: Path, target_dir: Path, weights: HeadWeights) -> dict[str, Any]:
    """The built heads' cost per drafted token against the target's one-token decode step (one
    thread each), and their chained greedy acceptance on the held-out answers."""
    from core.report import format_table
    from inference.artifacts import load_manifest
    from inference.feature_head import FeatureHead, find_head
    from modelbuild.distill import decode_ms
    from modelbuild.target_build import load_target

    name = weights.config.name
    target_sha = load_manifest(target_dir).sha256
    held_out = set(weights.record["valid_indices"])
    cache = read_features(models_dir / "distill" / FEATURES_DIR)
    valid = cache.subset([i for i, index in enumerate(cache.indices) if index in held_out])
    starts, windows = chain_starts(valid, None)
    target, tokenizer = load_target(models_dir, threads=1)
    report: dict[str, Any] = {
        "head": name,
        "target": target.name,
        "target_decode_ms": decode_ms(target, tokenizer.apply_chat_template("Describe a river.")),
    }
    del target
    rows = []
    for head_format in ("onnx", "tflite"):
        directory = find_head(models_dir, name, head_format).directory
        head = FeatureHead.load(directory, threads=1, target_sha256=target_sha)
        cost = step_ms(head, starts[0], int(windows[0, 0]))
        scored = acceptance(head.step, head.vocab_ids, starts, windows)
        report[head_format] = {
            "step_ms": cost,
            "step_share_of_target_decode": round(cost / report["target_decode_ms"], 4),
            "size_mb": round(head.manifest.size_bytes / 1e6, 1),
            "valid": scored.to_json(),
        }
        rows.append(
            (f"{name} ({head_format})", cost, f"{cost / report['target_decode_ms']:.1%}",
             f"{scored.per_position[0]:.3f}", f"{scored.tokens_per_pass[3]:.3f}",
             f"{scored.tokens_per_pass[-1]:.3f}")
        )  # fmt: skip
    print(f"target one-token decode: {report['target_decode_ms']} ms (1 thread)")
    print(
        format_table(
            ("head", "step ms", "of target step", "alpha_1", "tok/pass k=4", "tok/pass k=8"), rows
        )
    )
    return report


def _features_and_training(
    args: argparse.Namespace,
    models_dir: Path,
    target_dir: Path,
    recipe: HeadRecipe,
    init: HeadWeights | None,
) -> HeadWeights | None:
    from core.errors import CommandError
    from inference.artifacts import sha256_file
    from inference.tokenizer import ChatTokenizer
    from modelbuild.distill import TEACHER_FILE, read_teacher, teacher_tokens, without_benchmark
    from modelbuild.target_build import load_target

    work = models_dir / "distill"
    tokenizer = ChatTokenizer.load(target_dir)
    records = without_benchmark(read_teacher(work / TEACHER_FILE), tokenizer)
    if not records:
        raise CommandError(
            f"no teacher text in {work / TEACHER_FILE}: run `specfleet models distill "
            "--teacher-only` first"
        )
    records = sorted(records, key=lambda r: r.index)
    extra = extra_answers(models_dir, tokenizer, args.extra_minutes, args.threads, records)
    target, _ = load_target(models_dir, threads=args.threads)
    if not target.has_hidden:
        raise CommandError(f"{target.name} was built without its hidden output; rebuild it")
    features = collect_features(target, records, work / FEATURES_DIR)
    extra_features = collect_features(target, extra, work / FEATURES_DIR)
    del target
    if args.features_only:
        print(
            f"features of {len(features)} teacher answers ({features.positions()} positions) "
            f"and {len(extra_features)} draft answers ({extra_features.positions()} positions)"
        )
        return None
    n_valid = max(8, int(len(features) * VALID_SHARE))
    order = sorted(range(len(features)), key=lambda i: features.indices[i])
    train, valid = features.subset(order[:-n_valid]), features.subset(order[-n_valid:])
    teacher_train_positions = train.positions()
    train.extend(extra_features)
    train_indices = set(train.indices)
    ranked = rank_vocabulary(
        [r for r in records if r.index in train_indices],
        tokenizer.vocab_size,
        tokenizer.eos_id,
    )
    vocab_ids = ranked[: recipe.n_vocab]
    if init is not None:
        vocab_ids = [int(i) for i in init.vocab_ids]
    valid_records = [r for r in records if r.index in set(valid.indices)]
    facts = {
        "teacher_answers": len(records),
        "teacher_tokens": teacher_tokens(records),
        "teacher_train_positions": teacher_train_positions,
        "extra_draft": EXTRA_DRAFT,
        "extra_answers": len(extra),
        "extra_positions": extra_features.positions(),
        "vocab_coverage_valid": {
            str(n): round(coverage(valid_records, ranked[:n]), 4)
            for n in (1024, 2048, 4096, 8192, 16384)
        },
    }
    if init is not None:
        facts["initialised_from"] = {
            "weights_sha256": sha256_file(args.init_from),
            "teacher_tokens": init.record.get("teacher_tokens"),
            "train_minutes": init.record.get("train_minutes"),
            "train_steps": init.record.get("train_steps"),
            "valid": init.record.get("valid"),
        }
        facts["vocab_coverage_kept"] = round(coverage(valid_records, vocab_ids), 4)
    log.info("reduced vocabulary coverage on held-out answers: %s", facts["vocab_coverage_valid"])
    return train_head(
        recipe, train, valid, vocab_ids, work, minutes=args.minutes, resume=args.resume,
        threads=args.threads, facts=facts, init=init,
    )  # fmt: skip


def _initial_head(path: Path, recipe: HeadRecipe) -> HeadWeights:
    """The trained head `--init-from` names, checked against the recipe it goes on with."""
    from core.errors import CommandError
    from inference.feature_head import FeatureHeadError, load_head_weights

    try:
        weights = load_head_weights(path)
    except FeatureHeadError as exc:
        raise CommandError(str(exc)) from exc
    shape = (weights.config.intermediate_size, len(weights.vocab_ids))
    if shape != (recipe.intermediate_size, recipe.n_vocab):
        raise CommandError(
            f"{path} is a head of width {shape[0]} over {shape[1]} tokens; {recipe.name} is "
            f"{recipe.intermediate_size} over {recipe.n_vocab}"
        )
    return weights


def extra_answers(
    models_dir: Path,
    tokenizer: Any,
    minutes: float,
    threads: int,
    teacher: Sequence[TeacherRecord],
) -> list[TeacherRecord]:
    """Answers written greedily by a small draft, after `minutes` more of writing them, to
    prompts that are none of the teacher's (so none of the held-out ones either)."""
    from modelbuild.distill import (
        HELD_OUT_START,
        PROMPT_SEED,
        generate_teacher,
        read_teacher,
        unseen_prompts,
        without_benchmark,
    )
    from modelbuild.teacher_prompts import teacher_prompt

    path = models_dir / "distill" / EXTRA_FILE
    records = read_teacher(path)
    if minutes > 0:
        from inference.drafts import load_draft
        from modelbuild.distill import ensure_drafts
        from modelbuild.target_build import ensure_target

        ensure_drafts(models_dir, ensure_target(models_dir))
        draft = _FullVocabulary(load_draft(models_dir, EXTRA_DRAFT, threads=threads))
        start = max((r.index + 1 for r in records), default=EXTRA_PROMPT_START)
        seen = {teacher_prompt(i, PROMPT_SEED).prompt for i in range(EXTRA_PROMPT_START, start)}
        seen |= {teacher_prompt(r.index, PROMPT_SEED).prompt for r in teacher}
        generate_teacher(
            draft, tokenizer.eos_id, unseen_prompts(tokenizer, start, seen, HELD_OUT_START),
            path, token_budget=10**9, deadline=time.monotonic() + minutes * 60,
        )  # fmt: skip
        records = read_teacher(path)
    return sorted(without_benchmark(records, tokenizer), key=lambda r: r.index)


class _FullVocabulary:
    """A trimmed-head draft whose logits are spread back over the whole vocabulary (-inf
    outside its head), so that text generation reads token ids from argmax columns."""

    def __init__(self, draft: Runtime) -> None:
        from inference.proposers import head_token_ids

        self.draft = draft
        self.name = draft.name
        self.ids = head_token_ids(draft)
        self.vocab_size = 1 + int(self.ids.max()) if self.ids is not None else draft.vocab_size

    def new_cache(self) -> Any:
        return self.draft.new_cache()

    def forward(self, token_ids: Sequence[int], cache: Any) -> F32:
        return self.forward_batch([(token_ids, cache)])[0]

    def forward_batch(self, requests: Sequence[tuple[Sequence[int], Any]]) -> list[F32]:
        results = self.draft.forward_batch(requests)
        if self.ids is None:
            return results
        spread = []
        for logits in results:
            full = np.full((logits.shape[0], self.vocab_size), -np.inf, dtype=np.float32)
            full[:, self.ids] = logits
            spread.append(full)
        return spread


def print_record(record: dict[str, Any]) -> None:
    from core.report import format_table

    valid = record["valid"]
    print(
        f"held-out chained drafts from {valid['starts']} starts "
        f"({record['valid_answers']} answers never trained on)"
    )
    rows = [
        (k, f"{alpha:.3f}", f"{tokens:.3f}")
        for k, (alpha, tokens) in enumerate(
            zip(valid["per_position"], valid["tokens_per_pass"], strict=True), start=1
        )
    ]
    print(format_table(("k", "alpha_k", "tokens/pass at window k"), rows))
    curve = [
        (p["minutes"], p["step"], p["loss"], p["train_top1"], p["valid_alpha1"],
         p["valid_tokens_per_pass_k4"])
        for p in record["curve"]
    ]  # fmt: skip
    print(
        format_table(
            ("min", "step", "loss", "train top-1", "valid alpha_1", "valid tok/pass k=4"), curve
        )
    )
    print("reduced vocabulary coverage (held out):", json.dumps(record["vocab_coverage_valid"]))
    print(
        f"trained on {record['teacher_train_positions']} positions of the target's answers and "
        f"{record['extra_positions']} of {record['extra_draft']}'s"
    )
