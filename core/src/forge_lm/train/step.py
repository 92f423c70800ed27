"""One optimizer step's gradients, and the model's forward and loss as the run computes them.

:func:`compute_gradients` runs the forward and backward passes of one step's micro-batches
(through the pipeline schedule under pp), the loss plus every auxiliary loss a module reported,
the fp16 loss scale, the gradient reduction deferred to the last micro-batch, and the clipping;
it takes no optimizer step. :class:`forge_lm.train.run.Run` steps the optimizer when every rank
agrees the step is finite; the evaluation uses :func:`loss_function` in :func:`evaluation_mode`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from forge_lm.components import EvaluationPointOptimizer, call_model
from forge_lm.config import ForgeConfig
from forge_lm.distributed.context_parallel import ContextParallel
from forge_lm.distributed.grads import clip_grads
from forge_lm.distributed.offload import saved_activations
from forge_lm.distributed.tensor_parallel import loss_parallel_for
from forge_lm.losses.aux import AuxCollector, collect_aux
from forge_lm.plugins._calls import PluginHookFailed
from forge_lm.train.guards import Guards


def compute_gradients(
    parts: Any,
    batches: Iterator[dict[str, torch.Tensor]],
    config: ForgeConfig,
    step: int | None = None,
    micro_batches: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AuxCollector]:
    """Gradients of one optimizer step over ``grad_accum_steps`` micro-batches, clipped; returns
    (this rank's loss, averaged over its micro-batches; the global grad norm before clipping;
    what the modules reported in the last micro-batch). The caller agrees with the other ranks
    on the mean loss and on finiteness (:func:`agree_on_step`) and steps the optimizer if all is
    finite.

    The loss and the norm stay on the device as 0-d tensors: nothing here waits for the device,
    so on a GPU the next micro-batch is queued while this one runs. The caller reads them once
    per step (the agreement) and as numbers only on the steps it logs.

    The backpropagated objective is the loss function's value plus every auxiliary loss; the
    returned loss is the data loss alone (the value without the terms the loss function
    reported, such as its z-loss), so that it reads the same with or without regularizers.
    Each auxiliary loss and loss term is reported under its own name. A failure of a component
    in the forward, the loss or the backward is named (``parts.guards``; ``step``: the step
    this is, for the message)."""
    model, optimizer, device, dtype = parts.model, parts.optimizer, parts.device, parts.dtype
    guards = parts.guards or Guards.none()  # parts built by hand (tests, benchmarks): nothing named
    context_parallel = parts.context_parallel
    accum = micro_batches or config.train.grad_accum_steps  # fewer while a batch ramp grows ([train.batch_ramp])
    optimizer.zero_grad(set_to_none=True)
    reports = AuxCollector()
    if parts.pipeline is not None:  # the schedule runs the micro-batches through the stages
        micro_batches = [next(batches) for _ in range(accum)]
        with guards.model.calling(_PASSES, step):
            loss_sum = parts.pipeline.train_step(micro_batches) * accum
        loss_sum = torch.tensor(loss_sum, dtype=torch.float64, device=device)
    else:
        loss_sum = None  # this rank's data loss summed over its micro-batches (float64 from the second on)
        for micro in range(accum):
            batch = next(batches)
            sync = micro == accum - 1 or not config.distributed.defer_grad_reduction
            # Under tp, a loss that can takes the logits split over the vocabulary (forward,
            # loss and backward all inside the region); any other, the full logits.
            sharded_loss = loss_parallel_for(parts.dims.tp, parts.loss_fn)
            calling = guards.model.calling(_PASSES, step)
            with calling, gradient_sync(model, enabled=sync), collect_aux() as reports, sharded_loss:
                # [train] activation_offload: what the forward saves waits in host memory (the backward,
                # outside, brings it back); forge_lm.distributed.offload.
                # fp32: no autocast region at all (building a disabled one costs as much as a small operation)
                autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
                with autocast, saved_activations(config, device):
                    logits, labels = forward(model, batch, context_parallel)
                    with guards.loss.calling("its loss function", step):
                        value = parts.loss_fn(logits, labels)
                    loss = checked_loss(value, config, training=True)
                aux_total = reports.total()
                full = loss if aux_total is None else loss + aux_total
                if parts.loss_scaler is not None:  # fp16: small gradients stay representable
                    full = parts.loss_scaler.scaled(full)
                (full if accum == 1 else full / accum).backward()  # one micro-batch: no scaling to do
            data_loss = reports.data_loss(loss)  # summed in float64 over several micro-batches
            loss_sum = data_loss if loss_sum is None else loss_sum.double() + data_loss.double()
    if parts.loss_scaler is not None:  # clipping, the norm and the optimizer see true gradients
        parts.loss_scaler.unscale(model.parameters())
    max_norm = config.train.grad_clip or math.inf  # inf: measure the norm without clipping
    grad_norm = clip_grads(model.parameters(), max_norm, parts.pp_group)
    return (loss_sum if accum == 1 else loss_sum / accum), grad_norm, reports


_PASSES = "the forward or backward pass"  # what a failure inside the model was raised in


def forward(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context_parallel: ContextParallel | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, labels)`` of this rank's tokens of ``batch``: all of them, or under context
    parallelism its slice of every sequence (the loss is then the mean over that slice; the
    slices are equal, so the mean of the group's losses is the loss of the whole batch). A model
    that takes more of the batch (images: :class:`~forge_lm.components.TakesBatchInputs`) gets
    those keys as keyword arguments; context parallelism is refused for it."""
    if context_parallel is None:
        return call_model(model, batch), batch["labels"]  # as an evaluator calls it (EvaluatorContext)
    batch = context_parallel.shard(batch)
    return model(batch["input_ids"], batch.get("document_ids"), positions=batch["positions"]), batch["labels"]


