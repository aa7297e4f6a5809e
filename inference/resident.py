"""What a draft costs resident once loaded, estimated from its manifest.

The device's memory admission checks a load against it, and the coordinator's policy checks a
draft a device lacks against the memory the device reports free before it has the draft
fetched; both use this one estimate.

Measured here (draft-l1 / draft-l2 on ONNX Runtime 1.x, CPU): 105 / 161 MB resident after the
load for 42 / 54 MB files, 108 / 171 MB after 500 positions; LiteRT reached 138 MB for draft-l2
after the same passes. RESIDENT_FACTOR times the file covers both.
"""

from __future__ import annotations

from typing import Any

MB = 1024 * 1024
RESIDENT_FACTOR = 3.0
# The KV cache a session of up to this many positions (prompt and answer) holds, fp32.
KV_CONTEXT_TOKENS = 2048
# A draft child process: Python with numpy and the runtime imported (54 MB measured), before
# the model.
CHILD_PROCESS_BYTES = 56 * MB


def resident_bytes(manifest: Any, isolated: bool, context_tokens: int = KV_CONTEXT_TOKENS) -> int:
    """The estimated resident cost of loading a draft or head from its manifest."""
    config = manifest.config
    per_position = (
        2
        * int(config.get("n_layers", 0))
        * int(config.get("n_kv_heads", config.get("n_heads", 0)))
        * int(config.get("head_dim", 0))
        * 4
    )
    weights = int(manifest.size_bytes * RESIDENT_FACTOR)
    return weights + per_position * context_tokens + (CHILD_PROCESS_BYTES if isolated else 0)
