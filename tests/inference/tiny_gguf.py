"""A small random llama-family GGUF, written with the `gguf` library's own writer.

It has a vocabulary of its own (byte-level BPE: the 256 byte symbols, merges for a few words,
and five control tokens) and a chat template of its own, so a target built from it shares
nothing with SmolLM2 but the architecture.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

CONTROL_TOKENS = ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
BOS, EOS = 0, 1
# Zephyr-like turns, with the BOS and EOS the template is given by name.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
WORDS = (
    "the", " the", " and", " is", " of", " to", " a", " in", " you", " that", "What", " What",
    " capital", " France", " Paris", "Hello", " hello", " world", " answer", " question",
    "user", "assistant", "system", " tell", " me", " about", " story", " write", " code",
)  # fmt: skip


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte (the byte-level BPE alphabet), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """Tokens, their llama.cpp types (3 control, 1 normal) and the merges."""
    byte_symbol = _byte_symbols()
    tokens = [*CONTROL_TOKENS, *byte_symbol]
    merges: list[str] = []
    known = set(tokens)
    for word in WORDS:
        symbols = [byte_symbol[b] for b in word.encode()]
        merged = symbols[0]
        for symbol in symbols[1:]:
            pair = f"{merged} {symbol}"
            merged += symbol
            if merged not in known:
                merges.append(pair)
                tokens.append(merged)
                known.add(merged)
    types = [3] * len(CONTROL_TOKENS) + [1] * (len(tokens) - len(CONTROL_TOKENS))
    return tokens, types, merges


@dataclass(frozen=True)
class TinyShape:
    architecture: str = "llama"  # or "qwen2" (biases on Q, K and V)
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def write_tiny_gguf(path: Path, shape: TinyShape = TinyShape()) -> Path:
    """Write the GGUF; its weights are random but fixed by `shape.seed`."""
    import gguf

    tokens, types, merges = vocabulary()
    rng = np.random.default_rng(shape.seed)
    arch = shape.architecture
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(shape.n_layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(shape.d_model)
    writer.add_feed_forward_length(shape.ffn_dim)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_chat_template(CHAT_TEMPLATE)

    def normal(*dims: int, std: float) -> npt.NDArray[np.float32]:
        return rng.normal(0.0, std, size=dims).astype(np.float32)

    d, kv = shape.d_model, shape.n_kv_heads * shape.head_dim
    embedding = normal(len(tokens), d, std=1.0)
    # The embedding in q8_0 blocks, as real GGUFs store it (the drafts reuse those blocks).
    blocks = gguf.quants.quantize(embedding, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", 1.0 + normal(d, std=0.1))
    # A separate head with large weights: peaked next-token distributions, few near-ties.
    writer.add_tensor("output.weight", normal(len(tokens), d, std=0.6))
    for layer in range(shape.n_layers):
        blk = f"blk.{layer}."
        writer.add_tensor(blk + "attn_norm.weight", 1.0 + normal(d, std=0.1))
        writer.add_tensor(blk + "attn_q.weight", normal(d, d, std=0.15))
        writer.add_tensor(blk + "attn_k.weight", normal(kv, d, std=0.15))
        writer.add_tensor(blk + "attn_v.weight", normal(kv, d, std=0.15))
        if arch == "qwen2":
            writer.add_tensor(blk + "attn_q.bias", normal(d, std=0.5))
            writer.add_tensor(blk + "attn_k.bias", normal(kv, std=0.5))
            writer.add_tensor(blk + "attn_v.bias", normal(kv, std=0.5))
        writer.add_tensor(blk + "attn_output.weight", normal(d, d, std=0.1))
        writer.add_tensor(blk + "ffn_norm.weight", 1.0 + normal(d, std=0.1))
        writer.add_tensor(blk + "ffn_gate.weight", normal(shape.ffn_dim, d, std=0.15))
        writer.add_tensor(blk + "ffn_up.weight", normal(shape.ffn_dim, d, std=0.15))
        writer.add_tensor(blk + "ffn_down.weight", normal(d, shape.ffn_dim, std=0.1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
