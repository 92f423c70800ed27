"""Fixtures for training tests: tiny configs that train in about a second."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from forge_lm.config import ForgeConfig, load_config
from forge_lm.distributed import ParallelDims
from forge_lm.plugins import PluginManager
from forge_lm.testing import TINY_MODEL

TINY = (
    *TINY_MODEL,
    "--train.batch_size=4",
    "--train.seq_len=16",
    "--train.max_steps=6",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=3",
    "--eval.steps=2",
    "--data.name=synthetic",
)


@pytest.fixture
def tiny_config(tmp_path: Path, manager: PluginManager) -> Callable[..., ForgeConfig]:
    """A tiny run config in a fresh run directory; extra overrides come last and win."""

    def make(*overrides: str, manager: PluginManager = manager) -> ForgeConfig:
        run_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        return load_config(None, [*TINY, f"--train.output_dir={run_dir}", *overrides], manager.registry)

    return make


@pytest.fixture
def one_process_parts(manager: PluginManager) -> Callable[..., Any]:
    """The fields of the run's :class:`~forge_lm.train.parts.Parts` that ``compute_gradients``
    uses, for one process: what a test needs to run the run's own step on a model it built."""

    def make(model: torch.nn.Module, config: ForgeConfig, manager: PluginManager = manager) -> Any:
        from forge_lm.train.parts import Parts

        fields = {name: None for name in attrs.fields_dict(Parts)}  # unused by a one-process step
        fields.update(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),  # lr 0: only the gradients matter
            loss_fn=config.loss.build(),
            device=torch.device("cpu"),
            dims=ParallelDims(),
        )
        return Parts(**fields)

    return make
