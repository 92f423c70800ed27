"""DeepSeek-V3's multi-token prediction (MTP): extra modules that predict tokens further ahead.

Module ``k`` (1-based, ``k = 1 .. mtp_depth``) takes, at each position ``i``, the hidden state
the previous depth produced there (the main trunk's last hidden state, before its final norm,
for ``k = 1``) and the embedding of token ``t[i + k]``; it normalises both (RMSNorm each),
concatenates ``[embedding, hidden]``, projects back to ``dim``, runs one transformer block, and
predicts token ``t[i + k + 1]`` through its own final norm and the model's output head (shared
with the main trunk, as is the embedding).

Every depth keeps the sequence length ``T``: the embeddings are shifted left by ``k`` and the
last ``k`` positions get zeros. Attention is causal, so those positions influence only later
ones, which have no target either: the valid positions compute exactly what DeepSeek's
``T - k`` long sequences would. A position carries no loss when its target runs off the
sequence (``i + k + 1 >= T``) or lies in another document than position ``i``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from forge_lm.api import Linear, RMSNorm

if TYPE_CHECKING:
    from forge_lm.components import Initializer

IGNORE = -100


class MTPModule(nn.Module):
    """One depth: ``(hidden [B, T, dim], embeddings of the tokens k ahead [B, T, dim]) -> hidden``.

    Names as DeepSeek's checkpoints: ``enorm``/``hnorm`` the two input norms, ``eh_proj`` the
    projection of ``[enorm(e), hnorm(h)]``, ``block`` the transformer block, ``norm`` the final
    norm before the shared head (DeepSeek's ``shared_head.norm``)."""

    def __init__(self, dim: int, norm_eps: float, block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(dim, norm_eps)
        self.hnorm = RMSNorm(dim, norm_eps)
        self.eh_proj = Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, norm_eps)

    def init_weights(self, init: Initializer) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            init.ones(norm.weight)
        init.normal(self.eh_proj.weight, init.std)
        self.block.init_weights(init)

    def forward(
        self,
        hidden: torch.Tensor,
        ahead: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: object,
        is_causal: bool,
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(ahead), self.hnorm(hidden)), dim=-1))
        return self.block(x, cos, sin, mask, is_causal, None)


def shifted(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` ``[B, T, ...]`` moved ``k`` positions left along T, zeros in the last ``k``."""
    if k >= x.shape[1]:
        return torch.zeros_like(x)
    return torch.cat((x[:, k:], x.new_zeros(x.shape[0], k, *x.shape[2:])), dim=1)


def mtp_targets(input_ids: torch.Tensor, document_ids: torch.Tensor | None, ahead: int) -> torch.Tensor:
    """``[B, T]`` targets ``t[i + ahead]`` of every position ``i``, :data:`IGNORE` where
    ``i + ahead`` runs off the sequence or into another document than ``i``'s."""
    targets = shifted(input_ids, ahead)
    valid = shifted(torch.ones_like(input_ids, dtype=torch.bool), ahead)
    if document_ids is not None:
        valid &= shifted(document_ids, ahead) == document_ids
    return targets.masked_fill(~valid, IGNORE)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (fp32) over the positions with a target; 0 (with a gradient path) when
    none has one, so that a batch of one-token documents adds nothing rather than NaN."""
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return losses / (targets != IGNORE).sum().clamp(min=1)
