"""Draft decoders in torch, for training only: llama blocks cut from the target, a trimmed head."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from inference.model_config import F32, LlamaConfig
from modelbuild.gguf_source import HEAD, NORM


class RmsNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 even under autocast, as the exported graphs compute them.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight).to(x.dtype)


class Block(nn.Module):
    """One llama block (GQA attention with rotate-half RoPE, SwiGLU MLP), HF weight layout."""

    def __init__(
        self, config: LlamaConfig, weights: Mapping[str, torch.Tensor], prefix: str
    ) -> None:
        super().__init__()
        self.config = config

        def linear(name: str) -> nn.Linear:
            weight = weights[prefix + name]
            bias = weights.get(prefix + name.removesuffix(".weight") + ".bias")  # qwen2's Q/K/V
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
            layer.weight = nn.Parameter(weight.clone())
            if bias is not None:
                layer.bias = nn.Parameter(bias.clone())
            return layer

        self.input_norm = RmsNorm(weights[prefix + "input_layernorm.weight"], config.rms_eps)
        self.q_proj = linear("self_attn.q_proj.weight")
        self.k_proj = linear("self_attn.k_proj.weight")
        self.v_proj = linear("self_attn.v_proj.weight")
        self.o_proj = linear("self_attn.o_proj.weight")
        self.post_norm = RmsNorm(
            weights[prefix + "post_attention_layernorm.weight"], config.rms_eps
        )
        self.gate_proj = linear("mlp.gate_proj.weight")
        self.up_proj = linear("mlp.up_proj.weight")
        self.down_proj = linear("mlp.down_proj.weight")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        batch, length, _ = x.shape
        h = self.input_norm(x)
        q = self.q_proj(h).view(batch, length, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(batch, length, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(batch, length, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))
        h = self.post_norm(x)
        out: torch.Tensor = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return out


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_tables(config: LlamaConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin # [length, head_dim] for positions 0..length-1."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_base ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return (
        torch.from_numpy(np.cos(angles).astype(np.float32)),
        torch.from_numpy(np.sin(angles).astype(np.float32)),
    )


class DraftModel(nn.Module):
    """Frozen target embeddings, `n_layers` trainable blocks, a trainable head over `head_ids`."""

    def __init__(self, config: LlamaConfig, weights: Mapping[str, F32], embed: F32) -> None:
        super().__init__()
        self.config = config
        tensors = {
            name: torch.from_numpy(np.array(value, np.float32)) for name, value in weights.items()
        }
        # The input table is the target's own (as the export ships it), so it is not trained.
        self.embed_table: torch.Tensor
        self.register_buffer(
            "embed_table", torch.from_numpy(np.asarray(embed, np.float32)), persistent=False
        )
        self.blocks = nn.ModuleList(
            Block(config, tensors, f"model.layers.{i}.") for i in range(config.n_layers)
        )
        self.norm = RmsNorm(tensors[NORM], config.rms_eps)
        self.head = nn.Parameter(tensors[HEAD].clone())  # [head_size, d_model]
        self._rope_len = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits over the head's ids # [batch, length, head_size]."""
        length = input_ids.shape[1]
        if length > self._rope_len:
            cos, sin = rope_tables(self.config, max(length, 512))
            self._cos, self._sin, self._rope_len = cos, sin, cos.shape[0]
        cos, sin = self._cos[:length], self._sin[:length]
        x = F.embedding(input_ids, self.embed_table)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits: torch.Tensor = self.norm(x) @ self.head.t()
        return logits

    def trained_weights(self) -> dict[str, F32]:
        """Every trained tensor under HF names ([out, in] matrices), as fp32 numpy."""
        result: dict[str, F32] = {
            NORM: self.norm.weight.detach().float().numpy(),
            HEAD: self.head.detach().float().numpy(),
        }
        names = {
            "input_norm": "input_layernorm.weight", "q_proj": "self_attn.q_proj.weight",
            "k_proj": "self_attn.k_proj.weight", "v_proj": "self_attn.v_proj.weight",
            "o_proj": "self_attn.o_proj.weight", "post_norm": "post_attention_layernorm.weight",
            "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
            "down_proj": "mlp.down_proj.weight",
        }  # fmt: skip
        for i, block in enumerate(self.blocks):
            for attr, hf in names.items():
                module = getattr(block, attr)
                result[f"model.layers.{i}.{hf}"] = module.weight.detach().float().numpy()
                if isinstance(module, nn.Linear) and module.bias is not None:
                    bias = hf.removesuffix(".weight") + ".bias"
                    result[f"model.layers.{i}.{bias}"] = module.bias.detach().float().numpy()
        return result


def distill_loss(
    logits: torch.Tensor, hard: torch.Tensor, soft_ids: torch.Tensor, soft_probs: torch.Tensor
) -> torch.Tensor:
    """Half cross-entropy on the target's greedy token, half on its renormalised top-k.

    logits # [n, head]; hard # [n] head index or -1 (not in the head); soft_ids # [n, k] head
    index or -1; soft_probs # [n, k]. Positions whose greedy token is outside the head count only
    through their soft part.
    """
    log_q = torch.log_softmax(logits.float(), dim=-1)
    hard_mask = hard >= 0
    hard_loss = -log_q[hard_mask].gather(1, hard[hard_mask, None]).sum()
    probs = soft_probs * (soft_ids >= 0)
    mass = probs.sum(-1, keepdim=True)
    keep = mass[:, 0] > 0
    probs = probs[keep] / mass[keep]
    soft_loss = -(probs * log_q[keep].gather(1, soft_ids[keep].clamp(min=0))).sum()
    count = max(int(hard_mask.sum()), 1)
    return (0.5 * hard_loss + 0.5 * soft_loss) / count


def cosine_lr(peak: float, progress: float, warmup: float = 0.03) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak; progress in [0, 1]."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / (1 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))
