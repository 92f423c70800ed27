"""Held-out evaluation: mean loss and perplexity over the same batches every time.

``eval/loss`` is the data loss (the cross-entropy): a term the loss function adds to its value
and reports with :func:`forge_lm.losses.aux.report_loss_term` (its z-loss) is taken out of it,
so that the perplexity is ``exp`` of the cross-entropy. The terms are logged in training.

A run evaluates either the held-out split of its ``[data]`` (``eval/loss``), or each named set
of ``[eval.datasets]`` instead (``eval/<set name>/loss``): one :class:`Evaluator` per set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from forge_lm.config import ForgeConfig
from forge_lm.data.loader import BatchLoader
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.losses.aux import collect_aux
from forge_lm.train.builders import build_dataset


def run_autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    """The run's autocast context for one forward pass: ``dtype`` on ``device``, none for fp32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


class Evaluator:
    """Evaluates on the first ``steps`` batches of the eval split, identical at every call, so
    that successive evaluations are comparable. Its metrics are ``<prefix>/loss`` and
    ``<prefix>/perplexity``; ``steps_at`` names the setting of ``steps`` in messages."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        steps: int,
        device: torch.device,
        dtype: torch.dtype | None,
        vocab_size: int | None = None,
        source: str = "the evaluation data",
        prefix: str = "eval",
        steps_at: str = "[eval] steps",
        name: str | None = None,
    ) -> None:
        self.loader = BatchLoader(dataset, batch_size, vocab_size, source)  # ids checked like training's
        self.start = self.loader.state_dict()
        self.steps = steps
        self.device = device
        self.dtype = dtype
        self.prefix = prefix
        self.steps_at = steps_at
        self.name = name  # the set's name in [eval.datasets]; None for [data]'s held-out split

    def check(self) -> None:
        """Read the batches an evaluation reads, without the model: data that ends before
        ``steps`` batches, or holds ids outside the vocabulary, stops the run at its start rather
        than at the first evaluation. (The built-in datasets are endless: a small set starts
        another pass over its windows rather than ending.)"""
        self.loader.load_state_dict(self.start)
        try:
            batches = iter(self.loader)
            for index in range(self.steps):
                if next(batches, None) is None:
                    raise self._ran_out(index)
        finally:
            self.loader.load_state_dict(self.start)

    def _ran_out(self, read: int) -> ConfigError:
        return ConfigError(
            f"{self.loader.source} ends after {read} batches of {self.loader.batch_size} samples, but an evaluation "
            f"reads {self.steps} ({self.steps_at}); lower it, or give the data more samples."
        )

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """The ``steps`` batches an evaluation reads, the same every call, on the device (the
        :class:`~forge_lm.components.EvalData` an evaluator gets)."""
        self.loader.load_state_dict(self.start)
        batches = iter(self.loader)
        for index in range(self.steps):
            batch = next(batches, None)
            if batch is None:  # see check(): a plain StopIteration here would name nothing
                raise self._ran_out(index)
            yield {key: value.to(self.device) for key, value in batch.items()}

    def autocast(self) -> Any:
        return run_autocast(self.device, self.dtype)

    @torch.no_grad()
    def run(
        self, loss_of: Callable[[dict[str, torch.Tensor]], float], reduce: Callable[[float], float]
    ) -> dict[str, float]:
        """``loss_of(batch)``: this rank's loss of one batch; ``reduce``: the mean over the
        data-parallel ranks (each evaluates its own slice of the same batches)."""
        losses = []
        for batch in self.batches():
            with collect_aux() as aux, self.autocast():
                value = loss_of(batch)
            losses.append(value - sum(float(term) for term in aux.loss_terms.values()))
        # One reduction, on every rank alike: under pipeline parallelism only the last stage
        # computes the loss (and its terms), so a reduction per term would not match up.
        loss = reduce(sum(losses) / len(losses))
        return {f"{self.prefix}/loss": loss, f"{self.prefix}/perplexity": math.exp(min(loss, 700.0))}


class EvalSets:
    """The evaluators of a run, one per set, run together: one evaluation, one metrics record."""

    def __init__(self, evaluators: list[Evaluator]) -> None:
        self.evaluators = evaluators

    def check(self) -> None:
        for evaluator in self.evaluators:
            evaluator.check()

    @property
    def validation(self) -> Evaluator | None:
        """[data]'s held-out split, when the run evaluates it (it has no [eval.datasets])."""
        return next((evaluator for evaluator in self.evaluators if evaluator.name is None), None)

    @property
    def named(self) -> dict[str, Evaluator]:
        """The sets of [eval.datasets], by name."""
        return {evaluator.name: evaluator for evaluator in self.evaluators if evaluator.name is not None}

    def run(
        self, loss_of: Callable[[dict[str, torch.Tensor]], float], reduce: Callable[[float], float]
    ) -> dict[str, float]:
        results: dict[str, float] = {}
        for evaluator in self.evaluators:
            results.update(evaluator.run(loss_of, reduce))
        return results


def build_eval_sets(
    config: ForgeConfig,
    registry: Any,
    tokenizer: Any,
    vocab_size: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
    dtype: torch.dtype | None,
) -> EvalSets:
    """The run's evaluation data, checked (:meth:`Evaluator.check`): each set of ``[eval.datasets]``,
    or, when there is none, the held-out split of ``[data]``. Every data-parallel rank reads its
    own slice of each set, as in training."""
    batch_size = config.train.batch_size
    if not config.eval.datasets:
        data = build_dataset(config, registry, tokenizer, vocab_size, "eval", dp_rank, dp_size)
        evaluators = [Evaluator(data, batch_size, config.eval.steps, device, dtype, vocab_size, "the evaluation data")]
    else:
        evaluators = []
        for name, chosen in config.eval.datasets.items():
            where = f"[eval.datasets.{name}]"
            try:
                data = build_dataset(
                    config, registry, tokenizer, vocab_size, chosen.split, dp_rank, dp_size, chosen.dataset
                )
            except ForgeError as exc:  # the dataset's message names its files, not which set they are
                _name_the_set(exc, where)
                raise
            steps, steps_at = (chosen.steps, f"{where} steps") if chosen.steps else (config.eval.steps, "[eval] steps")
            source = f"eval set '{name}'"
            evaluators.append(
                Evaluator(data, batch_size, steps, device, dtype, vocab_size, source, f"eval/{name}", steps_at, name)
            )
    sets = EvalSets(evaluators)
    sets.check()
    return sets


def _name_the_set(error: ForgeError, where: str) -> None:
    """Prefix ``error``'s message with the set's table, keeping its type (and so its exit code)."""
    if len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (f"{where}: {error.args[0]}",)
