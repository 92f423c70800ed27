"""Pipeline parallelism: the model split into ``pp`` stages of consecutive blocks (TO BE WRITTEN)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class PipelineRunner:
    """This rank's pipeline stage and the schedule that runs micro-batches through all stages.

    Contract used by the training loop (forge_lm.train.loop):

    - ``PipelineRunner(model, dims, mesh, device, dtype, microbatches)``: ``model`` is the
      full, initialised Transformer (identical on every rank); keeps only this rank's stage.
    - ``.module``: this rank's stage, an ``nn.Module`` whose parameter names are those of the
      full model (``layers.3.attention.wq.weight``); the model transforms are applied to it.
    - ``.finish(loss_fn)``: build the schedule, after the transforms.
    - ``.train_step(micro_batches) -> float``: forward and backward of one optimizer step's
      micro-batches (a list of batch dicts); returns the mean loss on the last stage, 0.0 on
      the others.
    - ``.eval_loss(batch) -> float``: the loss of one batch, forward only (0.0 on stages other
      than the last).
    """

    def __init__(
        self, model: nn.Module, dims: Any, mesh: Any, device: torch.device, dtype: torch.dtype | None, microbatches: int
    ) -> None:
        raise NotImplementedError("pipeline parallelism is not written yet")
