"""The inputs, outputs and metadata keys of the ONNX decoders we build (modelbuild/onnx_graph.py)
and run (inference/onnx_runtime.py): the contract between the two, without importing `onnx`."""

from __future__ import annotations

INPUT_IDS = "input_ids"  # [batch, new] int64
POSITION_IDS = "position_ids"  # [batch, new] int64
ATTENTION_MASK = "attention_mask"  # [batch, past + new] int64, 1 = a real position
LOGITS = "logits"  # [batch, new, head]
HIDDEN = "hidden"  # [batch, new, d_model], after the final norm: the features a head drafts from
META_HEAD_IDS = "specfleet.head_ids"  # JSON list of vocabulary ids of a trimmed head
META_CONFIG = "specfleet.config"  # JSON LlamaConfig (with the graph's own n_layers)


def past_name(layer: int, kind: str) -> str:
    """Cache input of one layer; kind is "key" or "value". # [batch, n_kv, past, head_dim]"""
    return f"past_key_values.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    """Cache output of one layer. # [batch, n_kv, past + new, head_dim]"""
    return f"present.{layer}.{kind}"
