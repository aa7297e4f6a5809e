"""LiteRT (TFLite) behind the Runtime protocol; the one module importing a TFLite interpreter."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from inference.model_config import F32, LlamaConfig
from inference.runtime import KVCache, Logits
from inference.tflite_io import (
    INPUT_IDS,
    LOGITS,
    NEW_KV,
    PAST_KEYS,
    PAST_VALUES,
    ROPE_COS,
    ROPE_SIN,
    rope_tables,
)


def _make_interpreter(model_path: Path, threads: int | None) -> Any:
    """ai-edge-litert where it is installed, else the older tflite-runtime wheel.

    The default XNNPack delegate re-packs every weight whenever an input is resized (measured
    100-300 ms), and the cache grows by a position each call, so the built-in kernels run it.
    """
    try:
        from ai_edge_litert.interpreter import Interpreter, OpResolverType
    except ImportError:
        try:
            from tflite_runtime.interpreter import Interpreter, OpResolverType
        except ImportError as exc:
            raise ImportError(
                "no TFLite interpreter: pip install ai-edge-litert (or tflite-runtime)"
            ) from exc
    return Interpreter(
        model_path=str(model_path),
        num_threads=threads,
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
    )


class LiteRtKVCache:
    """Keys and values of one sequence # [n_layers, n_kv, length, head_dim] each."""

    def __init__(self, keys: F32, values: F32) -> None:
        self.keys = keys
        self.values = values

    @property
    def length(self) -> int:
        return int(self.keys.shape[2])

    def trim(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} positions to {length}")
        self.keys = np.ascontiguousarray(self.keys[:, :, :length])
        self.values = np.ascontiguousarray(self.values[:, :, :length])

    def append(self, keys: F32, values: F32) -> None:
        self.keys = np.concatenate([self.keys, keys], axis=2)
        self.values = np.concatenate([self.values, values], axis=2)


def _own_cache(cache: KVCache) -> LiteRtKVCache:
    if not isinstance(cache, LiteRtKVCache):
        raise TypeError(f"LiteRtRuntime needs its own caches, got {type(cache).__name__}")
    return cache


