"""The shape of a llama-family decoder, as the runtimes read it from a built model's manifest
(modelbuild/gguf_source.py reads it from a GGUF)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and constants of a llama-family decoder."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_base: float
    rms_eps: float
    bos_id: int
    eos_id: int
    context_length: int = 8192
    architecture: str = "llama"  # the GGUF's general.architecture

    def with_layers(self, n_layers: int) -> LlamaConfig:
        """The same model cut to its first `n_layers` blocks (a draft built from the target)."""
        if not 1 <= n_layers <= self.n_layers:
            raise ValueError(f"n_layers must be in 1..{self.n_layers}, got {n_layers}")
        return LlamaConfig(**{**asdict(self), "n_layers": n_layers})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> LlamaConfig:
        return cls(**fields)
