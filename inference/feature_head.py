"""Feature-conditioned draft heads (EAGLE-style): weights format, ONNX/TFLite builds, runtime.

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
`<name>-tflite/` (TFLite).
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
    from inference.gguf_source import QuantizedMatrix

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
HeadFormat = Literal["onnx", "tflite"]

HEAD_KIND = "feature-head"  # the manifest's `kind`
HEAD_BUILDER_VERSION = "1"
VOCAB_IDS_FILE = "vocab_ids.json"  # target token id of each logit column
TFLITE_SUFFIX = "-tflite"
REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_HEADS = REPO_ROOT / "models" / "heads"  # committed trained weights, one folder per head

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


# --- the ONNX graph ------------------------------------------------------------------------------


def build_step_onnx(weights: HeadWeights, embed: F32 | QuantizedMatrix) -> Any:
    """The step as an ONNX graph (opset 17): fp32 compute, large matrices stored as fp16.

    `embed` is an fp32 table, or the target's q8_0 blocks (int8 codes times per-block scales,
    a byte per weight, as the drafts and the TFLite build hold it).
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from inference.distill import fp16_weights
    from inference.onnx_graph import OPSET

    weights.validate()
    c, t = weights.config, weights.tensors
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def const(name: str, value: npt.ArrayLike, dtype: Any = np.float32) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(op_type: str, inputs: list[str], out: str, **attrs: Any) -> str:
        nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def rms_norm(x: str, weight: str, out: str) -> str:
        square = op("Pow", [x, const(f"{out}_two", 2.0)], f"{out}_sq")
        mean = op("ReduceMean", [square], f"{out}_mean", axes=[-1], keepdims=1)
        std = op(
            "Sqrt", [op("Add", [mean, const(f"{out}_eps", c.rms_eps)], f"{out}_var")], out + "_std"
        )
        normed = op("Div", [x, std], f"{out}_div")
        return op("Mul", [normed, const(weight, t[weight])], out)

    def linear(x: str, weight: str, out: str) -> str:
        return op("MatMul", [x, const(weight + "_t", np.ascontiguousarray(t[weight].T))], out)

    if isinstance(embed, np.ndarray):
        token_rows = op("Gather", [const("embed", embed), TOKENS], "token_rows", axis=0)
    else:
        codes = (embed.codes.astype(np.int16) - 128).astype(np.int8).reshape(embed.rows, -1)
        gathered = op("Gather", [const("embed_codes", codes, np.int8), TOKENS], "embed_g", axis=0)
        widened = op("Cast", [gathered], "embed_f", to=TensorProto.FLOAT)
        blocks = op(
            "Reshape",
            [widened, const("embed_blocks", [0, embed.n_blocks, 32], np.int64)],
            "embed_b",
        )
        scales = op("Gather", [const("embed_scales", embed.scales), TOKENS], "embed_s", axis=0)
        scaled = op(
            "Mul",
            [blocks, op("Unsqueeze", [scales, const("last", [-1], np.int64)], "embed_s1")],
            "embed_m",
        )
        token_rows = op(
            "Reshape", [scaled, const("embed_rows", [0, c.hidden_size], np.int64)], "token_rows"
        )

    f = rms_norm(FEATURES, "feature_norm.weight", "f_norm")
    e = rms_norm(token_rows, "token_norm.weight", "e_norm")
    x = linear(op("Concat", [f, e], "fe", axis=-1), "fc.weight", "x0")
    m = rms_norm(x, "mlp_norm.weight", "m_norm")
    gate = linear(m, "gate.weight", "gate")
    act = op(
        "Mul",
        [op("Mul", [gate, op("Sigmoid", [gate], "sig")], "silu"), linear(m, "up.weight", "up")],
        "act",
    )
    x = op("Add", [x, linear(act, "down.weight", "down")], "x1")
    rms_norm(x, "out_norm.weight", NEXT_FEATURES)
    linear(NEXT_FEATURES, "head.weight", LOGITS)

    n_vocab = int(weights.vocab_ids.shape[0])
    graph = helper.make_graph(
        nodes,
        c.name,
        [
            helper.make_tensor_value_info(FEATURES, TensorProto.FLOAT, ["batch", c.hidden_size]),
            helper.make_tensor_value_info(TOKENS, TensorProto.INT64, ["batch"]),
        ],
        [
            helper.make_tensor_value_info(
                NEXT_FEATURES, TensorProto.FLOAT, ["batch", c.hidden_size]
            ),
            helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["batch", n_vocab]),
        ],
        initializer=inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="specfleet"
    )
    model.ir_version = 9  # readable by onnxruntime >= 1.17 (the floor in pyproject)
    return fp16_weights(model)