class LiteRtRuntime:
    """A draft exported by `modelbuild.tflite_export`, one sequence per interpreter call.

    The graph's input shapes change with every call (new tokens, cache length), so each call
    resizes the inputs and re-plans the interpreter's memory (well under a millisecond with the
    built-in kernels).
    """

    def __init__(
        self,
        model_path: Path,
        config: LlamaConfig | None = None,
        *,
        head_ids: Sequence[int] | npt.NDArray[np.int64] | None = None,
        threads: int | None = None,
        name: str | None = None,
    ) -> None:
        """Without `config`, the config and head ids come from the files beside the model (the
        manifest and `output_ids.json` that `specfleet models distill` writes)."""
        if config is None:
            config, head_ids = _described_beside(model_path)
        self.interpreter = _make_interpreter(model_path, threads)
        self.config = config
        self.name = name or model_path.stem
        self.head_ids: npt.NDArray[np.int64] | None = (
            np.asarray(head_ids, dtype=np.int64) if head_ids is not None else None
        )
        self._inputs = {_short(d["name"]): d["index"] for d in self.interpreter.get_input_details()}
        self._outputs = self._match_outputs()
        self.vocab_size = int(
            config.vocab_size if self.head_ids is None else self.head_ids.shape[0]
        )
        self._shapes: dict[str, tuple[int, ...]] = {}

    @property
    def output_ids(self) -> npt.NDArray[np.int64] | None:
        """Vocabulary id of each logit column (the trimmed head); None for a full head."""
        return self.head_ids

    def _match_outputs(self) -> dict[str, int]:
        """Output tensors by rank: logits are [new, head], the new cache entries 5-D."""
        by_rank = {
            len(d["shape_signature"]): d["index"] for d in self.interpreter.get_output_details()
        }
        if sorted(by_rank) != [2, 5]:
            raise ValueError(f"not a draft exported by modelbuild.tflite_export: {sorted(by_rank)}")
        return {LOGITS: by_rank[2], NEW_KV: by_rank[5]}

    def new_cache(self) -> LiteRtKVCache:
        c = self.config
        empty = np.zeros((c.n_layers, c.n_kv_heads, 0, c.head_dim), dtype=np.float32)
        return LiteRtKVCache(empty, empty.copy())

    def forward(self, token_ids: Sequence[int], cache: KVCache) -> Logits:
        own = _own_cache(cache)
        if not token_ids:
            raise ValueError("forward needs at least one new token")
        cos, sin = rope_tables(self.config, own.length, len(token_ids))
        feeds: dict[str, npt.NDArray[Any]] = {
            INPUT_IDS: np.asarray(token_ids, dtype=np.int32),
            ROPE_COS: cos,
            ROPE_SIN: sin,
            PAST_KEYS: own.keys,
            PAST_VALUES: own.values,
        }
        interpreter = self.interpreter
        resized = False
        for role, array in feeds.items():
            if self._shapes.get(role) != array.shape:
                interpreter.resize_tensor_input(self._inputs[role], list(array.shape), strict=False)
                self._shapes[role] = array.shape
                resized = True
        if resized or not self._shapes.get("_allocated"):
            interpreter.allocate_tensors()
            self._shapes["_allocated"] = (1,)
        for role, array in feeds.items():
            interpreter.set_tensor(self._inputs[role], array)
        interpreter.invoke()
        logits: Logits = interpreter.get_tensor(self._outputs[LOGITS]).copy()
        new_kv = interpreter.get_tensor(self._outputs[NEW_KV])
        own.append(new_kv[0], new_kv[1])
        return logits

    def forward_batch(self, requests: Sequence[tuple[Sequence[int], KVCache]]) -> list[Logits]:
        # The exported graph takes one sequence; a device drafts one session at a time anyway.
        return [self.forward(token_ids, cache) for token_ids, cache in requests]


def _short(tensor_name: str) -> str:
    """`serving_default_input_ids:0` -> `input_ids`; names the converter decorated."""
    name = tensor_name.split(":")[0]
    for prefix in ("serving_default_", "StatefulPartitionedCall_"):
        name = name.removeprefix(prefix)
    return name


def _described_beside(model_path: Path) -> tuple[LlamaConfig, npt.NDArray[np.int64] | None]:
    from inference.artifacts import load_manifest, read_output_ids

    manifest = load_manifest(model_path.parent)
    return LlamaConfig.from_json(manifest.config), read_output_ids(model_path.parent)


class LiteRtGraph:
    """Any TFLite graph run by input name (a feature head's step), inputs resized as they change."""

    def __init__(self, model_path: Path, *, threads: int | None = None) -> None:
        self.interpreter = _make_interpreter(model_path, threads)
        self._inputs = {_short(d["name"]): d["index"] for d in self.interpreter.get_input_details()}
        details = self.interpreter.get_output_details()
        self._outputs = [d["index"] for d in details]
        self.output_shapes = [tuple(int(n) for n in d["shape_signature"]) for d in details]
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._allocated = False

    def run(self, feeds: dict[str, npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
        """Every output, copied, in the interpreter's output order."""
        interpreter = self.interpreter
        for role, array in feeds.items():
            if self._shapes.get(role) != array.shape:
                interpreter.resize_tensor_input(self._inputs[role], list(array.shape), strict=False)
                self._shapes[role] = array.shape
                self._allocated = False
        if not self._allocated:
            interpreter.allocate_tensors()
            self._allocated = True
        for role, array in feeds.items():
            interpreter.set_tensor(self._inputs[role], array)
        interpreter.invoke()
        return [interpreter.get_tensor(index).copy() for index in self._outputs]
