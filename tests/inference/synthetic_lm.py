"""A tiny deterministic language model over a small vocabulary that implements the Runtime protocol.

It is a real model, only small: a linear recurrence h_t = decay * h_{t-1} + E[x_t] with fixed
random weights and logits = sharpness * W h_t + b, so every next-token distribution depends on
the whole prefix, and a cache of per-position states can be trimmed like a KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

Logits = npt.NDArray[np.float32]


@dataclass
class SyntheticCache:
    """Per-position hidden states of one sequence; trimming drops the tail."""

    states: list[npt.NDArray[np.float64]] = field(default_factory=list)  # each [dim]

    @property
    def length(self) -> int:
        return len(self.states)

    def trim(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} positions to {length}")
        del self.states[length:]


@dataclass
class SyntheticLM:
    """The model; `perturbed` gives a related model to act as a draft."""

    embed: npt.NDArray[np.float64]  # [V, dim]
    head: npt.NDArray[np.float64]  # [V, dim]
    bias: npt.NDArray[np.float64]  # [V]
    decay: float = 0.6
    sharpness: float = 1.0
    name: str = "synthetic"
    forward_calls: int = 0

    @classmethod
    def random(
        cls, vocab_size: int = 8, dim: int = 6, seed: int = 0, sharpness: float = 1.0
    ) -> SyntheticLM:
        rng = np.random.default_rng(seed)
        return cls(
            embed=rng.normal(size=(vocab_size, dim)),
            head=rng.normal(size=(vocab_size, dim)),
            bias=rng.normal(scale=0.5, size=vocab_size),
            sharpness=sharpness,
        )

    def perturbed(self, scale: float, seed: int, name: str = "synthetic-draft") -> SyntheticLM:
        rng = np.random.default_rng(seed)
        return SyntheticLM(
            embed=self.embed + rng.normal(scale=scale, size=self.embed.shape),
            head=self.head + rng.normal(scale=scale, size=self.head.shape),
            bias=self.bias + rng.normal(scale=scale, size=self.bias.shape),
            decay=self.decay,
            sharpness=self.sharpness,
            name=name,
        )

    @property
    def vocab_size(self) -> int:
        return int(self.embed.shape[0])

    def new_cache(self) -> SyntheticCache:
        return SyntheticCache()

    def forward(self, token_ids: Sequence[int], cache: SyntheticCache) -> Logits:
        self.forward_calls += 1
        h = cache.states[-1] if cache.states else np.zeros(self.embed.shape[1])
        rows = []
        for token in token_ids:
            h = self.decay * h + self.embed[token]
            cache.states.append(h)
            rows.append(self.sharpness * (self.head @ h) + self.bias)
        return np.asarray(rows, dtype=np.float32).reshape(len(rows), self.vocab_size)

    def forward_batch(
        self, requests: Sequence[tuple[Sequence[int], SyntheticCache]]
    ) -> list[Logits]:
        return [self.forward(ids, cache) for ids, cache in requests]

    # Its states h_t are its features, as a FeatureRuntime hands them to a feature drafter.
    has_hidden = True

    @property
    def hidden_size(self) -> int:
        return int(self.embed.shape[1])

    def forward_batch_hidden(
        self, requests: Sequence[tuple[Sequence[int], SyntheticCache]]
    ) -> list[tuple[Logits, npt.NDArray[np.float32]]]:
        scored = []
        for ids, cache in requests:
            logits = self.forward(ids, cache)
            hidden = np.asarray(cache.states[len(cache.states) - len(ids) :], dtype=np.float32)
            scored.append((logits, hidden))
        return scored


@dataclass
class TrimmedHeadLM:
    """A model whose output axis covers only `head_ids`, as a draft with a trimmed head has."""

    full: SyntheticLM
    head_ids: npt.NDArray[np.int64]  # [V'] target ids of the output columns
    name: str = "synthetic-trimmed"

    @property
    def vocab_size(self) -> int:
        return int(self.head_ids.shape[0])

    def new_cache(self) -> SyntheticCache:
        return SyntheticCache()

    def forward(self, token_ids: Sequence[int], cache: SyntheticCache) -> Logits:
        return self.full.forward(token_ids, cache)[:, self.head_ids]

    def forward_batch(
        self, requests: Sequence[tuple[Sequence[int], SyntheticCache]]
    ) -> list[Logits]:
        return [self.forward(ids, cache) for ids, cache in requests]
