"""Build the parts of a run that need a context: its datasets, evaluators and metrics
backends, each given what it needs to know about the run. A selected component is always
built by its config (``chosen.build(...)``, :class:`forge_lm.config.ComponentConfig`); nothing
here names a concrete component."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from forge_lm.components import DataContext, EvaluatorContext, MetricsContext
from forge_lm.config import ComponentConfig, ForgeConfig, model_options
from forge_lm.metrics.guard import GuardedBackend
from forge_lm.notices import warn
from forge_lm.plugins import Registry
from forge_lm.plugins._calls import (
    PluginHookFailed,
    checked_metrics,
    describe,
    from_the_user,
    moved_directory,
    moved_problem,
    working_directory,
)
from forge_lm.plugins._manager import RESERVED_METRICS


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
        model=model_options(config),
    )
    return (config.data if data is None else data).build(context)


class CheckedEvaluator:
    """An evaluator of ``[eval] evaluators`` whose metrics are checked: what a plugin returns is
    untrusted, so only string keys with numbers stay, none may replace a metric logged before
    it, and the rest is left out with one warning (on rank 0, where metrics are logged).

    An ``evaluate`` that raises (``SystemExit`` included, and a ``KeyboardInterrupt`` that is not
    the user's Ctrl-C), changes the gradients of the model's parameters (it ran a backward pass),
    the weights (a cast such as ``model.to(torch.bfloat16)``, or an in-place write), the train/eval
    mode of any module, or the working directory is a :class:`PluginHookFailed` naming the evaluator and its plugin:
    the training loop stops as for a failing ``eval_end`` hook, with the evaluated step
    checkpointed (exit 4). A NaN or infinite metric is logged as it is (a metric may be
    undefined), with one warning."""

    def __init__(self, label: str, evaluator: Any, warn_on_this_rank: bool, component: Any = None) -> None:
        self.label, self.evaluator = label, evaluator
        self._warn = warn_on_this_rank
        self._warn_nan = warn_on_this_rank
        self._component = component  # its registry entry (name and plugin), for a failure's message

    def evaluate(self, model: Any, step: int, earlier: Mapping[str, float]) -> dict[str, float]:
        gradients, directory = _gradient_versions(model), working_directory()
        weights, modes = _weight_versions(model), _modes(model)
        try:
            returned = self.evaluator.evaluate(model, step)
        except BaseException as exc:  # any failure of a plugin's evaluator is reported naming it
            moved_directory(directory)
            if self._component is None or from_the_user(exc):
                raise
            self._fail(
                f"raised in evaluate() of its evaluator '{self._component.name}' at step {step}: {describe(exc)}", exc
            )
        moved = moved_directory(directory)
        if moved is not None and self._component is not None:
            self._fail(moved_problem(f"evaluate() of its evaluator '{self._component.name}'", directory, moved))
        changed = [name for name, version in _gradient_versions(model).items() if gradients.get(name) != version]
        if changed and self._component is not None:
            self._fail(
                f"changed the gradients of {len(changed)} parameters ('{changed[0]}', ...) in evaluate() of its "
                f"evaluator '{self._component.name}' at step {step}; an evaluator must not run a backward pass "
                "through the model (evaluate under torch.no_grad())"
            )
        self._check_model_kept(model, step, weights, modes)
        try:
            good, problems = checked_metrics(returned, {*earlier, *RESERVED_METRICS})
        except Exception as exc:  # noqa: BLE001 - a returned object may fail in any way when read
            good, problems = {}, [f"an unreadable {type(returned).__name__} ({describe(exc)})"]
        if problems and self._warn:
            self._warn = False
            warn(
                f"{self.label} returned unusable metrics: {'; '.join(problems)}. They are left out "
                "(this warning is not repeated); the run goes on."
            )
        undefined = [key for key, value in good.items() if not math.isfinite(value)]
        if undefined and self._warn_nan:
            self._warn_nan = False
            warn(
                f"{self.label} returned {good[undefined[0]]} for '{undefined[0]}' at step {step}; "
                "logged as it is (this warning is not repeated)"
            )
        return good

    def _check_model_kept(self, model: Any, step: int, weights: dict[str, Any], modes: dict[str, bool]) -> None:
        """The weights (dtype, in-place writes) and every module's train/eval mode are as the
        evaluator found them: the run goes on training this model (metadata only, no sync)."""
        if self._component is None:
            return
        where = f"in evaluate() of its evaluator '{self._component.name}' at step {step}"
        after = _weight_versions(model)
        for name, (identity, dtype, version) in weights.items():
            now = after.get(name)
            if now is None or now[0] != identity:
                continue  # a parameter object replaced by a wrapper (FSDP2's unsharded views): not comparable
            if now[1] != dtype:
                self._fail(
                    f"changed parameter '{name}' from {dtype} to {now[1]} {where}; an evaluator must leave the weights "
                    "as they are (use torch.autocast or a copy, never model.to(dtype))"
                )
            if now[2] != version:
                self._fail(
                    f"wrote into parameter '{name}' {where}; an evaluator must leave the weights as they are "
                    "(work on a copy)"
                )
        changed = [name for name, training in _modes(model).items() if modes.get(name, training) != training]
        if changed:
            mode = "train" if not modes[changed[0]] else "eval"
            self._fail(
                f"left {len(changed)} modules ('{changed[0]}', ...) in {mode} mode {where}; an evaluator must leave "
                "the model in the mode it was given (restore any mode it changes)"
            )

    def _fail(self, problem: str, cause: BaseException | None = None) -> None:
        name = self._component.name
        failure = PluginHookFailed(
            self._component.plugin, f"evaluator '{name}'", problem, without=f"remove '{name}' from [eval] evaluators"
        )
        raise failure from cause


def _gradient_versions(model: Any) -> dict[str, tuple[int, int] | None]:
    """Each parameter's gradient, as (identity, version): a backward pass changes one or the other."""
    return {
        name: None if param.grad is None else (id(param.grad), param.grad._version)
        for name, param in model.named_parameters()
    }


def _weight_versions(model: Any) -> dict[str, tuple[int, Any, int]]:
    """Each parameter as (identity, dtype, version): a cast changes the dtype, an in-place write
    the version (``param.data = ...`` keeps the identity)."""
    return {name: (id(param), param.dtype, param._version) for name, param in model.named_parameters()}


def _modes(model: Any) -> dict[str, bool]:
    return {name or "(the model)": module.training for name, module in model.named_modules()}


def build_evaluators(config: ForgeConfig, context: EvaluatorContext) -> list[CheckedEvaluator]:
    """Every evaluator of ``[eval] evaluators``, built (a failure names it and its plugin)."""
    built = []
    for chosen in config.eval.evaluators:
        plugin = chosen.component.plugin
        label = f"evaluator '{chosen.name}' ({plugin.distribution} {plugin.version})"
        built.append(CheckedEvaluator(label, chosen.build(context), context.rank == 0, chosen.component))
    return built


def build_metrics_backends(config: ForgeConfig, run_dir: Any) -> list[GuardedBackend]:
    """Every backend of ``[metrics] backends``, each guarded: one that fails while the run goes
    on is turned off with a warning (see :mod:`forge_lm.metrics.guard`). One that cannot be
    built stops the run before it starts."""
    context = MetricsContext(run_dir=run_dir, run_name=Path(run_dir).name, total_steps=config.train.max_steps)
    backends = []
    for chosen in config.metrics.backends:
        plugin = chosen.component.plugin
        label = f"metrics backend '{chosen.name}' ({plugin.distribution} {plugin.version})"
        backends.append(GuardedBackend(chosen.build(context), label))
    return backends
