"""ONNX Runtime behind the Runtime protocol; the only module that imports onnxruntime."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from inference.model_config import F32, LlamaConfig
from inference.onnx_io import (
    ATTENTION_MASK,
    HIDDEN,
    INPUT_IDS,
    LOGITS,
    META_CONFIG,
    META_HEAD_IDS,
    POSITION_IDS,
    past_name,
    present_name,
)
from inference.runtime import KVCache, Logits

# The execution providers a verifier may ask for, by their command-line names.
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


class ProviderError(Exception):
    """An execution provider this onnxruntime build does not have."""


def check_provider(provider: str) -> None:
    """Refuse, in one line, a provider that is unknown or missing from this onnxruntime."""
    if provider not in PROVIDERS:
        raise ProviderError(f"unknown provider {provider!r}; one of {', '.join(PROVIDERS)}")
    available = ort.get_available_providers()
    if PROVIDERS[provider] not in available:
        raise ProviderError(
            f"provider {provider}: this onnxruntime has no {PROVIDERS[provider]} (it has "
            f"{', '.join(available)}); CUDA needs onnxruntime-gpu and an NVIDIA GPU"
        )


def _provider_chain(provider: str) -> list[str]:
    """The provider, then the CPU for the few operators it lacks."""
    return [PROVIDERS[provider]] + ([] if provider == "cpu" else [PROVIDERS["cpu"]])


class OnnxKVCache:
    """Keys and values of one sequence, per layer # [1, n_kv, length, head_dim]."""

    def __init__(self, keys: list[F32], values: list[F32]) -> None:
        self.keys = keys
        self.values = values

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2])

    def trim(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} positions to {length}")
        if length == self.length:
            return
        # A view, not a copy (a rejected window's rollback copied the whole cache, ~14 MB for
        # SmolLM2-135M at 300 positions): the next pass copies every cache into its batch
        # anyway, a lone row's made contiguous there, and the positions cut off go with it.
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]

    def copy(self) -> OnnxKVCache:
        return OnnxKVCache([k.copy() for k in self.keys], [v.copy() for v in self.values])


def _own_cache(cache: KVCache) -> OnnxKVCache:
    if not isinstance(cache, OnnxKVCache):
        raise TypeError(f"OnnxRuntime needs its own caches, got {type(cache).__name__}")
    return cache


@dataclass(frozen=True)
class _LastBatch:
    """A pass of several rows, each of which took every position of the pass (no right
    padding): its `presents` are, row for row, the left-padded pasts of the next pass over the
    same caches, as long as no cache has changed since (each still holds the lists this pass
    gave it; a trim to another length, or another pass, gives it new ones)."""

    caches: tuple[OnnxKVCache, ...]
    keys: tuple[list[F32], ...]
    values: tuple[list[F32], ...]
    presents: tuple[F32, ...]  # [2 * n_layers], key and value of each layer in turn

    def continues(self, caches: Sequence[OnnxKVCache]) -> bool:
        return len(caches) == len(self.caches) and all(
            cache is last and cache.keys is keys and cache.values is values
            for cache, last, keys, values in zip(
                caches, self.caches, self.keys, self.values, strict=True
            )
        )


@dataclass(frozen=True)
class StepOutput:
    """One sequence's share of a forward pass."""

    logits: Logits  # [new, head]
    hidden: F32 | None  # [new, d_model] after the final norm, when the pass asked for it


