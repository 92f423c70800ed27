"""Builds losses by registered name; a problem with ignored positions; the loss formula, by hand."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from forge_lm.components import IGNORE_INDEX
from forge_lm.config import structure_options
from forge_lm.plugins import PluginManager, PluginSettings

BATCH, SEQ, VOCAB = 3, 8, 13


@pytest.fixture(scope="module")
def builtins() -> PluginManager:
    return PluginManager(PluginSettings(autoload=False))


@pytest.fixture
def build_loss(builtins: PluginManager) -> Callable[..., Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    def build(name: str, **table: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        component = builtins.registry.resolve("losses", name)
        return component.build(structure_options(builtins.registry, component, table, "loss"))

    return build


def make_problem(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [3, 8, 13] and labels with ignored positions: a prefix, a scattered one, a whole row's end."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(BATCH, SEQ, VOCAB, generator=generator, dtype=torch.float64) * 4).to(dtype)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels[:, 0] = IGNORE_INDEX
    labels[1, 3] = IGNORE_INDEX
    labels[2, 2:] = IGNORE_INDEX  # 6 ignored in a row: whole chunks of a small chunk size
    return logits.requires_grad_(True), labels


@pytest.fixture
def problem() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    return make_problem


def by_hand(logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float) -> dict[str, Any]:
    """Loss, z-loss and gradient, token by token in float64 with Python arithmetic.

    Per counted token with logits ``l`` and label ``y``: ``log Z = log sum_j exp(l_j)``,
    loss ``log Z - l_y``, z-loss ``(log Z)**2``; both averaged over the ``n`` counted tokens.
    The gradient of token ``i`` is ``(softmax(l) - onehot(y) + weight * 2 log Z softmax(l)) / n``.
    """
    rows = logits.detach().double().reshape(-1, logits.shape[-1]).tolist()
    targets = labels.reshape(-1).tolist()
    counted = [i for i, y in enumerate(targets) if y != IGNORE_INDEX]
    n = len(counted)
    loss = z = 0.0
    grad = [[0.0] * len(rows[0]) for _ in rows]
    for i in counted:
        row, y = rows[i], targets[i]
        top = max(row)
        log_z = top + math.log(sum(math.exp(v - top) for v in row))
        loss += log_z - row[y]
        z += log_z**2
        for j, v in enumerate(row):
            p = math.exp(v - log_z)
            grad[i][j] = (p - (1.0 if j == y else 0.0) + z_loss_weight * 2 * log_z * p) / n
    return {
        "loss": (loss + z_loss_weight * z) / n,
        "z": z / n,
        "grad": torch.tensor(grad, dtype=torch.float64).reshape(logits.shape),
    }


@pytest.fixture
def expected() -> Callable[..., dict[str, Any]]:
    return by_hand
