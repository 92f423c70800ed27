"""Builds schedulers by registered name and reads off the learning rate of every step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from forge_lm.config import structure_options
from forge_lm.plugins import PluginManager, PluginSettings

BASE_LR = 0.5  # not 1, so that a schedule returning rates instead of multipliers would show


@pytest.fixture(scope="module")
def builtins() -> PluginManager:
    return PluginManager(PluginSettings(autoload=False))


@pytest.fixture
def rates(builtins: PluginManager) -> Callable[..., list[float]]:
    """``rates(name, total_steps, **options)``: the multiplier of the peak at each step of a run."""

    def run(name: str, total_steps: int, **table: Any) -> list[float]:
        component = builtins.registry.resolve("schedulers", name)
        options = structure_options(builtins.registry, component, table, "scheduler")
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)
        scheduler = component.build(options, optimizer, total_steps)
        seen = []
        for _ in range(total_steps):
            seen.append(optimizer.param_groups[0]["lr"] / BASE_LR)
            optimizer.step()
            scheduler.step()
        return seen

    return run
