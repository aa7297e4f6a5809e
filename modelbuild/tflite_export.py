"""Draft decoders to TFLite: a tf.function with a dynamic KV cache, converted at build time only.

TensorFlow is a build dependency (`pip install tensorflow-cpu`); devices run the result with the
LiteRT interpreter alone. The graph takes one sequence (batch 1) and returns the keys and values
of the new positions only, so the runtime's cache is a plain array it can cut anywhere.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from inference.model_config import F32, LlamaConfig
from inference.tflite_io import (
    INPUT_IDS,
    LOGITS,
    NEW_KV,
    PAST_KEYS,
    PAST_VALUES,
    ROPE_COS,
    ROPE_SIN,
)
from modelbuild.gguf_source import QuantizedMatrix

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


class TfliteExportError(Exception):
    """TensorFlow is missing or the converter refused the graph."""


def _require_tf() -> Any:
    # TensorFlow and its converter narrate at start and on every conversion (CPU features, the
    # converter's options): an operator wants errors only, and the build's own progress.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # TensorFlow 2.21 prints its oneDNN notice through absl whatever the level above; without
    # oneDNN's kernels there is no notice, and the converter computes nothing they would speed.
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    try:
        import tensorflow as tf
    except ImportError as exc:
        raise TfliteExportError(
            "TFLite export needs TensorFlow at build time: pip install tensorflow-cpu"
        ) from exc
    tf.get_logger().setLevel(logging.ERROR)
    logging.getLogger("absl").setLevel(logging.WARNING)
    return tf


def export_tflite(
    config: LlamaConfig,
    weights: Mapping[str, F32],
    embed_q8: QuantizedMatrix,
    out_path: Path,
) -> Path:
    """Convert a draft (config.n_layers blocks, trimmed head `lm_head.weight`) to TFLite.

    Matrices are stored as fp16 (the converter's float16 mode; the interpreter widens them once at
    load) and computed in fp32. The embedding stays in the target's q8_0 blocks: int8 codes and
    per-block scales, gathered row by row, so the 49k-row table costs a byte per weight.
    """
    tf = _require_tf()
    c = config
    group = c.n_heads // c.n_kv_heads
    codes = (embed_q8.codes.astype(np.int16) - 128).astype(np.int8)  # [vocab, n_blocks, 32]
    codes_t = tf.constant(codes.reshape(embed_q8.rows, embed_q8.cols))
    scales_t = tf.constant(embed_q8.scales.astype(np.float32))  # [vocab, n_blocks]

    def const(name: str) -> Any:
        return tf.constant(np.asarray(weights[name], dtype=np.float32))

    def linear_t(name: str) -> Any:  # [in, out]
        return tf.constant(np.ascontiguousarray(np.asarray(weights[name], np.float32).T))

    layers = []
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        layers.append(
            {
                "in_norm": const(p + "input_layernorm.weight"),
                "q": linear_t(p + "self_attn.q_proj.weight"),
                "k": linear_t(p + "self_attn.k_proj.weight"),
                "v": linear_t(p + "self_attn.v_proj.weight"),
                "o": linear_t(p + "self_attn.o_proj.weight"),
                "post_norm": const(p + "post_attention_layernorm.weight"),
                "gate": linear_t(p + "mlp.gate_proj.weight"),
                "up": linear_t(p + "mlp.up_proj.weight"),
                "down": linear_t(p + "mlp.down_proj.weight"),
            }
        )
    final_norm = const("model.norm.weight")
    head_t = linear_t(HEAD)  # [d_model, head]
    eps = float(c.rms_eps)
    scale = float(1.0 / np.sqrt(c.head_dim))
    half = c.head_dim // 2

    def rms_norm(x: Any, weight: Any) -> Any:
        return x * tf.math.rsqrt(tf.reduce_mean(x * x, axis=-1, keepdims=True) + eps) * weight

    def rope(x: Any, cos: Any, sin: Any) -> Any:  # x [heads, new, hd]
        rotated = tf.concat([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    spec = [
        tf.TensorSpec([None], tf.int32, name=INPUT_IDS),
        tf.TensorSpec([None, c.head_dim], tf.float32, name=ROPE_COS),
        tf.TensorSpec([None, c.head_dim], tf.float32, name=ROPE_SIN),
        tf.TensorSpec([c.n_layers, c.n_kv_heads, None, c.head_dim], tf.float32, name=PAST_KEYS),
        tf.TensorSpec([c.n_layers, c.n_kv_heads, None, c.head_dim], tf.float32, name=PAST_VALUES),
    ]

    @tf.function(input_signature=spec)  # type: ignore[untyped-decorator]
    def step(input_ids: Any, cos: Any, sin: Any, past_keys: Any, past_values: Any) -> Any:
        new = tf.shape(input_ids)[0]
        past = tf.shape(past_keys)[2]
        rows = tf.cast(tf.gather(codes_t, input_ids), tf.float32)
        rows = tf.reshape(rows, [new, embed_q8.n_blocks, 32])
        x = tf.reshape(rows * tf.gather(scales_t, input_ids)[..., None], [new, c.d_model])
        # Query i (absolute past + i) sees keys 0 .. past + i.
        key_pos = tf.range(past + new)[None, :]
        query_pos = (past + tf.range(new))[:, None]
        bias = tf.where(key_pos <= query_pos, 0.0, -1.0e30)  # [new, past + new]
        new_keys, new_values = [], []
        for i, w in enumerate(layers):
            h = rms_norm(x, w["in_norm"])
            q = tf.transpose(tf.reshape(h @ w["q"], [new, c.n_heads, c.head_dim]), [1, 0, 2])
            k = tf.transpose(tf.reshape(h @ w["k"], [new, c.n_kv_heads, c.head_dim]), [1, 0, 2])
            v = tf.transpose(tf.reshape(h @ w["v"], [new, c.n_kv_heads, c.head_dim]), [1, 0, 2])
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            new_keys.append(k)
            new_values.append(v)
            keys = tf.concat([past_keys[i], k], axis=1)  # [n_kv, total, hd]
            values = tf.concat([past_values[i], v], axis=1)
            q4 = tf.reshape(q, [c.n_kv_heads, group * new, c.head_dim]) * scale
            scores = tf.reshape(
                tf.matmul(q4, keys, transpose_b=True), [c.n_kv_heads, group, new, -1]
            )
            probs = tf.nn.softmax(scores + bias, axis=-1)
            context = tf.matmul(tf.reshape(probs, [c.n_kv_heads, group * new, -1]), values)
            context = tf.reshape(context, [c.n_heads, new, c.head_dim])
            context = tf.reshape(tf.transpose(context, [1, 0, 2]), [new, c.d_model])
            x = x + context @ w["o"]
            h = rms_norm(x, w["post_norm"])
            x = x + (tf.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]
        logits = rms_norm(x, final_norm) @ head_t
        # Two outputs of different rank, so the runtime tells them apart without names.
        return {LOGITS: logits, NEW_KV: tf.stack([tf.stack(new_keys), tf.stack(new_values)])}

    concrete = step.get_concrete_function()
    converter = tf.lite.TFLiteConverter.from_concrete_functions([concrete], step)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.target_spec.supported_types = [tf.float16]
    try:
        flatbuffer = converter.convert()
    except Exception as exc:  # the converter raises many unrelated types; keep its message
        raise TfliteExportError(f"TFLite conversion failed: {exc}") from exc
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(flatbuffer)
    return out_path
