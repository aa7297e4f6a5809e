"""The Runtime protocol: a causal LM with a per-sequence KV cache, whatever engine runs it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

Logits = npt.NDArray[np.float32]
Features = npt.NDArray[np.float32]  # last-layer hidden states after the final norm


class KVCache(Protocol):
    """The attention cache of one sequence; it can roll back to any committed length."""

    @property
    def length(self) -> int:
        """Number of positions held."""
        ...

    def trim(self, length: int) -> None:
        """Drop every position at or after `length` (0 <= length <= self.length)."""
        ...


class Runtime(Protocol):
    """A causal language model run by one engine (ONNX Runtime, LiteRT, ...)."""

    name: str
    vocab_size: int  # size of the output axis of the logits

    def new_cache(self) -> KVCache:
        """An empty cache for a new sequence."""
        ...

    def forward(self, token_ids: Sequence[int], cache: KVCache) -> Logits:
        """Append `token_ids` after the cache; return logits # [len(token_ids), vocab_size]."""
        ...

    def forward_batch(self, requests: Sequence[tuple[Sequence[int], KVCache]]) -> list[Logits]:
        """Score several sequences in one pass; per sequence, the contract of `forward`."""
        ...


@runtime_checkable
class FeatureRuntime(Runtime, Protocol):
    """A Runtime that can also hand out its last hidden state, the features a head drafts from.

    Only a pass that asks pays for them: `forward_batch` never copies them out.
    """

    has_hidden: bool  # False when the model was built without the output
    hidden_size: int

    def forward_batch_hidden(
        self, requests: Sequence[tuple[Sequence[int], KVCache]]
    ) -> list[tuple[Logits, Features]]:
        """`forward_batch`, plus each sequence's hidden states # [len(token_ids), hidden_size]."""
        ...
