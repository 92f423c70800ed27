"""Fixtures for training tests: tiny configs that train in about a second."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from forge_lm.config import ForgeConfig, load_config
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
