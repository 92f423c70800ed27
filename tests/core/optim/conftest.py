"""Builds optimizers the way a run does: by registered name, options validated from a table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from forge_lm.config import structure_options
from forge_lm.plugins import PluginManager, PluginSettings


@pytest.fixture(scope="module")
def builtins() -> PluginManager:
    return PluginManager(PluginSettings(autoload=False))


@pytest.fixture
def build_optimizer(builtins: PluginManager) -> Callable[..., torch.optim.Optimizer]:
    def build(name: str, model: torch.nn.Module, **table: Any) -> torch.optim.Optimizer:
        component = builtins.registry.resolve("optimizers", name)
        return component.build(structure_options(builtins.registry, component, table, "optimizer"), model)

    return build


@pytest.fixture
def options_of(builtins: PluginManager) -> Callable[..., Any]:
    """The validated options object of an optimizer, from a config table (raises ConfigError)."""

    def options(name: str, **table: Any) -> Any:
        component = builtins.registry.resolve("optimizers", name)
        return structure_options(builtins.registry, component, table, "optimizer")

    return options


class Regression(nn.Module):
    """A float64 two-layer net: every role (decayed matrices, undecayed biases and norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.outer = nn.Linear(8, 3)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.outer(self.norm(torch.tanh(self.inner(inputs))))


@pytest.fixture
def decayed() -> tuple[str, ...]:
    """Names of the Regression parameters the weight-decay rule decays: its weight matrices."""
    return ("inner.weight", "outer.weight")


@pytest.fixture
def make_model() -> Callable[[int], nn.Module]:
    def make(seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return Regression().double()

    return make


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A different batch at each step, so that gradients change from step to step."""
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(16, 6, generator=generator, dtype=torch.float64)
    return inputs, torch.randn(16, 3, generator=generator, dtype=torch.float64)


@pytest.fixture
def loss_at() -> Callable[[nn.Module, int], torch.Tensor]:
    def loss(model: nn.Module, step: int) -> torch.Tensor:
        inputs, targets = batch(step)
        return ((model(inputs) - targets) ** 2).mean()

    return loss
