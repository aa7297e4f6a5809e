"""ONNX Runtime behind the Runtime protocol; the only module that imports onnxruntime."""

from __future__ import annotations

import json
import time
import weakref
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


# A batch whose rows come from one earlier pass takes that pass's presents as its pasts, dead
# slots (rejected positions, right padding, rows gone) and all, until the dead slots beyond
# the longest row pass this many, or this share of it; then its rows are stacked anew.
DEAD_SLOTS_MIN = 16
DEAD_SLOTS_SHARE = 1 / 8

Slots = npt.NDArray[np.bool_]


class OnnxKVCache:
    """Keys and values of one sequence, per layer # [1, n_kv, length, head_dim].

    After a pass a cache is its row of that pass's presents, left where they are
    (`_Pass`): its positions are the slots `valid` marks, so that a rejected window's positions
    and a shorter row's padding become dead slots rather than a copy. Its own arrays are made
    only when it is needed alone: a pass of it alone, its keys read, or its pass's other rows
    gone on without it.
    """

    def __init__(self, keys: list[F32], values: list[F32]) -> None:
        self._keys: list[F32] = keys
        self._values: list[F32] = values
        self._length = int(keys[0].shape[2])
        self._pass: _Pass | None = None
        self._row = 0
        self._valid: Slots | None = None  # [slots of the pass], set while in a pass

    @property
    def length(self) -> int:
        return self._length

    @property
    def keys(self) -> list[F32]:
        self._detach()
        return self._keys

    @property
    def values(self) -> list[F32]:
        self._detach()
        return self._values

    def trim(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot trim a cache of {self._length} positions to {length}")
        if length == self._length:
            return
        if self._valid is not None:
            valid = self._valid.copy()
            valid[np.flatnonzero(valid)[length:]] = False
            self._valid = valid
        else:
            # A view, not a copy (a rejected window's rollback copied the whole cache, ~14 MB
            # for SmolLM2-135M at 300 positions): a lone row's is made contiguous by its next
            # pass, and the positions cut off go with it.
            self._keys = [k[:, :, :length] for k in self._keys]
            self._values = [v[:, :, :length] for v in self._values]
        self._length = length

    def copy(self) -> OnnxKVCache:
        keys, values = self._parts()
        return OnnxKVCache([k.copy() for k in keys], [v.copy() for v in values])

    def _parts(self) -> tuple[list[F32], list[F32]]:
        """Per layer, its positions in order # [1, n_kv, length, head_dim]: its own arrays, or
        its row of its pass (views where its slots are contiguous, copies where not)."""
        if self._pass is None or self._valid is None:
            return self._keys, self._values
        slots = np.flatnonzero(self._valid)
        row = self._row
        presents = self._pass.presents
        if slots.size and int(slots[-1]) - int(slots[0]) + 1 == slots.size:
            span = slice(int(slots[0]), int(slots[-1]) + 1)
            return (
                [k[row : row + 1, :, span] for k in presents[0::2]],
                [v[row : row + 1, :, span] for v in presents[1::2]],
            )
        return (
            [k[row : row + 1][:, :, slots] for k in presents[0::2]],
            [v[row : row + 1][:, :, slots] for v in presents[1::2]],
        )

    def _join(self, done: _Pass, row: int, valid: Slots, length: int) -> None:
        self._pass, self._row, self._valid, self._length = done, row, valid, length
        self._keys = self._values = []

    def _detach(self) -> None:
        """Arrays of its own, out of its pass."""
        if self._pass is None:
            return
        keys, values = self._parts()
        self._keys = [np.ascontiguousarray(k) for k in keys]
        self._values = [np.ascontiguousarray(v) for v in values]
        self._pass, self._valid = None, None


class _Pass:
    """The presents of one pass, kept as the caches of its rows."""

    __slots__ = ("caches", "presents")

    def __init__(self, presents: tuple[F32, ...], caches: list[OnnxKVCache]) -> None:
        self.presents = presents  # key and value of each layer in turn # [rows, n_kv, slots, d]
        # By row, weakly: a cache its session dropped is not copied out for nobody.
        self.caches = [weakref.ref(cache) for cache in caches]

    def release(self) -> None:
        """Copy out the rows still here: the others have gone on to another pass, and a pass
        kept alive by a few rows would hold every row's memory."""
        for ref in self.caches:
            cache = ref()
            if cache is not None and cache._pass is self:
                cache._detach()
        self.caches = []


def _own_cache(cache: KVCache) -> OnnxKVCache:
    if not isinstance(cache, OnnxKVCache):
        raise TypeError(f"OnnxRuntime needs its own caches, got {type(cache).__name__}")
    return cache


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
        # Time spent stacking rows' caches into a batch or taking rows out of an earlier pass,
        # in all: a pass's cost beyond what its shape costs in place, paid when its rows change
        # (goodput control leaves it out).
        self.stack_ms = 0.0
        self.hidden_size = self.config.d_model

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
        row's new block starts at the same slot; `attention_mask` hides the padding and the dead
        slots, and `position_ids` count each row's own positions. Rows that all come from one
        earlier pass run on its presents as they are, or on those rows taken from them
        (`_pasts_in_place`); others are stacked. The hidden states come back only
        `with_hidden`: ORT copies out only the outputs asked for.
        """
        if not requests:
            return []
        if with_hidden and not self.has_hidden:
            raise ValueError(f"{self.name} was built without the {HIDDEN!r} output")
        c = self.config
        caches = [_own_cache(cache) for _, cache in requests]
        token_ids = [ids for ids, _ in requests]
        lengths = [cache.length for cache in caches]
        new_lens = [len(ids) for ids in token_ids]
        if min(new_lens) == 0:
            raise ValueError("every sequence needs at least one new token")
        batch, new = len(caches), max(new_lens)
        if batch == 1 and new == 1 and self.consistent_decode:
            new = 2

        feeds: dict[str, npt.NDArray[np.generic]] = {}
        valid = self._pasts_in_place(feeds, caches, lengths)
        if valid is None:
            started = time.perf_counter()
            valid = self._stack_pasts(feeds, caches, lengths)
            self.stack_ms += (time.perf_counter() - started) * 1e3
        slots = valid.shape[1]
        input_ids = np.zeros((batch, new), dtype=np.int64)
        position_ids = np.zeros((batch, new), dtype=np.int64)
        mask = np.zeros((batch, slots + new), dtype=np.int64)
        mask[:, :slots] = valid
        for row, (ids, length, n) in enumerate(zip(token_ids, lengths, new_lens, strict=True)):
            input_ids[row, :n] = ids
            position_ids[row] = np.arange(length, length + new)
            mask[row, slots : slots + n] = 1
        feeds[INPUT_IDS] = input_ids
        feeds[POSITION_IDS] = position_ids
        feeds[ATTENTION_MASK] = mask

        outputs_asked = [*self._outputs, HIDDEN] if with_hidden else self._outputs
        results = self.session.run(outputs_asked, feeds)
        logits = results[0]
        presents = tuple(results[1 : 1 + 2 * c.n_layers])
        hidden = results[-1] if with_hidden else None

        earlier = {id(cache._pass): cache._pass for cache in caches if cache._pass is not None}
        done = _Pass(presents, caches)
        kept = mask.astype(np.bool_)
        for row, (cache, length, n) in enumerate(zip(caches, lengths, new_lens, strict=True)):
            cache._join(done, row, kept[row], length + n)
        for source in earlier.values():
            source.release()
        return [
            StepOutput(
                logits=logits[row, :n], hidden=hidden[row, :n] if hidden is not None else None
            )
            for row, n in enumerate(new_lens)
        ]

    def _pasts_in_place(
        self,
        feeds: dict[str, npt.NDArray[np.generic]],
        caches: list[OnnxKVCache],
        lengths: list[int],
    ) -> Slots | None:
        """The pasts of rows that all come from one earlier pass, and their valid slots: its
        presents as they are (the same rows in the same order), or those rows taken from them
        (one copy a layer, the slots no row uses dropped). None when the rows must be stacked:
        a lone row (kept bit for bit as decoding alone leaves it), rows of several passes or of
        none, or more dead slots than `DEAD_SLOTS_MIN` and `DEAD_SLOTS_SHARE` allow."""
        source = caches[0]._pass
        if len(caches) < 2 or source is None or any(c._pass is not source for c in caches):
            return None
        rows = [cache._row for cache in caches]
        valid = np.stack([cache._valid for cache in caches if cache._valid is not None])
        longest = max(lengths)
        allowed = max(DEAD_SLOTS_MIN, int(longest * DEAD_SLOTS_SHARE))
        c = self.config
        if rows == list(range(len(source.caches))) and valid.shape[1] - longest <= allowed:
            pasts = source.presents
        else:
            used = np.flatnonzero(valid.any(axis=0))
            start = int(used[0]) if used.size else valid.shape[1]
            if valid.shape[1] - start - longest > allowed:
                return None
            # A copy of every row kept, each layer: paid because the rows changed (a session
            # left the batch, or the rows came in another order), whatever the window, as
            # stacking is; counted with it (bench e2e at 16 streams: the first pass after a
            # session ended took ~60 ms more than the next, and a cost model that took it for
            # the shape's priced plain passes up to half again as dear for the next ten).
            started = time.perf_counter()
            index = np.asarray(rows)
            pasts = tuple(present[index, :, start:] for present in source.presents)
            self.stack_ms += (time.perf_counter() - started) * 1e3
            valid = valid[:, start:]
        for layer in range(c.n_layers):
            feeds[past_name(layer, "key")] = pasts[2 * layer]
            feeds[past_name(layer, "value")] = pasts[2 * layer + 1]
        return valid

    def _stack_pasts(
        self,
        feeds: dict[str, npt.NDArray[np.generic]],
        caches: list[OnnxKVCache],
        lengths: list[int],
    ) -> Slots:
        """Every row's positions into the batch's past of each layer, left-padded to the
        longest; the valid slots."""
        c = self.config
        batch, past = len(caches), max(lengths)
        padded = batch > 1 and min(lengths) != past
        parts = [cache._parts() for cache in caches]
        for layer in range(c.n_layers):
            for side, kind in enumerate(("key", "value")):
                arrays = [part[side][layer] for part in parts]
                if batch == 1:  # a copy only where the row is not contiguous
                    feeds[past_name(layer, kind)] = np.ascontiguousarray(arrays[0])
                elif not padded:
                    feeds[past_name(layer, kind)] = np.concatenate(arrays, axis=0)
                else:
                    stacked = np.zeros((batch, c.n_kv_heads, past, c.head_dim), dtype=np.float32)
                    for row, (array, length) in enumerate(zip(arrays, lengths, strict=True)):
                        stacked[row, :, past - length :] = array[0]
                    feeds[past_name(layer, kind)] = stacked
        valid = np.zeros((batch, past), dtype=np.bool_)
        for row, length in enumerate(lengths):
            valid[row, past - length :] = True
        return valid


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
