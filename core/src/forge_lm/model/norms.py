"""Normalisation layers of the transformer: RMSNorm (Llama) and bias-free LayerNorm."""

from __future__ import annotations

import torch
from torch import nn

from forge_lm.errors import ConfigError


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    The statistic is computed in fp32 whatever the input dtype (bf16 squares lose too much),
    and the result is cast back before the scale, exactly as Hugging Face's ``LlamaRMSNorm``
    does, so converted models agree to rounding.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """The norm named by ``ModelSection.norm``: ``"rmsnorm"`` or ``"layernorm"``.

    LayerNorm has a scale but no bias, like every other layer of this model (no biases anywhere).
    """
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=False)
    raise ConfigError(f"[model] norm: unknown norm '{kind}'; use 'rmsnorm' or 'layernorm'.")