# --- the TFLite graph ----------------------------------------------------------------------------


def export_step_tflite(weights: HeadWeights, embed: F32 | QuantizedMatrix, out_path: Path) -> Path:
    """The step converted to TFLite (TensorFlow at build time only): fp16-stored matrices computed
    in fp32, the embedding as an fp32 table or the target's q8_0 blocks, a dynamic batch."""
    from inference.tflite_export import TfliteExportError, _require_tf

    tf = _require_tf()
    weights.validate()
    c, t = weights.config, weights.tensors
    eps = float(c.rms_eps)

    def vector(name: str) -> Any:
        return tf.constant(t[name])

    def matrix_t(name: str) -> Any:  # [in, out]
        return tf.constant(np.ascontiguousarray(t[name].T))

    norms = {n: vector(n) for n in t if n.endswith("norm.weight")}
    fc, gate, up, down, head = (
        matrix_t(n) for n in ("fc.weight", "gate.weight", "up.weight", "down.weight", "head.weight")
    )
    if isinstance(embed, np.ndarray):
        table = tf.constant(embed)

        def embed_rows(tokens: Any) -> Any:
            return tf.gather(table, tokens)

    else:
        codes = (embed.codes.astype(np.int16) - 128).astype(np.int8)
        codes_t = tf.constant(codes.reshape(embed.rows, embed.cols))
        scales_t = tf.constant(embed.scales.astype(np.float32))

        def embed_rows(tokens: Any) -> Any:
            rows = tf.cast(tf.gather(codes_t, tokens), tf.float32)
            rows = tf.reshape(rows, [-1, embed.n_blocks, 32])
            return tf.reshape(rows * tf.gather(scales_t, tokens)[..., None], [-1, c.hidden_size])

    def rms_norm(x: Any, name: str) -> Any:
        return x * tf.math.rsqrt(tf.reduce_mean(x * x, axis=-1, keepdims=True) + eps) * norms[name]

    spec = [
        tf.TensorSpec([None, c.hidden_size], tf.float32, name=FEATURES),
        tf.TensorSpec([None], tf.int32, name=TOKENS),
    ]

    @tf.function(input_signature=spec)  # type: ignore[untyped-decorator]
    def step(features: Any, tokens: Any) -> Any:
        f = rms_norm(features, "feature_norm.weight")
        e = rms_norm(embed_rows(tokens), "token_norm.weight")
        x = tf.concat([f, e], axis=-1) @ fc
        m = rms_norm(x, "mlp_norm.weight")
        x = x + (tf.nn.silu(m @ gate) * (m @ up)) @ down
        next_features = rms_norm(x, "out_norm.weight")
        return {NEXT_FEATURES: next_features, LOGITS: next_features @ head}

    converter = tf.lite.TFLiteConverter.from_concrete_functions(
        [step.get_concrete_function()], step
    )
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.target_spec.supported_types = [tf.float16]
    try:
        flatbuffer = converter.convert()
    except Exception as exc:  # the converter raises many unrelated types; keep its message
        raise TfliteExportError(f"TFLite conversion failed: {exc}") from exc
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(flatbuffer)
    return out_path


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


