"""Held-out evaluation: mean loss and perplexity over the same batches every time."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from forge_lm.data.loader import BatchLoader


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
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                losses.append(loss_of(batch))
        loss = reduce(sum(losses) / len(losses))
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0))}