def loss_function(
    model: torch.nn.Module,
    loss_fn: Any,
    context_parallel: ContextParallel | None = None,
    config: ForgeConfig | None = None,
) -> Any:
    def loss_of(batch: dict[str, torch.Tensor]) -> float:
        logits, labels = forward(model, batch, context_parallel)
        value = loss_fn(logits, labels)
        return (value if config is None else checked_loss(value, config, training=False)).item()

    return loss_of


def guarded_loss(loss_of: Any, guards: Guards, step: int) -> Any:
    """``loss_of`` with a failure inside the model named (forge_lm.train.guards)."""

    def guarded(batch: dict[str, torch.Tensor]) -> float:
        with guards.model.calling("the evaluation's forward pass", step):
            return loss_of(batch)

    return guarded


def checked_loss(value: Any, config: ForgeConfig, training: bool) -> torch.Tensor:
    """The loss function's value, if it is what the core needs: a 0-d floating tensor, attached
    to the graph when training. Anything else is a :class:`PluginHookFailed` naming the loss
    and its plugin (the loop stops with the last step saved, exit 4), not a traceback further on.
    Only the tensor's metadata is read: nothing waits for the device."""
    if (
        isinstance(value, torch.Tensor)
        and value.ndim == 0
        and value.is_floating_point()
        and (value.requires_grad or not training)
    ):
        return value
    if not isinstance(value, torch.Tensor):
        what = "None" if value is None else f"a {type(value).__name__}"
    elif value.ndim != 0 or not value.is_floating_point():
        what = f"a tensor of shape {list(value.shape)} and dtype {str(value.dtype).removeprefix('torch.')}"
    else:
        what = "a tensor detached from the logits (it does not require grad)"
    chosen = config.loss
    plugin = chosen.component.plugin if chosen.component is not None else None
    problem = (
        f"returned {what} from its loss '{chosen.name}'; the core needs a 0-d floating tensor "
        "(the mean loss over the non-ignored positions)"
    )
    if plugin is None:  # a config built without the registry: no plugin to name
        raise TypeError(f"loss '{chosen.name}' {problem}")
    raise PluginHookFailed(plugin, f"loss '{chosen.name}'", problem, without="set another [loss] name")


def gradient_sync(model: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Skip the data-parallel gradient reduction of one micro-batch (``enabled`` False): FSDP2
    then keeps its unsharded gradients until a micro-batch that reduces
    (``[distributed] defer_grad_reduction``). Forge's data parallelism is FSDP2 (replication is
    FSDP2 over a 1-rank shard group); one process has nothing to reduce."""
    if enabled or not isinstance(model, FSDPModule):
        return contextlib.nullcontext()
    model.set_requires_gradient_sync(False)
    return _restore_sync(model)


@contextlib.contextmanager
def _restore_sync(model: torch.nn.Module) -> Iterator[None]:
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@contextlib.contextmanager
def evaluation_mode(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Eval mode for the model, and for optimizers that keep a separate evaluation point
    (:class:`~forge_lm.components.EvaluationPointOptimizer`: schedule-free's ``eval()`` swaps
    in the averaged weights)."""
    swaps = isinstance(optimizer, EvaluationPointOptimizer)
    model.eval()
    if swaps:
        optimizer.eval()
    try:
        yield
    finally:
        if swaps:
            optimizer.train()
        model.train()


def on_device(batches: Iterator[dict[str, torch.Tensor]], device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    for batch in batches:
        yield {key: value.to(device, non_blocking=True) for key, value in batch.items()}
