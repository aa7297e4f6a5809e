"""Building feature heads (inference/feature_head.py): the step as an ONNX graph and as TFLite,
and the built model directories of each head whose trained weights ship in models/heads/."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from inference.feature_head import (
    F32,
    FEATURES,
    HEAD_KIND,
    LOGITS,
    NEXT_FEATURES,
    TFLITE_SUFFIX,
    TOKENS,
    VOCAB_IDS_FILE,
    FeatureHeadError,
    HeadConfig,
    HeadWeights,
    load_head_weights,
)
from modelbuild.gguf_source import QuantizedMatrix

log = logging.getLogger(__name__)

HEAD_BUILDER_VERSION = "1"
REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_HEADS = REPO_ROOT / "models" / "heads"  # committed trained weights, one folder per head

# --- the ONNX graph ------------------------------------------------------------------------------


def build_step_onnx(weights: HeadWeights, embed: F32 | QuantizedMatrix) -> Any:
    """The step as an ONNX graph (opset 17): fp32 compute, large matrices stored as fp16.

    `embed` is an fp32 table, or the target's q8_0 blocks (int8 codes times per-block scales,
    a byte per weight, as the drafts and the TFLite build hold it).
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from modelbuild.distill import fp16_weights
    from modelbuild.onnx_graph import OPSET

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
    from modelbuild.tflite_export import TfliteExportError, _require_tf

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
    from modelbuild.gguf_source import EMBED, GgufModel

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
