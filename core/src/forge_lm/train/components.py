"""Build a run's components from the registry: nothing here names a concrete component."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from forge_lm.components import DataContext, EvaluatorContext, MetricsContext
from forge_lm.config import ComponentConfig, ForgeConfig
from forge_lm.errors import ForgeError, PluginError
from forge_lm.metrics.guard import GuardedBackend
from forge_lm.plugins import Component, Registry
from forge_lm.plugins._calls import checked_metrics, describe
from forge_lm.plugins._categories import singular


def build(registry: Registry, category: str, chosen: ComponentConfig, *args: Any) -> Any:
    """The component ``chosen`` names in ``category``, built with its options and ``args``."""
    return _build(registry.resolve(category, chosen.name), chosen, *args)


def _build(component: Component, chosen: ComponentConfig, *args: Any) -> Any:
    """A factory that fails with anything but a ForgeError (which says what to fix) is reported
    as a PluginError naming the component and its plugin, not as a traceback."""
    try:
        return component.build(chosen.options, *args)
    except ForgeError:
        raise
    except Exception as exc:
        plugin = component.plugin
        advice = (
            "Check its options"
            if plugin.builtin
            else f"Check its options; if they are right, this is a bug in {plugin.distribution}: report it to its "
            "authors"
        )
        raise PluginError(
            f"{singular(component.category)} '{component.name}' from {plugin.label} could not be built: "
            f"{describe(exc)}. {advice}."
        ) from exc


def build_dataset(
    config: ForgeConfig,
    registry: Registry,
    tokenizer: Any,
    vocab_size: int,
    split: str,
    dp_rank: int = 0,
    dp_size: int = 1,
    data: ComponentConfig | None = None,
) -> Any:
    """The dataset of ``split`` as seen by data-parallel rank ``dp_rank`` of ``dp_size``: the
    one ``data`` selects (a named eval set's), or the run's ``[data]``. Either way it reads the
    run's sequence length and seed, so its windows are the model's."""
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
    return build(registry, "datasets", config.data if data is None else data, context)


class CheckedEvaluator:
    """An evaluator of ``[eval] evaluators`` whose metrics are checked: what a plugin returns is
    untrusted, so only string keys with numbers stay, none may replace a metric logged before
    it, and the rest is left out with one warning (on rank 0, where metrics are logged)."""

    def __init__(self, label: str, evaluator: Any, warn_on_this_rank: bool) -> None:
        self.label, self.evaluator = label, evaluator
        self._warn = warn_on_this_rank

    def evaluate(self, model: Any, step: int, earlier: Mapping[str, float]) -> dict[str, float]:
        returned = self.evaluator.evaluate(model, step)
        try:
            good, problems = checked_metrics(returned, {*earlier, "step"})
        except Exception as exc:  # noqa: BLE001 - a returned object may fail in any way when read
            good, problems = {}, [f"an unreadable {type(returned).__name__} ({describe(exc)})"]
        if problems and self._warn:
            self._warn = False
            print(
                f"forge: warning: {self.label} returned unusable metrics: {'; '.join(problems)}. They are left out "
                "(this warning is not repeated); the run goes on.",
                file=sys.stderr,
            )
        return good


def build_evaluators(config: ForgeConfig, registry: Registry, context: EvaluatorContext) -> list[CheckedEvaluator]:
    """Every evaluator of ``[eval] evaluators``, built (a failure names it and its plugin)."""
    built = []
    for chosen in config.eval.evaluators:
        component = registry.resolve("evaluators", chosen.name)
        plugin = component.plugin
        label = f"evaluator '{component.name}' ({plugin.distribution} {plugin.version})"
        built.append(CheckedEvaluator(label, _build(component, chosen, context), context.rank == 0))
    return built


def build_metrics_backends(config: ForgeConfig, registry: Registry, run_dir: Any) -> list[GuardedBackend]:
    """Every backend of ``[metrics] backends``, each guarded: one that fails while the run goes
    on is turned off with a warning (see :mod:`forge_lm.metrics.guard`). One that cannot be
    built stops the run before it starts."""
    context = MetricsContext(run_dir=run_dir, run_name=Path(run_dir).name, total_steps=config.train.max_steps)
    backends = []
    for chosen in config.metrics.backends:
        component = registry.resolve("metrics_backends", chosen.name)
        plugin = component.plugin
        label = f"metrics backend '{component.name}' ({plugin.distribution} {plugin.version})"
        backends.append(GuardedBackend(_build(component, chosen, context), label))
    return backends