class OnnxRuntime:
    """A decoder built by `modelbuild.onnx_graph`, run by one execution provider (CPU default)."""

    def __init__(
        self,
        model_path: Path,
        *,
        threads: int | None = None,
        allow_spinning: bool = False,
        consistent_decode: bool = True,
        name: str | None = None,
        provider: str = "cpu",
    ) -> None:
        check_provider(provider)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads is not None:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # Spinning threads of two sessions on a small machine steal each other's cores.
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if allow_spinning else "0"
        )
        self.provider = provider
        self.session = ort.InferenceSession(
            str(model_path), sess_options=options, providers=_provider_chain(provider)
        )
        # ORT falls back to the CPU when a GPU provider cannot start (no device, no driver).
        active = self.session.get_providers()[0]
        if active != PROVIDERS[provider]:
            raise ProviderError(f"provider {provider}: onnxruntime fell back to {active}")
        self.name = name or model_path.stem
        # CPU kernels take another path for a single row, whose last bits differ from those of
        # the same row inside a window. Running a one-token step as two rows (the second a
        # throwaway after it, hidden by the causal mask) makes plain decoding agree bit for bit
        # with verification windows, at the price of one extra row per step.
        self.consistent_decode = consistent_decode
        metadata = self.session.get_modelmeta().custom_metadata_map
        self.config = LlamaConfig.from_json(json.loads(metadata[META_CONFIG]))
        head = metadata.get(META_HEAD_IDS)  # absent for a full-vocabulary head
        self.head_ids: npt.NDArray[np.int64] | None = (
            np.asarray(json.loads(head), dtype=np.int64) if head is not None else None
        )
        self.vocab_size = (
            self.config.vocab_size if self.head_ids is None else int(self.head_ids.shape[0])
        )
        self._outputs = [LOGITS] + [
            present_name(i, kind) for i in range(self.config.n_layers) for kind in ("key", "value")
        ]
        self.has_hidden = HIDDEN in {output.name for output in self.session.get_outputs()}
        self.hidden_size = self.config.d_model
        # Steady batched decoding (the same rows, one token each, pass after pass) feeds a
        # pass's presents to the next one as they are: copying every row's cache into a new
        # padded batch took a third of a 16-row pass on a CPU. Holds one batch's cache more.
        self._last: _LastBatch | None = None

    def new_cache(self) -> OnnxKVCache:
        c = self.config
        empty = np.zeros((1, c.n_kv_heads, 0, c.head_dim), dtype=np.float32)
        return OnnxKVCache([empty] * c.n_layers, [empty] * c.n_layers)

    def forward(self, token_ids: Sequence[int], cache: KVCache) -> Logits:
        return self.run_batch([(token_ids, cache)])[0].logits

    def forward_batch(self, requests: Sequence[tuple[Sequence[int], KVCache]]) -> list[Logits]:
        return [step.logits for step in self.run_batch(requests)]

    def forward_batch_hidden(
        self, requests: Sequence[tuple[Sequence[int], KVCache]]
    ) -> list[tuple[Logits, F32]]:
        steps = self.run_batch(requests, with_hidden=True)
        return [(step.logits, step.hidden) for step in steps if step.hidden is not None]

    def run_batch(
        self, requests: Sequence[tuple[Sequence[int], KVCache]], *, with_hidden: bool = False
    ) -> list[StepOutput]:
        """One pass over several sequences; each cache grows by its own new tokens.

        Pasts are left-padded to the longest and new tokens right-padded to the longest, so every
        row's new block starts at the same slot; `attention_mask` hides the padding. The hidden
        states come back only `with_hidden`: ORT copies out only the outputs asked for.
        """
        if not requests:
            return []
        if with_hidden and not self.has_hidden:
            raise ValueError(f"{self.name} was built without the {HIDDEN!r} output")
        c = self.config
        own = [(ids, _own_cache(cache)) for ids, cache in requests]
        past_lens = [cache.length for _, cache in own]
        new_lens = [len(ids) for ids, _ in own]
        if min(new_lens) == 0:
            raise ValueError("every sequence needs at least one new token")
        batch, past, new = len(own), max(past_lens), max(new_lens)
        if batch == 1 and new == 1 and self.consistent_decode:
            new = 2

        input_ids = np.zeros((batch, new), dtype=np.int64)
        position_ids = np.zeros((batch, new), dtype=np.int64)
        mask = np.zeros((batch, past + new), dtype=np.int64)
        for row, ((ids, _), p, n) in enumerate(zip(own, past_lens, new_lens, strict=True)):
            input_ids[row, :n] = ids
            position_ids[row] = np.arange(p, p + new)
            mask[row, past - p : past + n] = 1

        feeds: dict[str, npt.NDArray[np.generic]] = {
            INPUT_IDS: input_ids,
            POSITION_IDS: position_ids,
            ATTENTION_MASK: mask,
        }
        last, self._last = self._last, None
        if last is not None and batch > 1 and last.continues([cache for _, cache in own]):
            for layer in range(c.n_layers):
                feeds[past_name(layer, "key")] = last.presents[2 * layer]
                feeds[past_name(layer, "value")] = last.presents[2 * layer + 1]
        else:
            self._stack_pasts(feeds, own, past_lens, past)

        outputs_asked = [*self._outputs, HIDDEN] if with_hidden else self._outputs
        results = self.session.run(outputs_asked, feeds)
        logits = results[0]
        presents = results[1 : 1 + 2 * c.n_layers]
        hidden = results[-1] if with_hidden else None

        outputs: list[StepOutput] = []
        for row, ((_, cache), p, n) in enumerate(zip(own, past_lens, new_lens, strict=True)):
            start, stop = past - p, past + n
            if batch == 1 and n == new:  # the common case needs no copy
                cache.keys, cache.values = list(presents[0::2]), list(presents[1::2])
            else:
                cache.keys = [
                    np.ascontiguousarray(k[row : row + 1, :, start:stop]) for k in presents[0::2]
                ]
                cache.values = [
                    np.ascontiguousarray(v[row : row + 1, :, start:stop]) for v in presents[1::2]
                ]
            outputs.append(
                StepOutput(
                    logits=logits[row, :n],
                    hidden=hidden[row, :n] if hidden is not None else None,
                )
            )
        if batch > 1 and min(new_lens) == new:
            caches = tuple(cache for _, cache in own)
            self._last = _LastBatch(
                caches,
                tuple(cache.keys for cache in caches),
                tuple(cache.values for cache in caches),
                tuple(presents),
            )
        return outputs

    def _stack_pasts(
        self,
        feeds: dict[str, npt.NDArray[np.generic]],
        own: list[tuple[Sequence[int], OnnxKVCache]],
        past_lens: list[int],
        past: int,
    ) -> None:
        """Every row's cache into the batch's past of each layer, left-padded to `past`."""
        c = self.config
        batch = len(own)
        padded = batch > 1 and min(past_lens) != past
        for layer in range(c.n_layers):
            for kind in ("key", "value"):
                parts = [(cache.keys if kind == "key" else cache.values)[layer] for _, cache in own]
                if batch == 1:  # a copy only after a rollback left a view
                    feeds[past_name(layer, kind)] = np.ascontiguousarray(parts[0])
                elif not padded:
                    feeds[past_name(layer, kind)] = np.concatenate(parts, axis=0)
                else:
                    stacked = np.zeros((batch, c.n_kv_heads, past, c.head_dim), dtype=np.float32)
                    for row, (part, p) in enumerate(zip(parts, past_lens, strict=True)):
                        stacked[row, :, past - p :] = part[0]
                    feeds[past_name(layer, kind)] = stacked


class OnnxGraph:
    """Any ONNX graph run on the CPU by input and output names (a feature head's step)."""

    def __init__(self, model_path: Path, *, threads: int | None = None) -> None:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads is not None:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # As OnnxRuntime: spinning threads of two sessions on a small machine steal each other's.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(
            str(model_path), sess_options=options, providers=["CPUExecutionProvider"]
        )

    def run(
        self, outputs: Sequence[str], feeds: dict[str, npt.NDArray[np.generic]]
    ) -> list[npt.NDArray[np.float32]]:
        results: list[npt.NDArray[np.float32]] = self.session.run(list(outputs), feeds)
        return results
