"""`specfleet models distill`: teacher text from the target, draft training, ONNX/TFLite export."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from inference.runtime import Runtime
    from inference.tokenizer import ChatTokenizer
    from modelbuild.gguf_source import GgufModel, QuantizedMatrix

log = logging.getLogger(__name__)

TEACHER_FILE = "teacher.jsonl"
TEACHER_TARGET_FILE = "teacher-target.onnx"
TEACHER_TOP_K = 4  # soft labels kept per answer position
PROMPT_SEED = 0
# Prompts past this index are never used for training: the held-out agreement set.
HELD_OUT_START = 1_000_000


@dataclass
class TeacherRecord:
    """One prompt answered greedily by the target, with its top-k distribution per answer token."""

    index: int
    task: str
    prompt_ids: list[int]
    answer_ids: list[int]
    top_ids: list[list[int]]  # [len(answer_ids)][TEACHER_TOP_K]
    top_probs: list[list[float]]  # [len(answer_ids)][TEACHER_TOP_K]

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> TeacherRecord:
        return cls(**json.loads(line))


def read_teacher(path: Path) -> list[TeacherRecord]:
    """Every complete record; a torn last line (a crash mid-write) is ignored."""
    if not path.exists():
        return []
    records: list[TeacherRecord] = []
    with path.open() as stream:
        for line in stream:
            if line.endswith("\n"):
                records.append(TeacherRecord.from_json(line))
    return records


def without_benchmark(
    records: Sequence[TeacherRecord], tokenizer: ChatTokenizer
) -> list[TeacherRecord]:
    """The records whose prompt is not a benchmark prompt.

    Teacher files written before the stream skipped benchmark prompts hold answers to some of
    them; training or counting on those would inflate the acceptance measured on them.
    """
    from modelbuild.teacher_prompts import benchmark_prompts

    banned = {tuple(tokenizer.apply_chat_template(text)) for text in benchmark_prompts()}
    kept = [record for record in records if tuple(record.prompt_ids) not in banned]
    if len(kept) < len(records):
        log.warning("left out %d teacher answers to benchmark prompts", len(records) - len(kept))
    return kept


def teacher_tokens(records: Sequence[TeacherRecord]) -> int:
    return sum(len(record.answer_ids) for record in records)


def _top_k(logits: npt.NDArray[np.float32], k: int) -> tuple[list[int], list[float]]:
    ids = np.argpartition(-logits, k)[:k]
    ids = ids[np.argsort(-logits[ids])]
    shifted = logits - logits.max()
    probs = np.exp(shifted[ids]) / np.exp(shifted).sum()
    return [int(i) for i in ids], [round(float(p), 4) for p in probs]


@dataclass
class _Slot:
    """A sequence being answered inside the teacher batch."""

    index: int
    task: str
    prompt_ids: list[int]
    cache: Any
    answer_ids: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_probs: list[list[float]] = field(default_factory=list)

    def push(self, logits: npt.NDArray[np.float32]) -> int:
        ids, probs = _top_k(logits, TEACHER_TOP_K)
        self.answer_ids.append(ids[0])
        self.top_ids.append(ids)
        self.top_probs.append(probs)
        return ids[0]

    def record(self) -> TeacherRecord:
        return TeacherRecord(
            self.index, self.task, self.prompt_ids, self.answer_ids, self.top_ids, self.top_probs
        )


def generate_teacher(
    target: Runtime,
    eos_id: int,
    prompts: Iterator[tuple[int, str, list[int]]],
    out_path: Path,
    *,
    token_budget: int,
    batch_size: int = 32,
    max_new_tokens: int = 200,
    deadline: float | None = None,
) -> int:
    """Answer prompts greedily with the target, appending one record per answer to `out_path`.

    `prompts` yields (index, task, chat-templated ids). Continuous batching: finished answers'
    slots are refilled in groups, and new prompts are prefilled together, apart from the decode
    batch, so that one long prompt does not pad every decode row. Returns the answer tokens
    written.
    """
    from tqdm import tqdm

    eos = eos_id
    written = answers = 0
    slots: list[_Slot] = []
    exhausted = False
    bar = tqdm(total=token_budget, unit="tok", desc="teacher", mininterval=10)

    def advance(tokens: int) -> None:
        """The bar counts tokens as they are decoded (every one is written with its answer); an
        answer in flight when the budget is reached runs past it, and the bar's total with it."""
        bar.update(tokens)
        if bar.n > bar.total:
            bar.total = bar.n

    def expected() -> float:
        """Tokens written plus those the answers in flight are expected to bring: a prompt is
        taken only while this is under the budget, so a small budget is not overrun by a whole
        batch of answers (400 asked for once gave 4,515)."""
        mean = written / answers if answers else max_new_tokens / 2
        return written + sum(max(len(s.answer_ids), mean) for s in [*slots, *fresh])

    with out_path.open("a") as sink:
        while True:
            out_of_time = deadline is not None and time.monotonic() > deadline
            fresh: list[_Slot] = []
            if not exhausted and not out_of_time and written < token_budget:
                # Refill in groups: a prefill pass for one prompt costs nearly as much as for many.
                refill = len(slots) <= batch_size - max(1, batch_size // 4)
                while refill and len(slots) + len(fresh) < batch_size and expected() < token_budget:
                    item = next(prompts, None)
                    if item is None:
                        exhausted = True
                        break
                    index, task, ids = item
                    fresh.append(_Slot(index, task, ids, target.new_cache()))
                if fresh:
                    logits = target.forward_batch([(s.prompt_ids, s.cache) for s in fresh])
                    for slot, rows in zip(fresh, logits, strict=True):
                        slot.push(rows[-1])
                    advance(len(fresh))
                    slots += fresh
            if not slots:
                break
            done = [
                s for s in slots if s.answer_ids[-1] == eos or len(s.answer_ids) >= max_new_tokens
            ]
            for slot in done:
                sink.write(slot.record().to_json() + "\n")
                written += len(slot.answer_ids)
                answers += 1
            if done:
                sink.flush()
                finished = {id(s) for s in done}
                slots = [s for s in slots if id(s) not in finished]
                continue
            logits = target.forward_batch([([s.answer_ids[-1]], s.cache) for s in slots])
            for slot, rows in zip(slots, logits, strict=True):
                slot.push(rows[-1])
            advance(len(slots))
    bar.close()
    return written


def unseen_prompts(
    tokenizer: ChatTokenizer, start: int, seen: set[str], stop: int | None = None
) -> Iterator[tuple[int, str, list[int]]]:
    """Generated prompts from index `start` whose text is not in `seen` (templates repeat) and
    is not a benchmark prompt."""
    from modelbuild.teacher_prompts import benchmark_prompts, teacher_prompt

    seen |= benchmark_prompts()
    index = start
    while stop is None or index < stop:
        prompt = teacher_prompt(index, PROMPT_SEED)
        if prompt.prompt not in seen:
            seen.add(prompt.prompt)
            yield index, prompt.task, tokenizer.apply_chat_template(prompt.prompt)
        index += 1


@dataclass(frozen=True)
class DraftRecipe:
    """One draft size: target blocks kept, head rows, share of the training time, peak lr."""

    name: str
    n_layers: int
    head_size: int
    time_share: float
    peak_lr: float


RECIPES: dict[str, DraftRecipe] = {
    "draft-l2": DraftRecipe("draft-l2", n_layers=2, head_size=8192, time_share=0.6, peak_lr=3e-4),
    "draft-l1": DraftRecipe("draft-l1", n_layers=1, head_size=4096, time_share=0.4, peak_lr=5e-4),
}
SIZES: dict[str, tuple[str, ...]] = {
    "small": ("draft-l2",),
    "tiny": ("draft-l1",),
    "all": ("draft-l2", "draft-l1"),
}
MAX_SEQ_LEN = 512
BATCH_TOKENS = 4096  # padded tokens per training batch
VALID_SHARE = 0.02  # last records by prompt index: a validation split for the training log
CHECKPOINT_EVERY_S = 90.0
HEAD_LR_SCALE = 2.0
VOCAB_CAP = 1 << 18  # above every supported vocabulary (Qwen2's is 151,936)


def choose_head_ids(
    records: Sequence[TeacherRecord], size: int, eos_id: int, vocab_size: int = VOCAB_CAP
) -> list[int]:
    """The `size` ids the target emits most often (greedy), EOS always in; sorted by id. A head
    at least as large as the vocabulary is the whole vocabulary."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    size = min(size, vocab_size)
    for record in records:
        np.add.at(counts, np.asarray(record.answer_ids, dtype=np.int64), 1)
    counts[eos_id] = counts.max() + 1
    order = np.argsort(-counts, kind="stable")[:size]
    return sorted(int(i) for i in order)


@dataclass
class TrainingExamples:
    """Teacher records as padded tensors-to-be, grouped into batches of similar length."""

    sequences: list[npt.NDArray[np.int64]]  # each [length]
    answer_starts: list[int]  # position whose logits predict the first answer token
    hard: list[npt.NDArray[np.int64]]  # each [n_answer]: head index or -1
    soft_ids: list[npt.NDArray[np.int64]]  # each [n_answer, k]: head index or -1
    soft_probs: list[npt.NDArray[np.float32]]  # each [n_answer, k]


def training_examples(
    records: Sequence[TeacherRecord], head_ids: Sequence[int]
) -> TrainingExamples:
    to_head = np.full(VOCAB_CAP, -1, dtype=np.int64)
    to_head[np.asarray(head_ids)] = np.arange(len(head_ids))
    examples = TrainingExamples([], [], [], [], [])
    for record in records:
        sequence = np.asarray(record.prompt_ids + record.answer_ids, dtype=np.int64)[:MAX_SEQ_LEN]
        start = len(record.prompt_ids) - 1
        n_answer = len(sequence) - 1 - start
        if n_answer <= 0:
            continue
        examples.sequences.append(sequence)
        examples.answer_starts.append(start)
        examples.hard.append(to_head[np.asarray(record.answer_ids[:n_answer])])
        examples.soft_ids.append(to_head[np.asarray(record.top_ids[:n_answer])])
        examples.soft_probs.append(np.asarray(record.top_probs[:n_answer], dtype=np.float32))
    return examples


def batch_order(lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Shuffled batches of examples of similar length, each at most BATCH_TOKENS padded tokens."""
    rng = np.random.default_rng(seed)
    # Sort by length with noise, so batches pad little but still differ from epoch to epoch.
    keys = np.asarray(lengths) + rng.uniform(0, 24, size=len(lengths))
    order = np.argsort(keys)
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = max([lengths[i] for i in current] + [lengths[index]])
        if current and longest * (len(current) + 1) > BATCH_TOKENS:
            batches.append(current)
            current = []
        current.append(int(index))
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def _collate(examples: TrainingExamples, indices: Sequence[int]) -> tuple[Any, ...]:
    import torch

    longest = max(len(examples.sequences[i]) for i in indices)
    input_ids = np.zeros((len(indices), longest), dtype=np.int64)
    rows, cols = [], []
    for row, i in enumerate(indices):
        sequence = examples.sequences[i]
        input_ids[row, : len(sequence)] = sequence
        n = len(examples.hard[i])
        rows.append(np.full(n, row))
        cols.append(np.arange(examples.answer_starts[i], examples.answer_starts[i] + n))
    return (
        torch.from_numpy(input_ids),
        torch.from_numpy(np.concatenate(rows)),
        torch.from_numpy(np.concatenate(cols)),
        torch.from_numpy(np.concatenate([examples.hard[i] for i in indices])),
        torch.from_numpy(np.concatenate([examples.soft_ids[i] for i in indices])),
        torch.from_numpy(np.concatenate([examples.soft_probs[i] for i in indices])),
    )


def top1_agreement(model: Any, examples: TrainingExamples, limit: int = 64) -> float:
    """Share of answer positions where the draft's argmax is the target's greedy token."""
    import torch

    hits = total = 0
    with torch.no_grad():
        for i in range(min(limit, len(examples.sequences))):
            input_ids, rows, cols, hard, _, _ = _collate(examples, [i])
            predicted = model(input_ids)[rows, cols].argmax(-1)
            hits += int(((predicted == hard) & (hard >= 0)).sum())
            total += len(hard)
    return hits / max(total, 1)


def train_draft(
    recipe: DraftRecipe,
    records: Sequence[TeacherRecord],
    work_dir: Path,
    *,
    minutes: float,
    resume: bool,
    eos_id: int,
    source: GgufModel | None = None,
) -> Path:
    """Fine-tune the draft for `minutes` of wall time; returns the trained weights (.npz).

    The draft starts from the first blocks of `source`, the target's GGUF (default: SmolLM2's).

    Checkpoints every CHECKPOINT_EVERY_S; with `resume`, training goes on from the last one (its
    head ids and elapsed time included) instead of starting over.
    """
    import torch
    from tqdm import tqdm

    from modelbuild.draft_torch import DraftModel, cosine_lr, distill_loss
    from modelbuild.gguf_source import EMBED, HEAD, NORM, GgufModel

    source = source or GgufModel()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    directory = work_dir / recipe.name
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint_path = directory / "checkpoint.pt"
    state: dict[str, Any] | None = None
    if resume and checkpoint_path.exists():
        state = torch.load(checkpoint_path, weights_only=False)
    vocab_size = source.config.vocab_size
    head_ids = (
        state["head_ids"]
        if state
        else choose_head_ids(records, recipe.head_size, eos_id, vocab_size)
    )
    config = source.config.with_layers(recipe.n_layers)
    target = source.weights(recipe.n_layers)
    embed = target.pop(EMBED)
    target[HEAD] = embed[np.asarray(head_ids)]
    model = DraftModel(config, target, embed)
    # The head and final norm start from the target's, tuned for layer 30's features; they have the
    # most to relearn, so they move faster than the blocks.
    head_params = [model.head, model.norm.weight]
    block_params = [p for p in model.parameters() if all(p is not h for h in head_params)]
    optimizer = torch.optim.AdamW(
        [
            {"params": block_params, "lr_scale": 1.0},
            {"params": head_params, "lr_scale": HEAD_LR_SCALE},
        ],
        lr=recipe.peak_lr,
        weight_decay=0.0,
    )
    elapsed, step, epoch, position = 0.0, 0, 0, 0
    if state:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        elapsed, step, epoch, position = (
            state["elapsed"],
            state["step"],
            state["epoch"],
            state["position"],
        )

    ordered = sorted(records, key=lambda r: r.index)
    n_valid = max(8, int(len(ordered) * VALID_SHARE))
    train = training_examples(ordered[:-n_valid], head_ids)
    valid = training_examples(ordered[-n_valid:], head_ids)
    lengths = [len(s) for s in train.sequences]
    total_s = minutes * 60.0

    def save() -> None:
        partial = checkpoint_path.with_suffix(".partial")
        torch.save(
            {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "head_ids": head_ids, "elapsed": elapsed, "step": step, "epoch": epoch,
                "position": position,
            },
            partial,
        )  # fmt: skip
        partial.replace(checkpoint_path)

    bar = tqdm(total=int(total_s), initial=int(elapsed), unit="s", desc=recipe.name, mininterval=5)
    last_save = time.monotonic()
    while elapsed < total_s:
        batches = batch_order(lengths, seed=epoch)
        while position < len(batches) and elapsed < total_s:
            started = time.monotonic()
            lr = cosine_lr(recipe.peak_lr, elapsed / total_s)
            for group in optimizer.param_groups:
                group["lr"] = lr * group["lr_scale"]
            input_ids, rows, cols, hard, soft_ids, soft_probs = _collate(train, batches[position])
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids)
            loss = distill_loss(logits[rows, cols], hard, soft_ids, soft_probs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            position += 1
            spent = time.monotonic() - started
            elapsed += spent
            bar.update(int(elapsed) - bar.n)
            bar.set_postfix(loss=f"{loss.item():.3f}", epoch=epoch, lr=f"{lr:.1e}")
            if time.monotonic() - last_save > CHECKPOINT_EVERY_S:
                save()
                last_save = time.monotonic()
                log.info(
                    "%s step %d epoch %d valid top-1 %.3f",
                    recipe.name,
                    step,
                    epoch,
                    top1_agreement(model, valid),
                )
        if position >= len(batches):
            epoch, position = epoch + 1, 0
    bar.close()
    save()
    agreement = top1_agreement(model, valid, limit=len(valid.sequences))
    log.info("%s done: %d steps, %d epochs, valid top-1 %.3f", recipe.name, step, epoch, agreement)
    weights_path = directory / "weights.npz"
    save_draft_weights(weights_path, model.trained_weights(), head_ids, recipe, {
        "train_minutes": round(elapsed / 60, 1), "train_steps": step,
        "teacher_tokens": teacher_tokens(records), "teacher_answers": len(records),
        "valid_top1": round(agreement, 4),
    })  # fmt: skip
    del NORM
    return weights_path


def save_draft_weights(
    path: Path,
    weights: dict[str, npt.NDArray[np.float32]],
    head_ids: Sequence[int],
    recipe: DraftRecipe,
    facts: dict[str, Any],
) -> None:
    """The trained tensors in fp16 (what the exports ship), head ids and training facts."""
    arrays: dict[str, npt.NDArray[Any]] = {
        name: w.astype(np.float16) for name, w in weights.items()
    }
    arrays["head_ids"] = np.asarray(head_ids, dtype=np.int32)
    meta = {"name": recipe.name, "n_layers": recipe.n_layers, **facts}
    arrays["meta_json"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    partial = path.with_suffix(".partial.npz")
    np.savez(partial, **arrays)  # type: ignore[arg-type]
    partial.replace(path)


def q8_embedding(model: Any, embed_q8: Any) -> Any:
    """Swap the fp32 embedding Gather for the target's q8_0 blocks: int8 rows times block scales.

    The same arithmetic as the TFLite export, and a quarter of the bytes.
    """
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    if len(gathers) != 1:
        raise ValueError("expected exactly one embedding Gather on input_ids")
    gather = gathers[0]
    table = gather.input[0]
    codes = (embed_q8.codes.astype(np.int16) - 128).astype(np.int8).reshape(embed_q8.rows, -1)
    blocks, d_model = embed_q8.n_blocks, embed_q8.cols
    inits = [
        numpy_helper.from_array(codes, "embed_q8_codes"),
        numpy_helper.from_array(embed_q8.scales.astype(np.float32), "embed_q8_scales"),
        numpy_helper.from_array(np.asarray([0, 0, blocks, 32], np.int64), "embed_q8_blocks"),
        numpy_helper.from_array(np.asarray([0, 0, d_model], np.int64), "embed_q8_rows"),
        numpy_helper.from_array(np.asarray([-1], np.int64), "embed_q8_last"),
    ]
    out = gather.output[0]
    nodes = [
        helper.make_node("Gather", ["embed_q8_codes", "input_ids"], ["embed_q8_g"], axis=0),
        helper.make_node("Cast", ["embed_q8_g"], ["embed_q8_f"], to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["embed_q8_f", "embed_q8_blocks"], ["embed_q8_b"]),
        helper.make_node("Gather", ["embed_q8_scales", "input_ids"], ["embed_q8_s"], axis=0),
        helper.make_node("Unsqueeze", ["embed_q8_s", "embed_q8_last"], ["embed_q8_s1"]),
        helper.make_node("Mul", ["embed_q8_b", "embed_q8_s1"], ["embed_q8_m"]),
        helper.make_node("Reshape", ["embed_q8_m", "embed_q8_rows"], [out]),
    ]
    position = list(graph.node).index(gather)
    rebuilt = [*list(graph.node)[:position], *nodes, *list(graph.node)[position + 1 :]]
    del graph.node[:]
    graph.node.extend(rebuilt)
    remaining = [t for t in graph.initializer if t.name != table]
    del graph.initializer[:]
    graph.initializer.extend(remaining + inits)
    return model


def fp16_weights(model: Any, min_elements: int = 4096) -> Any:
    """Store large fp32 initializers as fp16 behind a Cast, halving the file.

    ONNX Runtime folds the Cast when it loads the session, so compute stays fp32 and the values
    are exactly the fp16 ones the TFLite export holds.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    kept, added, casts = [], [], []
    for tensor in graph.initializer:
        if tensor.data_type != TensorProto.FLOAT or int(np.prod(tensor.dims)) < min_elements:
            kept.append(tensor)
            continue
        values = numpy_helper.to_array(tensor).astype(np.float16)
        added.append(numpy_helper.from_array(values, tensor.name + "_fp16"))
        casts.append(
            helper.make_node("Cast", [tensor.name + "_fp16"], [tensor.name], to=TensorProto.FLOAT)
        )
    del graph.initializer[:]
    graph.initializer.extend(kept + added)
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(casts + nodes)
    onnx.checker.check_model(model)
    return model


def export_onnx(
    config: Any,
    weights: dict[str, npt.NDArray[np.float32]],
    embed_q8: Any,
    head_ids: Sequence[int],
    out_path: Path,
    name: str,
) -> Path:
    """The draft through the project's ONNX builder: q8_0 embedding, fp16 matrices, trimmed head."""
    import onnx

    from modelbuild.gguf_source import EMBED
    from modelbuild.onnx_graph import DecoderSpec, build_decoder

    spec = DecoderSpec(n_layers=config.n_layers, head_ids=tuple(int(i) for i in head_ids))
    table = embed_q8.dequantize()
    model = build_decoder(config, {**weights, EMBED: table}, spec, name=name)
    model = fp16_weights(q8_embedding(model, embed_q8))
    partial = out_path.with_suffix(".partial")
    onnx.save_model(model, str(partial))
    partial.replace(out_path)
    return out_path


def load_draft_weights(
    path: Path,
) -> tuple[dict[str, npt.NDArray[np.float32]], list[int], dict[str, Any]]:
    """Trained tensors (fp16 on disk, widened to fp32), head ids and the training facts."""
    with np.load(path) as archive:
        meta = json.loads(archive["meta_json"].tobytes().decode())
        head_ids = [int(i) for i in archive["head_ids"]]
        weights = {
            name: archive[name].astype(np.float32)
            for name in archive.files
            if name not in ("head_ids", "meta_json")
        }
    return weights, head_ids, meta


def target_source(target_dir: Path) -> GgufModel:
    """The GGUF a built target came from (its manifest records where), to cut drafts from."""
    from inference.artifacts import load_manifest
    from modelbuild.gguf_source import GgufError, GgufModel

    manifest = load_manifest(target_dir)
    recorded = manifest.extra.get("source_path")
    if recorded is None:  # SmolLM2 builds from before the path was recorded
        return GgufModel()
    path = Path(recorded)
    if not path.is_file():
        raise GgufError(f"{manifest.name}'s GGUF is no longer at {path}: build the target again")
    source = GgufModel(path)
    if source.sha256 != manifest.source_sha256:
        raise GgufError(f"{path} changed since {manifest.name} was built: build it again")
    return source


def embedding_q8(source: GgufModel) -> QuantizedMatrix:
    """The target's embedding in q8_0 blocks: its own where the GGUF stores it so, else made
    here from the fp32 table (gguf's reference quantiser)."""
    import gguf

    from modelbuild.gguf_source import EMBED, QuantizedMatrix

    own = source.quantized(EMBED)
    if own is not None and own.kind == "q8_0":
        return own
    table = source.weights(0)[EMBED]  # no blocks: the global tensors only
    blocks = gguf.quants.quantize(table, gguf.GGMLQuantizationType.Q8_0)
    rows, cols = table.shape
    return QuantizedMatrix("q8_0", rows, cols, blocks.reshape(rows, cols // 32, 34))


EXPORT_FORMATS = ("onnx", "tflite")


def export_draft(
    models_dir: Path,
    weights_path: Path,
    target_dir: Path,
    formats: Sequence[str] = EXPORT_FORMATS,
) -> list[Path]:
    """Build a draft's ONNX and/or TFLite directories (model, output ids, tokenizer, manifest)."""
    import shutil

    from inference.artifacts import (
        OUTPUT_IDS_FILE,
        describe_model,
        load_manifest,
        sha256_file,
        write_manifest,
    )
    from inference.drafts import TFLITE_SUFFIX
    from inference.tokenizer import CHAT_FORMAT_FILE, TOKENIZER_FILE
    from modelbuild.tflite_export import export_tflite

    weights, head_ids, meta = load_draft_weights(weights_path)
    name = str(meta["name"])
    source = target_source(target_dir)
    config = source.config.with_layers(int(meta["n_layers"]))
    embed_q8 = embedding_q8(source)
    target = load_manifest(target_dir)
    extra = {
        "draft": name,
        "output_ids_file": OUTPUT_IDS_FILE,
        "head_size": len(head_ids),
        "weights_sha256": sha256_file(weights_path),
        "target": target.name,
        **{key: value for key, value in meta.items() if key not in ("name",)},
    }
    built = []
    for model_format, model_file, model_name in (
        ("onnx", "model.onnx", name),
        ("tflite", "model.tflite", name + TFLITE_SUFFIX),
    ):
        if model_format not in formats:
            continue
        directory = models_dir / model_name
        partial = models_dir / f".{model_name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for file in (TOKENIZER_FILE, CHAT_FORMAT_FILE):
            shutil.copyfile(target_dir / file, partial / file)
        (partial / OUTPUT_IDS_FILE).write_text(json.dumps(head_ids) + "\n")
        if model_format == "onnx":
            export_onnx(config, weights, embed_q8, head_ids, partial / model_file, model_name)
        else:
            export_tflite(config, weights, embed_q8, partial / model_file)
        manifest = describe_model(
            partial,
            name=model_name,
            role="draft",
            model_format=model_format,  # type: ignore[arg-type]
            model_file=model_file,
            tokenizer_file=TOKENIZER_FILE,
            precision="fp16+q8emb",
            config=config.to_json(),
            source_sha256=target.sha256,
            builder_version=DRAFT_BUILDER_VERSION,
            extra=extra,
        )
        write_manifest(partial, manifest)
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)
        built.append(directory)
        log.debug("%s: %.1f MB in %s", model_name, manifest.size_bytes / 1e6, directory)
    return built


DRAFT_BUILDER_VERSION = "2"
REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_DRAFTS = REPO_ROOT / "models" / "drafts"  # committed trained weights, one folder per draft
SHARED_PROMPTS = REPO_ROOT.parent / "shared" / "bench" / "prompts.jsonl"
HELD_OUT_PROMPTS = 60
EVAL_MAX_NEW_TOKENS = 128


def _greedy_answers(
    target: Runtime, eos_id: int, prompts: list[tuple[int, str, list[int]]], path: Path
) -> list[TeacherRecord]:
    """The target's greedy answers to fixed prompts, cached in `path` (measurement only)."""
    records = read_teacher(path)
    if len(records) < len(prompts):
        path.unlink(missing_ok=True)
        generate_teacher(
            target, eos_id, iter(prompts), path, token_budget=len(prompts) * EVAL_MAX_NEW_TOKENS,
            batch_size=16, max_new_tokens=EVAL_MAX_NEW_TOKENS,
        )  # fmt: skip
        records = read_teacher(path)
    return records


def agreement(draft: Runtime, records: Sequence[TeacherRecord]) -> dict[str, float]:
    """Top-1 agreement per task and overall: the draft's argmax against the target's greedy token,
    teacher-forced along the target's own answer (one pass per answer)."""
    from inference.proposers import head_token_ids

    ids = head_token_ids(draft)
    hits: dict[str, int] = {}
    totals: dict[str, int] = {}
    for record in records:
        sequence = record.prompt_ids + record.answer_ids[:-1]
        logits = draft.forward(sequence, draft.new_cache())[len(record.prompt_ids) - 1 :]
        predicted = logits.argmax(-1)
        if ids is not None:
            predicted = ids[predicted]
        match = int((predicted == np.asarray(record.answer_ids)).sum())
        for key in (record.task, "all"):
            hits[key] = hits.get(key, 0) + match
            totals[key] = totals.get(key, 0) + len(record.answer_ids)
    return {key: hits[key] / totals[key] for key in totals}


def evaluate(
    models_dir: Path, target_dir: Path, threads: int, work: Path | None = None
) -> dict[str, Any]:
    """Agreement of every draft built for this target on held-out generated prompts and the
    shared prompts; `work` holds the teacher text (default: models dir/distill)."""
    from inference.artifacts import load_manifest, with_vocab
    from inference.drafts import list_drafts, load_draft
    from inference.onnx_runtime import OnnxRuntime
    from inference.tokenizer import ChatTokenizer
    from modelbuild.teacher_prompts import teacher_prompt

    work = work or models_dir / "distill"
    vocab = with_vocab(target_dir, load_manifest(target_dir)).vocab_sha256
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = ChatTokenizer.load(target_dir)
    target = OnnxRuntime(target_dir / "model.onnx", threads=threads)
    trained = {tuple(r.prompt_ids) for r in read_teacher(work / TEACHER_FILE)}
    held_out: list[tuple[int, str, list[int]]] = []
    index = HELD_OUT_START
    while len(held_out) < HELD_OUT_PROMPTS:
        prompt = teacher_prompt(index, PROMPT_SEED)
        ids = tokenizer.apply_chat_template(prompt.prompt)
        if tuple(ids) not in trained:
            held_out.append((index, prompt.task, ids))
        index += 1
    sets = {
        "held_out": _greedy_answers(
            target, tokenizer.eos_id, held_out, work / "eval-held-out.jsonl"
        )
    }
    if SHARED_PROMPTS.exists():
        lines = [
            json.loads(line) for line in SHARED_PROMPTS.read_text().splitlines() if line.strip()
        ]
        shared = [
            (i, str(p["task"]), tokenizer.apply_chat_template(str(p["prompt"])))
            for i, p in enumerate(lines)
        ]
        sets["shared"] = _greedy_answers(
            target, tokenizer.eos_id, shared, work / "eval-shared.jsonl"
        )
    probe = sets["held_out"][0].prompt_ids
    report: dict[str, Any] = {"target": {"decode_ms": decode_ms(target, probe)}}
    for draft in list_drafts(models_dir):
        if with_vocab(draft.directory, draft.manifest).vocab_sha256 != vocab:
            continue  # another target's draft
        runtime = load_draft(models_dir, draft.name, draft.format, threads=1)
        entry = report.setdefault(draft.name, {})
        entry[f"{draft.format}_decode_ms"] = decode_ms(runtime, probe)
        entry[f"{draft.format}_mb"] = round(draft.size_mb, 1)
        if draft.format == "onnx":
            for name, records in sets.items():
                entry[f"top1_{name}"] = agreement(runtime, records)
    return report


def decode_ms(runtime: Runtime, prompt_ids: list[int], steps: int = 64) -> float:
    """Median milliseconds of one-token forward passes after a prompt (the drafting step)."""
    cache = runtime.new_cache()
    logits = runtime.forward(prompt_ids, cache)[-1]
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = runtime.forward([int(logits.argmax())], cache)[-1]
        times.append(time.perf_counter() - started)
    return round(float(np.median(times)) * 1000, 3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )
    parser.add_argument(
        "--minutes", type=float, default=25.0, help="training minutes for all drafts together"
    )
    parser.add_argument(
        "--teacher-tokens", type=int, default=300_000,
        help="answer tokens of teacher text to have before training (resumes where it stopped)",
    )  # fmt: skip
    parser.add_argument(
        "--teacher-minutes", type=float, default=None,
        help="stop taking new teacher prompts after this many minutes (what is written is kept)",
    )  # fmt: skip
    parser.add_argument(
        "--teacher-only", action="store_true",
        help="generate teacher text up to --teacher-tokens, then stop before training",
    )  # fmt: skip
    parser.add_argument("--size", choices=sorted(SIZES), default="all", help="which drafts")
    parser.add_argument(
        "--resume", action="store_true", help="continue training from the last checkpoints"
    )
    parser.add_argument(
        "--export-only", action="store_true",
        help="skip teacher text and training; rebuild ONNX/TFLite from the trained weights",
    )  # fmt: skip
    parser.add_argument(
        "--weights-dir", type=Path, default=None,
        help=f"where trained weights are written and read (default: {SHIPPED_DRAFTS} for "
        "SmolLM2, else the target's distill directory)",
    )  # fmt: skip
    parser.add_argument(
        "--target", default=None,
        help="the built target to distil for, by name (default: SmolLM2); its drafts are "
        "named TARGET-draft-l1, TARGET-draft-l2",
    )  # fmt: skip
    parser.add_argument(
        "--formats", nargs="+", choices=EXPORT_FORMATS, default=list(EXPORT_FORMATS),
        help="which draft builds to export (default: onnx tflite)",
    )  # fmt: skip
    parser.add_argument(
        "--evaluate", action="store_true",
        help="afterwards, measure top-1 agreement with the target (held-out and shared prompts)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default: 2)")


def run(args: argparse.Namespace) -> int:
    from core.errors import CommandError

    if args.minutes <= 0 or args.teacher_tokens < 0 or args.threads < 1:
        raise CommandError("--minutes must be > 0, --teacher-tokens >= 0, --threads >= 1")
    if args.teacher_minutes is not None and args.teacher_minutes <= 0:
        raise CommandError(f"--teacher-minutes must be > 0, got {args.teacher_minutes}")
    if args.teacher_only and args.export_only:
        raise CommandError("--teacher-only and --export-only exclude each other")
    from inference.artifacts import ArtifactError, default_models_dir
    from modelbuild.gguf_source import GgufError
    from modelbuild.target_build import ensure_target, target_name

    models_dir: Path = args.models_dir or default_models_dir()
    names = SIZES[args.size]
    try:
        target_dir = ensure_target(models_dir, name=args.target)
        source = target_source(target_dir)
    except (ArtifactError, GgufError, OSError) as exc:
        raise CommandError(str(exc)) from exc
    default = args.target is None or args.target == target_name("fp32")
    # Another target's drafts and teacher text live apart from SmolLM2's, named after it.
    work = models_dir / ("distill" if default else f"distill-{target_dir.name}")
    weights_dir: Path = args.weights_dir or (SHIPPED_DRAFTS if default else work / "weights")
    prefix = "" if default else f"{target_dir.name}-"
    if not args.export_only:
        from inference.onnx_runtime import OnnxRuntime
        from inference.tokenizer import ChatTokenizer
        from modelbuild.teacher_prompts import teacher_prompt

        work.mkdir(parents=True, exist_ok=True)
        tokenizer = ChatTokenizer.load(target_dir)
        teacher_path = work / TEACHER_FILE
        records = read_teacher(teacher_path)
        missing = args.teacher_tokens - teacher_tokens(records)
        if missing > 0:
            target = OnnxRuntime(target_dir / "model.onnx", threads=args.threads)
            start = max((r.index for r in records), default=-1) + 1
            seen = {teacher_prompt(i, PROMPT_SEED).prompt for i in range(start)}
            deadline = None
            if args.teacher_minutes is not None:
                deadline = time.monotonic() + args.teacher_minutes * 60
            generate_teacher(
                target, tokenizer.eos_id, unseen_prompts(tokenizer, start, seen, HELD_OUT_START),
                teacher_path, token_budget=missing, deadline=deadline,
            )  # fmt: skip
            del target
            records = read_teacher(teacher_path)
        records = without_benchmark(records, tokenizer)
        if args.teacher_only:  # said once, on stdout, as the command's result
            print(f"teacher text in {teacher_path}: {len(records)} answers, "
                  f"{teacher_tokens(records)} tokens")  # fmt: skip
            return 0
        log.info("teacher text: %d answers, %d tokens", len(records), teacher_tokens(records))
        shares = sum(RECIPES[n].time_share for n in names)
        for name in names:
            recipe = dataclasses.replace(RECIPES[name], name=prefix + name)
            trained = train_draft(
                recipe, records, work, minutes=args.minutes * recipe.time_share / shares,
                resume=args.resume, eos_id=tokenizer.eos_id, source=source,
            )  # fmt: skip
            (weights_dir / name).mkdir(parents=True, exist_ok=True)
            trained.replace(weights_dir / name / "weights.npz")
    from tqdm import tqdm

    from inference.artifacts import load_manifest

    for name in names:
        weights_path = weights_dir / name / "weights.npz"
        if not weights_path.exists():
            raise CommandError(f"no trained weights at {weights_path}; run without --export-only")
    with tqdm(names, desc="export", unit="draft") as bar:
        for name in bar:
            bar.set_postfix_str(name)
            weights_path = weights_dir / name / "weights.npz"
            for directory in export_draft(models_dir, weights_path, target_dir, args.formats):
                size_mb = load_manifest(directory).size_bytes / 1e6
                bar.write(f"built {directory.name} ({size_mb:.1f} MB) in {directory}")
    if args.evaluate:
        report = evaluate(models_dir, target_dir, args.threads, work)
        (work / "evaluation.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
    return 0


def ensure_drafts(
    models_dir: Path, target_dir: Path, weights_dir: Path = SHIPPED_DRAFTS
) -> list[str]:
    """Build every draft whose trained weights are in `weights_dir`, unless already up to date."""
    import fcntl

    models_dir.mkdir(parents=True, exist_ok=True)
    # One builder at a time across processes: parallel test runs share the models directory.
    with (models_dir / ".drafts.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _ensure_drafts(models_dir, target_dir, weights_dir)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _ensure_drafts(models_dir: Path, target_dir: Path, weights_dir: Path) -> list[str]:
    from inference.artifacts import ArtifactError, load_manifest, sha256_file
    from inference.drafts import TFLITE_SUFFIX

    names = []
    for weights_path in sorted(weights_dir.glob("*/weights.npz")):
        name = weights_path.parent.name
        digest = sha256_file(weights_path)
        try:
            current = all(
                load_manifest(models_dir / dir_name).extra.get("weights_sha256") == digest
                and load_manifest(models_dir / dir_name).builder_version == DRAFT_BUILDER_VERSION
                for dir_name in (name, name + TFLITE_SUFFIX)
            )
        except ArtifactError:
            current = False
        if not current:
            export_draft(models_dir, weights_path, target_dir)
        names.append(name)
    return names