def build_head(
    models_dir: Path,
    weights: HeadWeights,
    target_dir: Path,
    *,
    weights_sha256: str = "",
) -> list[Path]:
    """Build a head's ONNX and TFLite directories (model, vocab ids, tokenizer, manifest).

    The token embedding is the head's own when it carries one, else the target's q8_0 blocks
    from its GGUF. Each manifest records the target's model hash: a head only fits the target
    whose features it was trained on.
    """
    import shutil

    from inference.artifacts import describe_model, load_manifest, write_manifest
    from inference.tokenizer import CHAT_FORMAT_FILE, TOKENIZER_FILE

    weights.validate()
    target = load_manifest(target_dir)
    name = weights.config.name
    embed: F32 | QuantizedMatrix
    if weights.embed is not None:
        embed, precision = weights.embed, "fp16"
    else:
        embed, precision = _target_embedding(weights.config), "fp16+q8emb"
    extra = {
        "head": name,
        "vocab_ids_file": VOCAB_IDS_FILE,
        "head_size": int(weights.vocab_ids.shape[0]),
        "target": target.name,
        "target_sha256": target.sha256,
        "weights_sha256": weights_sha256,
        "record": weights.record,
    }
    built = []
    for model_format, model_file, model_name in (
        ("onnx", "model.onnx", name),
        ("tflite", "model.tflite", name + TFLITE_SUFFIX),
    ):
        directory = models_dir / model_name
        partial = models_dir / f".{model_name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for file in (TOKENIZER_FILE, CHAT_FORMAT_FILE):
            shutil.copyfile(target_dir / file, partial / file)
        (partial / VOCAB_IDS_FILE).write_text(json.dumps(weights.vocab_ids.tolist()) + "\n")
        if model_format == "onnx":
            import onnx

            onnx.save_model(build_step_onnx(weights, embed), str(partial / model_file))
        else:
            export_step_tflite(weights, embed, partial / model_file)
        manifest = describe_model(
            partial,
            name=model_name,
            role="draft",
            kind=HEAD_KIND,
            model_format=model_format,  # type: ignore[arg-type]
            model_file=model_file,
            tokenizer_file=TOKENIZER_FILE,
            precision=precision,
            config=weights.config.to_json(),
            source_sha256=target.sha256,
            builder_version=HEAD_BUILDER_VERSION,
            extra=extra,
        )
        write_manifest(partial, manifest)
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)
        built.append(directory)
        log.info("%s: %.1f MB in %s", model_name, manifest.size_bytes / 1e6, directory)
    return built


def _target_embedding(config: HeadConfig) -> QuantizedMatrix:
    from inference.gguf_source import EMBED, GgufModel

    matrix = GgufModel().quantized(EMBED)
    if matrix is None or matrix.kind != "q8_0":
        raise FeatureHeadError("heads reuse the target's q8_0 embedding; this GGUF has none")
    if (matrix.rows, matrix.cols) != (config.vocab_size, config.hidden_size):
        raise FeatureHeadError(
            f"head {config.name!r} is for a [{config.vocab_size}, {config.hidden_size}] "
            f"embedding; the target's is [{matrix.rows}, {matrix.cols}]"
        )
    return matrix


def ensure_heads(
    models_dir: Path, target_dir: Path, weights_dir: Path = SHIPPED_HEADS
) -> list[str]:
    """Build every head whose trained weights are in `weights_dir`, unless already up to date."""
    import fcntl

    from inference.artifacts import ArtifactError, load_manifest, sha256_file

    models_dir.mkdir(parents=True, exist_ok=True)
    names = []
    # One builder at a time across processes: parallel test runs share the models directory.
    with (models_dir / ".heads.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        target_sha = load_manifest(target_dir).sha256
        for weights_path in sorted(weights_dir.glob("*/weights.npz")):
            name = weights_path.parent.name
            digest = sha256_file(weights_path)
            try:
                manifests = [load_manifest(models_dir / n) for n in (name, name + TFLITE_SUFFIX)]
                current = all(
                    m.extra.get("weights_sha256") == digest
                    and m.builder_version == HEAD_BUILDER_VERSION
                    and m.source_sha256 == target_sha
                    for m in manifests
                )
            except ArtifactError:
                current = False
            if not current:
                build_head(
                    models_dir, load_head_weights(weights_path), target_dir, weights_sha256=digest
                )
            names.append(name)
    return names


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
