"""Feature heads in torch, for training only: the step of inference/feature_head.py, unrolled.

The forward pass runs EAGLE-3's training-time test: the first step reads the target's own
features, each later step reads the features the head itself predicted one position earlier,
so the head learns to chain on its own predictions as it does when it drafts.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from inference.feature_head import F32, HeadConfig, tensor_shapes
from modelbuild.draft_torch import RmsNorm


class HeadModel(nn.Module):
    """The step: fc([norm(feature); norm(embed[token])]) -> gated MLP block -> norm -> head."""

    def __init__(
        self,
        config: HeadConfig,
        embed: F32,
        head_rows: F32,
        out_norm: F32,
        seed: int = 0,
    ) -> None:
        """`embed` # [vocab, H] is the target's (frozen); `head_rows` # [V', H] its rows of the
        reduced vocabulary and `out_norm` # [H] its final norm: the head starts where the
        target's own output layer is."""
        super().__init__()
        self.config = config
        h, i = config.hidden_size, config.intermediate_size
        generator = torch.Generator().manual_seed(seed)

        def normal(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=generator) * std

        ones = torch.ones(h)
        self.embed_table: torch.Tensor
        self.register_buffer("embed_table", torch.from_numpy(embed), persistent=False)
        self.feature_norm = RmsNorm(ones, config.rms_eps)
        self.token_norm = RmsNorm(ones, config.rms_eps)
        # The feature half starts as the identity: the first guess for the next feature is the
        # current one, which the block then corrects.
        fc = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1) + normal(h, 2 * h, std=0.02)
        self.fc = nn.Parameter(fc)
        self.mlp_norm = RmsNorm(ones, config.rms_eps)
        self.gate = nn.Parameter(normal(i, h, std=h**-0.5))
        self.up = nn.Parameter(normal(i, h, std=h**-0.5))
        self.down = nn.Parameter(normal(h, i, std=0.1 * i**-0.5))
        self.out_norm = RmsNorm(torch.tensor(out_norm), config.rms_eps)
        self.head = nn.Parameter(torch.tensor(head_rows))

    def step(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Predicted next features # [..., H] from features # [..., H] and tokens # [...]."""
        f = self.feature_norm(features)
        e = self.token_norm(F.embedding(tokens, self.embed_table).to(f.dtype))
        x = torch.cat([f, e], dim=-1) @ self.fc.t()
        m = self.mlp_norm(x)
        x = x + (F.silu(m @ self.gate.t()) * (m @ self.up.t())) @ self.down.t()
        out: torch.Tensor = self.out_norm(x)
        return out

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = features @ self.head.t()
        return out

    def unroll(
        self, features: torch.Tensor, tokens: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """Predicted features per unrolled step, each # [B, T, H].

        features # [B, T, H] are the target's h_{j-1} and tokens # [B, T] the x_j beside them;
        step u's output at r predicts the feature at r from u - 1 of the head's own features
        before it. Rows r < u - 1 have no such chain and keep reading the target's features.
        """
        outputs = []
        current = features
        for _ in range(steps):
            predicted = self.step(current, tokens)
            outputs.append(predicted)
            current = torch.cat([features[:, :1], predicted[:, :-1]], dim=1)
        return outputs

    def _named(self) -> dict[str, torch.Tensor]:
        return {
            "feature_norm.weight": self.feature_norm.weight,
            "token_norm.weight": self.token_norm.weight,
            "fc.weight": self.fc,
            "mlp_norm.weight": self.mlp_norm.weight,
            "gate.weight": self.gate,
            "up.weight": self.up,
            "down.weight": self.down,
            "out_norm.weight": self.out_norm.weight,
            "head.weight": self.head,
        }

    def trained_tensors(self) -> dict[str, F32]:
        """Every trained tensor under the names of inference/feature_head.py, as fp32 numpy."""
        result = {
            name: t.detach().float().numpy().astype(np.float32) for name, t in self._named().items()
        }
        expected = tensor_shapes(self.config, self.head.shape[0])
        assert {k: v.shape for k, v in result.items()} == expected
        return result

    def load_tensors(self, tensors: dict[str, F32]) -> None:
        """Start from a trained head's tensors (`trained_tensors`' names and shapes)."""
        named = self._named()
        if set(tensors) != set(named):
            raise ValueError(f"tensors {sorted(tensors)} are not a head's {sorted(named)}")
        with torch.no_grad():
            for name, parameter in named.items():
                if tuple(parameter.shape) != tensors[name].shape:
                    raise ValueError(
                        f"{name} is {tensors[name].shape}, this head's {tuple(parameter.shape)}"
                    )
                parameter.copy_(torch.from_numpy(tensors[name]))


def head_loss(
    predicted: torch.Tensor,
    logits: torch.Tensor,
    target_features: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.Tensor,
    reg_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, top-1 hits) over n rows: cross-entropy against the target's own distribution over
    V' (its logits from its real features), half of it on its greedy token where that lies in V',
    plus a feature regression term scaled by the features' own energy.

    predicted, target_features # [n, H]; logits, target_logits # [n, V']; labels # [n] column
    of the target's token in V' or -1.
    """
    log_q = torch.log_softmax(logits.float(), dim=-1)
    p = torch.softmax(target_logits.float(), dim=-1)
    soft = -(p * log_q).sum(-1).mean()
    inside = labels >= 0
    hard = -log_q[inside].gather(1, labels[inside, None]).mean() if inside.any() else soft * 0
    energy = target_features.float().pow(2).mean()
    regression = (predicted.float() - target_features.float()).pow(2).mean() / energy
    hits = (logits.argmax(-1) == labels).sum()
    return 0.5 * soft + 0.5 * hard + reg_weight * regression, hits
