"""Feature-conditioned draft heads (EAGLE-style): weights format, built heads on disk, runtime.

A head is a stateless step: given the target's feature h_{n-1} (its last-layer hidden state after
the final norm, at the position of x_{n-1}) and the token x_n, it predicts the feature at x_n and
logits over a reduced, frequency-ranked vocabulary:

    step(features # [B, H], tokens # [B]) -> (next_features # [B, H], logits # [B, V'])

Drafting k tokens chains it on its own predicted features, so rolling back after a rejection
costs nothing. The math of one step (numpy in `step_reference`, and the same in both graphs):

    x = fc([norm_f(h); norm_e(embed[token])])           # [B, H]
    x = x + down(silu(gate(norm_m(x))) * up(norm_m(x))) # a gated MLP block, no attention
    next = norm_o(x);  logits = next @ head.T           # head rows start as the target's own

Trained weights live in `models/heads/<name>/weights.npz` (fp16); the token embedding is the
target's (q8_0 from its GGUF) and is added when the head is built into `<name>/` (ONNX) and
`<name>-tflite/` (TFLite) by modelbuild/head_build.py.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from inference.artifacts import ModelManifest

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
HeadFormat = Literal["onnx", "tflite"]

HEAD_KIND = "feature-head"  # the manifest's `kind`
VOCAB_IDS_FILE = "vocab_ids.json"  # target token id of each logit column
TFLITE_SUFFIX = "-tflite"

# Names of the step graph's inputs and outputs (ONNX; TFLite decorates them).
FEATURES = "features"  # [batch, hidden] float32
TOKENS = "tokens"  # [batch] int64 (int32 in TFLite)
NEXT_FEATURES = "next_features"  # [batch, hidden] float32
LOGITS = "logits"  # [batch, V'] float32

_CONFIG_KEY = "config_json"
_RECORD_KEY = "record_json"
_VOCAB_KEY = "vocab_ids"
_EMBED_KEY = "embed.weight"  # only in heads that carry their own table (random test heads)


class FeatureHeadError(Exception):
    """A head whose files are missing or inconsistent, or built for another target."""


@dataclass(frozen=True)
class HeadConfig:
    """The shape of a head: H (the target's hidden size), the MLP width, the target's vocabulary."""

    name: str
    hidden_size: int
    intermediate_size: int
    vocab_size: int  # rows of the token embedding: the target's whole vocabulary
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        if min(self.hidden_size, self.intermediate_size, self.vocab_size) < 1:
            raise FeatureHeadError(f"head {self.name!r}: sizes must be positive")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> HeadConfig:
        try:
            return cls(
                name=str(fields["name"]),
                hidden_size=int(fields["hidden_size"]),
                intermediate_size=int(fields["intermediate_size"]),
                vocab_size=int(fields["vocab_size"]),
                rms_eps=float(fields["rms_eps"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FeatureHeadError(f"bad head config {fields!r}: {exc}") from exc


def tensor_shapes(config: HeadConfig, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every trained tensor of a head # [out, in] matrices, with V' = n_vocab output rows."""
    h, i = config.hidden_size, config.intermediate_size
    return {
        "feature_norm.weight": (h,),
        "token_norm.weight": (h,),
        "fc.weight": (h, 2 * h),
        "mlp_norm.weight": (h,),
        "gate.weight": (i, h),
        "up.weight": (i, h),
        "down.weight": (h, i),
        "out_norm.weight": (h,),
        "head.weight": (n_vocab, h),
    }


@dataclass
class HeadWeights:
    """A head's tensors (fp32 in memory), its reduced vocabulary and what went into training."""

    config: HeadConfig
    tensors: dict[str, F32]
    vocab_ids: I64  # [V'] target token id of each logit column
    record: dict[str, Any] = field(default_factory=dict)
    embed: F32 | None = None  # [vocab_size, H]; None: the target's own, added at build time

    def validate(self) -> None:
        n_vocab = int(self.vocab_ids.shape[0])
        expected = tensor_shapes(self.config, n_vocab)
        if set(self.tensors) != set(expected):
            raise FeatureHeadError(
                f"head {self.config.name!r}: tensors {sorted(self.tensors)} != {sorted(expected)}"
            )
        for name, shape in expected.items():
            if self.tensors[name].shape != shape:
                raise FeatureHeadError(
                    f"head {self.config.name!r}: {name} is {self.tensors[name].shape}, not {shape}"
                )
        if n_vocab == self.config.hidden_size:
            # The TFLite runtime tells its two [B, *] outputs apart by their width.
            raise FeatureHeadError("a head's reduced vocabulary may not be as wide as H")
        ids = self.vocab_ids
        if ids.ndim != 1 or len(np.unique(ids)) != n_vocab:
            raise FeatureHeadError("vocab_ids must be distinct token ids")
        if n_vocab and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise FeatureHeadError(f"vocab_ids outside the vocabulary of {self.config.vocab_size}")
        if self.embed is not None and self.embed.shape != (
            self.config.vocab_size,
            self.config.hidden_size,
        ):
            raise FeatureHeadError(f"embedding is {self.embed.shape}, not [vocab, hidden]")


def save_head_weights(path: Path, weights: HeadWeights) -> None:
    """fp16 tensors, int64 vocab ids, the config and the training record, through a rename."""
    weights.validate()
    arrays: dict[str, npt.NDArray[Any]] = {
        name: tensor.astype(np.float16) for name, tensor in weights.tensors.items()
    }
    if weights.embed is not None:
        arrays[_EMBED_KEY] = weights.embed.astype(np.float16)
    arrays[_VOCAB_KEY] = weights.vocab_ids.astype(np.int64)
    arrays[_CONFIG_KEY] = _json_bytes(weights.config.to_json())
    arrays[_RECORD_KEY] = _json_bytes(weights.record)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.npz")
    np.savez(partial, **arrays)  # type: ignore[arg-type]
    partial.replace(path)


def load_head_weights(path: Path) -> HeadWeights:
    """A head saved by `save_head_weights`, widened to fp32 and validated."""
    try:
        with np.load(path) as archive:
            config = HeadConfig.from_json(json.loads(archive[_CONFIG_KEY].tobytes()))
            record = json.loads(archive[_RECORD_KEY].tobytes())
            vocab_ids = archive[_VOCAB_KEY].astype(np.int64)
            embed = archive[_EMBED_KEY].astype(np.float32) if _EMBED_KEY in archive else None
            skip = {_CONFIG_KEY, _RECORD_KEY, _VOCAB_KEY, _EMBED_KEY}
            tensors = {
                name: archive[name].astype(np.float32) for name in archive.files if name not in skip
            }
    except (OSError, KeyError, ValueError) as exc:
        raise FeatureHeadError(f"{path}: not a head's weights ({exc})") from exc
    weights = HeadWeights(config, tensors, vocab_ids, record, embed)
    weights.validate()
    return weights


def _json_bytes(document: Any) -> npt.NDArray[np.uint8]:
    return np.frombuffer(json.dumps(document).encode(), dtype=np.uint8)


def random_head_weights(
    hidden_size: int,
    vocab_ids: npt.ArrayLike,
    seed: int,
    *,
    vocab_size: int | None = None,
    intermediate_size: int | None = None,
    name: str = "random-head",
) -> HeadWeights:
    """An untrained head with its own random embedding table, for tests: no torch, no target.

    The scales keep features and logits in the ranges a trained head sees (unit-RMS features,
    logits spread over several units), so greedy chains are not decided by rounding.
    """
    ids = np.asarray(vocab_ids, dtype=np.int64)
    config = HeadConfig(
        name=name,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        vocab_size=vocab_size or int(ids.max()) + 1,
    )
    rng = np.random.default_rng(seed)
    tensors: dict[str, F32] = {}
    for tensor_name, shape in tensor_shapes(config, len(ids)).items():
        if len(shape) == 1:
            tensors[tensor_name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[tensor_name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(
                np.float32
            )
    tensors["head.weight"] *= np.float32(4.0)
    embed = (0.05 * rng.standard_normal((config.vocab_size, hidden_size))).astype(np.float32)
    # Round through fp16 now, so that what the files hold is what this object holds.
    tensors = {k: v.astype(np.float16).astype(np.float32) for k, v in tensors.items()}
    embed = embed.astype(np.float16).astype(np.float32)
    weights = HeadWeights(config, tensors, ids, {"trained": False, "seed": seed}, embed)
    weights.validate()
    return weights


def _rms_norm(x: F32, weight: F32, eps: float) -> F32:
    out: F32 = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * weight
    return out


def step_reference(weights: HeadWeights, embed: F32, features: F32, tokens: I64) -> tuple[F32, F32]:
    """The step in numpy (fp32): the definition both graphs follow; `embed` # [vocab, H]."""
    t, eps = weights.tensors, weights.config.rms_eps
    f = _rms_norm(features.astype(np.float32), t["feature_norm.weight"], eps)
    e = _rms_norm(embed[tokens], t["token_norm.weight"], eps)
    x = np.concatenate([f, e], axis=-1) @ t["fc.weight"].T
    m = _rms_norm(x, t["mlp_norm.weight"], eps)
    gate = m @ t["gate.weight"].T
    x = x + ((gate / (1.0 + np.exp(-gate))) * (m @ t["up.weight"].T)) @ t["down.weight"].T
    next_features = _rms_norm(x, t["out_norm.weight"], eps)
    return next_features, next_features @ t["head.weight"].T


# --- built heads on disk -------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadInfo:
    """One built head: its family name (`eagle-h1`), format and model directory."""

    name: str
    format: HeadFormat
    directory: Path
    manifest: ModelManifest


def is_head(manifest: ModelManifest) -> bool:
    return manifest.kind == HEAD_KIND


def list_heads(models_dir: Path) -> list[HeadInfo]:
    """Every built head under `models_dir`, sorted by name then format."""
    from inference.artifacts import list_models

    found = [
        HeadInfo(
            str(manifest.extra.get("head", manifest.name.removesuffix(TFLITE_SUFFIX))),
            manifest.format,
            directory,
            manifest,
        )
        for directory, manifest in list_models(models_dir)
        if is_head(manifest)
    ]
    return sorted(found, key=lambda h: (h.name, h.format))


def find_head(models_dir: Path, name: str, runtime: HeadFormat = "onnx") -> HeadInfo:
    """A built head by family name (`eagle-h1`) or manifest name (`eagle-h1-tflite`)."""
    for head in list_heads(models_dir):
        if head.format == runtime and name in (head.name, head.manifest.name):
            return head
    known = sorted({f"{h.name} ({h.format})" for h in list_heads(models_dir)})
    raise FeatureHeadError(
        f"no {runtime} feature head {name!r} in {models_dir}; known: {', '.join(known) or 'none'}"
        " (build them with `specfleet models train-head --export-only`)"
    )


# --- the runtime ---------------------------------------------------------------------------------


class _StepGraph(Protocol):
    def step(self, features: F32, tokens: I64) -> tuple[F32, F32]: ...


class FeatureHead:
    """A built head on ONNX Runtime or LiteRT: `step` and greedy `draft` chains."""

    def __init__(
        self,
        graph: _StepGraph,
        manifest: ModelManifest,
        vocab_ids: I64,
    ) -> None:
        self._graph = graph
        self.manifest = manifest
        self.name = manifest.name
        self.format: HeadFormat = manifest.format
        # ONNX Runtime runs a call of 16 rows in about what 1.5 of one cost; LiteRT resizes
        # its tensors for each new batch size and costs more than the calls one by one.
        self.batches_rows = self.format == "onnx"
        self.config = HeadConfig.from_json(manifest.config)
        self.hidden_size = self.config.hidden_size
        self.vocab_ids = vocab_ids  # [V']
        self.target_sha256 = manifest.source_sha256

    @classmethod
    def load(
        cls, model_dir: Path, *, threads: int | None = None, target_sha256: str | None = None
    ) -> FeatureHead:
        """The head in `model_dir`; with `target_sha256`, refused unless built for that target."""
        from inference.artifacts import ArtifactError, load_manifest

        try:
            manifest = load_manifest(model_dir)
        except ArtifactError as exc:
            raise FeatureHeadError(str(exc)) from exc
        if not is_head(manifest):
            raise FeatureHeadError(f"{model_dir} holds a {manifest.kind}, not a {HEAD_KIND}")
        if target_sha256 is not None and manifest.source_sha256 != target_sha256:
            raise FeatureHeadError(
                f"head {manifest.name} was trained on the features of target "
                f"{manifest.source_sha256[:12]} ({manifest.extra.get('target', '?')}), "
                f"not of target {target_sha256[:12]}"
            )
        vocab_path = model_dir / VOCAB_IDS_FILE
        try:
            vocab_ids = np.asarray(json.loads(vocab_path.read_text()), dtype=np.int64)
        except (OSError, ValueError) as exc:
            raise FeatureHeadError(f"{vocab_path}: {exc}") from exc
        model_path = model_dir / manifest.file
        graph: _StepGraph
        if manifest.format == "onnx":
            graph = _OnnxStep(model_path, threads)
        else:
            graph = _LiteRtStep(model_path, threads, manifest.config["hidden_size"])
        return cls(graph, manifest, vocab_ids)

    def step(self, features: F32, tokens: npt.ArrayLike) -> tuple[F32, F32]:
        """(next_features # [B, H], logits # [B, V']) from features # [B, H] and tokens # [B]."""
        features = np.ascontiguousarray(features, dtype=np.float32)
        ids = np.asarray(tokens, dtype=np.int64)
        if features.ndim != 2 or features.shape[1] != self.hidden_size:
            raise ValueError(f"features must be [batch, {self.hidden_size}], got {features.shape}")
        if ids.shape != (features.shape[0],):
            raise ValueError(f"tokens must be [{features.shape[0]}], got {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        return self._graph.step(features, ids)

    def draft(self, feature: F32, token: int, k: int) -> list[int]:
        """Greedy chain of k tokens after (h_{n-1}, x_n), each step fed its own features."""
        features = np.asarray(feature, dtype=np.float32).reshape(1, self.hidden_size)
        tokens: list[int] = []
        current = token
        for _ in range(k):
            features, logits = self.step(features, [current])
            current = int(self.vocab_ids[int(logits[0].argmax())])
            tokens.append(current)
        return tokens


class _OnnxStep:
    def __init__(self, model_path: Path, threads: int | None) -> None:
        from inference.onnx_runtime import OnnxGraph

        self._graph = OnnxGraph(model_path, threads=threads)

    def step(self, features: F32, tokens: I64) -> tuple[F32, F32]:
        next_features, logits = self._graph.run(
            [NEXT_FEATURES, LOGITS], {FEATURES: features, TOKENS: tokens}
        )
        return next_features, logits


class _LiteRtStep:
    def __init__(self, model_path: Path, threads: int | None, hidden_size: int) -> None:
        from inference.litert_runtime import LiteRtGraph

        self._graph = LiteRtGraph(model_path, threads=threads)
        widths = [int(s[-1]) for s in self._graph.output_shapes]
        if len(widths) != 2 or hidden_size not in widths:
            raise FeatureHeadError(f"{model_path}: not a head's step graph (outputs {widths})")
        # Two [B, *] outputs, told apart by width (a head's V' never equals H).
        self._features_at = widths.index(hidden_size)

    def step(self, features: F32, tokens: I64) -> tuple[F32, F32]:
        outputs = self._graph.run({FEATURES: features, TOKENS: tokens.astype(np.int32)})
        return outputs[self._features_at], outputs[1 - self._features_at]
