"""Held-out evaluation: mean loss and perplexity over the same batches every time.

``eval/loss`` is the data loss (the cross-entropy): a term the loss function adds to its value
and reports with :func:`forge_lm.losses.aux.report_loss_term` (its z-loss) is taken out of it,
so that the perplexity is ``exp`` of the cross-entropy. The terms are logged in training.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from forge_lm.data.loader import BatchLoader
from forge_lm.losses.aux import collect_aux


class Evaluator:
    """Evaluates on the first ``steps`` batches of the eval split, identical at every call, so
    that successive evaluations are comparable."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        steps: int,
        device: torch.device,
        dtype: torch.dtype | None,
        vocab_size: int | None = None,
        source: str = "the evaluation data",
    ) -> None:
        self.loader = BatchLoader(dataset, batch_size, vocab_size, source)  # ids checked like training's
        self.start = self.loader.state_dict()
        self.steps = steps
        self.device = device
        self.dtype = dtype

    @torch.no_grad()
    def run(
        self, loss_of: Callable[[dict[str, torch.Tensor]], float], reduce: Callable[[float], float]
    ) -> dict[str, float]:
        """``loss_of(batch)``: this rank's loss of one batch; ``reduce``: the mean over the
        data-parallel ranks (each evaluates its own slice of the same batches)."""
        self.loader.load_state_dict(self.start)
        batches = iter(self.loader)
        losses = []
        for _ in range(self.steps):
            batch = {key: value.to(self.device) for key, value in next(batches).items()}
            autocast = torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None)
            with collect_aux() as aux, autocast:
                value = loss_of(batch)
            losses.append(value - sum(float(term) for term in aux.loss_terms.values()))
        # One reduction, on every rank alike: under pipeline parallelism only the last stage
        # computes the loss (and its terms), so a reduction per term would not match up.
        loss = reduce(sum(losses) / len(losses))
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0))}
