"""A tiny language model with every parameter role Muon's split tells apart, and its training steps.

Shared by the tests (loaded by path, see conftest.py) and by the FSDP2 worker (run as a script).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, EXPERTS, LAYERS = 61, 32, 48, 3, 2  # odd vocabulary and expert counts: uneven FSDP shards


class MixtureLayer(nn.Module):
    """Pre-norm residual layer: a biased hidden matrix, then experts mixed by a router."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.mix = nn.Linear(DIM, DIM)  # a hidden matrix and a bias
        self.router = nn.Linear(DIM, EXPERTS, bias=False)  # a router gate
        self.w_in = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / DIM**0.5)  # stacked experts, nn.Linear layout
        self.w_out = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / HIDDEN**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = h + torch.tanh(self.mix(h))
        gates = self.router(h).softmax(-1)  # [b, t, experts]
        up = F.silu(torch.einsum("btd,ehd->bteh", h, self.w_in))
        down = torch.einsum("bteh,edh->bted", up, self.w_out)
        return x + (gates.unsqueeze(-1) * down).sum(2)


class TinyMixtureLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vocab_size = VOCAB
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MixtureLayer() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)  # untied head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def tiny_mixture_lm(seed: int = 0) -> TinyMixtureLM:
    torch.manual_seed(seed)
    return TinyMixtureLM()


def batches(steps: int, batch: int = 4, seq: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
        out.append((ids, torch.roll(ids, shifts=-1, dims=1)))
    return out


def train(model: nn.Module, optimizer: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for ids, targets in data:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def muon_options(**overrides: Any) -> Any:
    """The ``muon`` component's options, validated by the core, as a config table would give them."""
    from forge_lm.config import structure_options
    from forge_lm.plugins import PluginManager

    registry = PluginManager().registry
    return structure_options(registry, registry.resolve("optimizers", "muon"), overrides, "optimizer")
