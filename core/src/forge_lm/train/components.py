"""Build a run's components from the registry: nothing here names a concrete component."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forge_lm.components import DataContext, MetricsContext
from forge_lm.config import ComponentConfig, ForgeConfig
from forge_lm.plugins import Registry


def build(registry: Registry, category: str, chosen: ComponentConfig, *args: Any) -> Any:
    """The component ``chosen`` names in ``category``, built with its options and ``args``."""
    return registry.resolve(category, chosen.name).build(chosen.options, *args)


def build_dataset(
    config: ForgeConfig,
    registry: Registry,
    tokenizer: Any,
    vocab_size: int,
    split: str,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> Any:
    """The dataset of ``split`` as seen by data-parallel rank ``dp_rank`` of ``dp_size``."""
    context = DataContext(
        seq_len=config.train.seq_len,
        vocab_size=vocab_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=config.train.seed,
        split=split,
        tokenizer=tokenizer,
        registry=registry,
    )
    return build(registry, "datasets", config.data, context)


def build_metrics_backends(config: ForgeConfig, registry: Registry, run_dir: Any) -> list[Any]:
    context = MetricsContext(run_dir=run_dir, run_name=Path(run_dir).name, total_steps=config.train.max_steps)
    return [build(registry, "metrics_backends", chosen, context) for chosen in config.metrics.backends]
