"""The tensors of the TFLite drafts we export (modelbuild/tflite_export.py) and run
(inference/litert_runtime.py), and the rotary tables both compute, without TensorFlow."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from inference.model_config import F32, LlamaConfig

INPUT_IDS = "input_ids"  # [new] int32
ROPE_COS = "rope_cos"  # [new, head_dim] float32, for the absolute positions of the new tokens
ROPE_SIN = "rope_sin"  # [new, head_dim]
PAST_KEYS = "past_keys"  # [n_layers, n_kv, past, head_dim]
PAST_VALUES = "past_values"  # [n_layers, n_kv, past, head_dim]
LOGITS = "logits"  # [new, head]
NEW_KV = "new_kv"  # [2, n_layers, n_kv, new, head_dim]: keys then values of the new positions


def rope_tables(config: LlamaConfig, start: int, count: int) -> tuple[F32, F32]:
    """cos, sin # [count, head_dim] for positions start .. start + count - 1 (fp32, as ONNX)."""
    hd = config.head_dim
    inv_freq = (1.0 / (config.rope_base ** (np.arange(0, hd, 2, dtype=np.float64) / hd))).astype(
        np.float32
    )
    positions = np.arange(start, start + count, dtype=np.float32)
    angles = positions[:, None] * inv_freq[None, :]
    full: npt.NDArray[np.float32] = np.concatenate([angles, angles], axis=-1)
    return np.cos(full).astype(np.float32), np.sin(full).astype(np.float32)
