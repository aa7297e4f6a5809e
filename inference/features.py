"""The target's features on the bus: its last hidden state at one position, fp16, in base64.

A verdict carries them for a feature drafter (`broker.messages.Verdict.features`); the bus
contract checks the encoding, these two turn it into numbers and back.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from broker.messages import encode_features, feature_bytes

F32 = npt.NDArray[np.float32]
WIRE_DTYPE = np.dtype("<f2")
# The largest finite fp16. A hidden state after the final norm stays in the tens here (SmolLM2:
# max |h| about 50 on chat prompts, fp16 error under 0.014); a larger one is clipped, never inf.
FP16_MAX = float(np.finfo(np.float16).max)


def features_to_wire(vector: npt.ArrayLike) -> str:
    """One position's hidden state # [hidden_size] as the `features` field; ValueError if it
    is not finite (a broken pass, whose features no drafter should use)."""
    values = np.asarray(vector, dtype=np.float32).reshape(-1)
    if not np.isfinite(values).all():
        raise ValueError("the hidden state holds an infinite or NaN value")
    clipped = np.clip(values, -FP16_MAX, FP16_MAX)
    return encode_features(clipped.astype(WIRE_DTYPE).tobytes())


def features_from_wire(text: str) -> F32:
    """The `features` field as float32 # [hidden_size]; ValueError (with the reason) if bad."""
    return np.frombuffer(feature_bytes(text), dtype=WIRE_DTYPE).astype(np.float32)
