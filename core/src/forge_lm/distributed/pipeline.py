"""Pipeline parallelism: the model split into ``pp`` stages of consecutive blocks.

Stages. Stage ``s`` of ``pp`` holds a contiguous run of blocks (:func:`stage_layers`: as
even as possible, the first ``n_layers % pp`` stages one block more, since the last stage
also carries the head and the loss, the costliest single layer); the first stage also holds
the token embedding, the last the final norm and the output head. A stage is the full
:class:`~forge_lm.model.transformer.Transformer` with the other stages' parts set to ``None``
and ``layers`` a ``ModuleDict`` keyed by the blocks' global indices, so parameter names are
the full model's (``layers.3.attention.wq.weight``): checkpoints address parameters by name,
and one saved with one ``pp`` loads with another. The training loop builds the full model on
the meta device (no memory), keeps this rank's stage, transforms it and only then gives it
memory and initial values (:func:`forge_lm.model.init.materialize`): a rank allocates its own
blocks only, and since each value depends on the seed and the parameter's name alone, the
stages start from the weights one process would have.

Schedules. ``torch.distributed.pipelining`` runs the stages: ``gpipe`` (all forwards, then all
backwards) or ``1f1b`` (one forward, one backward in the steady state: at most ``pp``
micro-batches' activations alive per stage; needs ``grad_accum_steps >= pp``). The schedule's
microbatches are the step's ``grad_accum_steps`` micro-batches: :meth:`PipelineRunner.train_step`
concatenates them and the schedule splits the batch back into exactly those micro-batches,
so the global batch is the one without pipeline parallelism.

Loss scaling. The schedule computes the loss per microbatch on the last stage; the runner
returns ``loss / grad_accum_steps`` to it and tells it not to scale gradients itself, so each
microbatch backpropagates what the single-process loop backpropagates
(``(loss / grad_accum_steps).backward()``) and the accumulated gradients are those of the
mean loss over the micro-batches. The value :meth:`~PipelineRunner.train_step` returns is
that mean (the sum of the scaled losses).

Documents. Only the hidden state ``[B, T, dim]`` travels between stages. ``document_ids``
(packed sequences) do not: ranks that differ only in their pipeline coordinate read the same
data, so every stage holds the whole batch and gets its ``document_ids`` as a keyword
argument, which the schedule splits into the same microbatches as the inputs; each stage
builds its attention mask from them.

Tied embeddings (``[model] tie_embeddings``, the default) are rejected with a ConfigError:
the embedding (first stage) and the head (last stage) would have to be two copies kept equal
by summing their gradients across stages, and the global gradient norm, the checkpoint and the
optimizer state would then all count or hold that tensor twice. Set ``tie_embeddings = false``.

Auxiliary losses (:mod:`forge_lm.losses.aux`, e.g. an MoE router's balance loss) are not
supported: they would have to join each stage's backward. A step in which any module reports
one raises a ForgeError rather than silently training without it.

Mixed precision: each stage's forward and the loss run under ``torch.autocast`` (the loop
does not wrap the pipeline in it); backward runs outside it, as in the single-process loop.

Evaluation runs the same stages through a forward-only schedule of one microbatch, so the
loss is the loss function over the whole batch, as in one process.

Shapes and dtypes of what travels are not declared: torch infers them from the first
microbatch a schedule runs (one extra forward and input-gradient pass, once), so whatever the
model transforms make of the hidden state (bf16 under FSDP2's mixed precision) is sent. A
schedule is built per batch shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from forge_lm.components import PipelineSplittable, ShardedByBlocks
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.losses.aux import collect_aux

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_layers(n_layers: int, stages: int, stage: int) -> range:
    """The global indices of the blocks stage ``stage`` of ``stages`` holds: contiguous runs,
    as even as possible, the first ``n_layers % stages`` stages one block more."""
    if not 0 <= stage < stages or n_layers < stages:
        raise ForgeError(f"cannot give stage {stage} of {stages} a share of {n_layers} layers.")
    base, extra = divmod(n_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def check_pipeline(model: nn.Module, dims: Any, microbatches: int) -> None:
    """The rules a model and the degrees must follow to be pipelined, or a ConfigError naming
    the rule broken and what to change."""
    problems = []
    if not isinstance(model, PipelineSplittable) or not isinstance(model, ShardedByBlocks):
        raise ForgeError(
            f"pipeline parallelism cuts a model into stages of blocks; {type(model).__name__} declares no "
            "keep_stage(stage, stages) and blocks() (forge_lm.components.PipelineSplittable, ShardedByBlocks). "
            "Subclass forge_lm.model.Transformer, or set [distributed] pp = 1."
        )
    blocks = len(model.blocks())
    if dims.pp_schedule not in SCHEDULES:
        problems.append(f"pp_schedule '{dims.pp_schedule}' is not one of {', '.join(sorted(SCHEDULES))}")
    if getattr(model, "tied", False):
        problems.append(
            "the output head is tied to the token embedding, which pipeline stages cannot share "
            "(the embedding is on the first stage, the head on the last); set [model] tie_embeddings = false "
            "for pipeline parallelism"
        )
    if blocks < dims.pp:
        problems.append(f"pp = {dims.pp} stages need at least as many layers; the model has {blocks}")
    if microbatches < 1:
        problems.append(f"the pipeline needs at least one microbatch, got {microbatches}")
    elif dims.pp_schedule == "1f1b" and microbatches < dims.pp:
        problems.append(
            f"the 1f1b schedule needs at least pp = {dims.pp} microbatches; raise [train] grad_accum_steps "
            f"(now {microbatches}) or use pp_schedule = 'gpipe'"
        )
    if problems:
        raise ConfigError("[distributed] " + "; ".join(problems) + ".")


def keep_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Reduce the full ``model`` in place to stage ``stage`` of ``stages`` and return it: the
    other stages' blocks go, ``layers`` becomes a ``ModuleDict`` keyed by the global block
    indices (names unchanged), the embedding stays on the first stage only, the final norm and
    head on the last only (the model's own :meth:`~forge_lm.components.PipelineSplittable.keep_stage`)."""
    model.keep_stage(stage, stages)
    return model


class _AutocastStage(PipelineStage):
    """A pipeline stage whose forward runs under autocast (backward does not)."""

    def __init__(self, *args: Any, autocast: Callable[[], contextlib.AbstractContextManager], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._autocast = autocast

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        with self._autocast():
            return super().forward_maybe_with_nosync(*args, **kwargs)

    def _compute_outputs(self, *args: Any, module: nn.Module, **kwargs: Any) -> Any:
        # torch's shape inference runs the stage through this: the same autocast, the same dtypes.
        with self._autocast():
            return super()._compute_outputs(*args, module=module, **kwargs)


class PipelineRunner:
    """This rank's pipeline stage and the schedule that runs micro-batches through all stages.

    Contract used by the training loop (forge_lm.train.loop):

    - ``PipelineRunner(model, dims, mesh, device, dtype, microbatches)``: ``model`` is the
      full Transformer, identical on every rank: initialised, or on the meta device (the
      loop's way: the stage is materialized after the transforms); keeps only this rank's
      stage (the model is reduced in place). Raises a ConfigError for what cannot be pipelined (tied
      embeddings, fewer layers than stages, too few microbatches for 1f1b).
    - ``.module``: this rank's stage, an ``nn.Module`` whose parameter names are those of the
      full model (``layers.3.attention.wq.weight``); the model transforms are applied to it.
    - ``.finish(loss_fn)``: the loss function ``loss_fn(logits, labels)``, after the
      transforms; the schedules are built from then on, one per batch shape, when first used.
    - ``.train_step(micro_batches) -> float``: forward and backward of one optimizer step's
      micro-batches (a list of ``microbatches`` batch dicts: ``input_ids``, ``labels``,
      optionally ``document_ids``); returns the mean loss on the last stage, 0.0 on the
      others. Gradients are those of the mean loss over the micro-batches, accumulated into
      the stage's ``.grad`` (the caller zeroes them).
    - ``.close()``: drop the schedules, stages and group before the process group is destroyed.
    - ``.eval_loss(batch) -> float``: the loss of one batch, forward only (0.0 on stages other
      than the last).

    ``dtype``: the autocast dtype (None for fp32), applied around each stage's forward and the loss.
    """

    def __init__(
        self, model: nn.Module, dims: Any, mesh: Any, device: torch.device, dtype: torch.dtype | None, microbatches: int
    ) -> None:
        if dims.pp < 2:
            raise ForgeError(f"a pipeline needs pp > 1 stages; got pp = {dims.pp}.")
        check_pipeline(model, dims, microbatches)  # before anything is split or communicated
        if mesh is None:
            raise ForgeError("a pipeline needs the device mesh of a distributed run.")
        pp_mesh = mesh["pp"]
        self.group = pp_mesh.get_group()
        self.stage_index = pp_mesh.get_local_rank()
        self.num_stages = dims.pp
        self.schedule_name = dims.pp_schedule
        self.microbatches = microbatches
        self.device = device
        self.dtype = dtype
        self.module = keep_stage(model, self.stage_index, self.num_stages)
        self._loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._data_losses: list[torch.Tensor] = []  # this step's losses without reported terms, / n
        self._schedules: dict[tuple[bool, tuple[int, ...]], Any] = {}

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def finish(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Take the loss function; call after the model transforms, before the first step."""
        self._loss_fn = loss_fn
        self._schedules.clear()  # built against the transformed module from here on

    def close(self) -> None:
        """Drop the schedules, their stages and the pipeline group: the run's teardown calls this
        before destroying the process group (:func:`forge_lm.distributed.launch.shutdown_distributed`),
        so that nothing of the pipeline still holds a group or a transfer when the groups go,
        even while an exception's traceback keeps this runner alive."""
        self._schedules.clear()
        self._data_losses.clear()
        self.group = None

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> float:
        if len(micro_batches) != self.microbatches:
            raise ForgeError(
                f"the pipeline runs {self.microbatches} microbatches per step ([train] grad_accum_steps); "
                f"got {len(micro_batches)} batches."
            )
        shape = tuple(micro_batches[0]["input_ids"].shape)
        for batch in micro_batches:
            if tuple(batch["input_ids"].shape) != shape:
                raise ForgeError(
                    f"the micro-batches of a pipeline step must have one shape; got {shape} and "
                    f"{tuple(batch['input_ids'].shape)}."
                )
        if any("document_ids" in batch for batch in micro_batches):
            # The loader drops the ids of a batch whose rows each hold one document (plain causal
            # attention); beside batches that have them, that batch is one document per row.
            micro_batches = [
                batch if "document_ids" in batch else {**batch, "document_ids": torch.zeros_like(batch["input_ids"])}
                for batch in micro_batches
            ]
        joined = {
            key: torch.cat([batch[key] for batch in micro_batches])
            for key in ("input_ids", "labels", "document_ids")
            if _present(micro_batches, key)
        }
        schedule = self._schedule(train=True, shape=shape)
        self._data_losses.clear()
        losses: list[torch.Tensor] = []
        args, kwargs = self._step_arguments(joined)
        with collect_aux() as aux:
            schedule.step(*args, losses=losses if self.is_last else None, return_outputs=False, **kwargs)
        if aux.losses:
            raise ForgeError(
                f"modules reported auxiliary losses ({', '.join(sorted(aux.losses))}), which pipeline "
                "parallelism does not support; set [distributed] pp = 1 or use a feed-forward layer "
                "without auxiliary losses."
            )
        if not self.is_last:
            return 0.0
        # The logged loss is the data's, without the regularisers the loss function reported
        # (its z-loss), as in the single-process step: each call of the loss recorded its own.
        # The microbatches' calls are the last ones (a new schedule may call it once before, to
        # infer shapes).
        return torch.stack(self._data_losses[-len(losses) :]).sum().item()  # sum of loss / n: the mean

    def eval_loss(self, batch: dict[str, torch.Tensor]) -> float:
        schedule = self._schedule(train=False, shape=tuple(batch["input_ids"].shape))
        losses: list[torch.Tensor] = []
        args, kwargs = self._step_arguments(batch)
        with torch.no_grad():
            schedule.eval(*args, losses=losses if self.is_last else None, **kwargs)
        return losses[0].item() if self.is_last else 0.0

    def _step_arguments(self, batch: dict[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
        """``(args, kwargs)`` of this stage's ``schedule.step``: the inputs on the first stage
        (the others receive theirs), the labels (``target``) on the last, ``document_ids``
        (a keyword argument of the model) on every stage."""
        args = (batch["input_ids"],) if self.is_first else ()
        kwargs: dict[str, Any] = {}
        if "document_ids" in batch:
            kwargs["document_ids"] = batch["document_ids"]
        if self.is_last:
            kwargs["target"] = batch["labels"]
        return args, kwargs

    def _schedule(self, train: bool, shape: tuple[int, ...]) -> Any:
        if self._loss_fn is None:
            raise ForgeError("PipelineRunner.finish(loss_fn) must be called before the first step.")
        key = (train, shape)
        if key not in self._schedules:
            stage = _AutocastStage(
                self.module,
                self.stage_index,
                self.num_stages,
                self.device,
                group=self.group,
                autocast=self._autocast,
            )
            if train:  # each microbatch backpropagates loss / n; torch must not divide the gradients again
                self._schedules[key] = SCHEDULES[self.schedule_name](
                    stage, self.microbatches, loss_fn=self._scaled_loss(self.microbatches), scale_grads=False
                )
            else:  # the whole batch as one microbatch: the loss function over all of it, as in one process
                self._schedules[key] = ScheduleGPipe(stage, 1, loss_fn=self._scaled_loss(1), scale_grads=False)
        return self._schedules[key]

    def _scaled_loss(self, scale: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        loss_fn = self._loss_fn

        def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            with self._autocast(), collect_aux() as terms:  # its own collector: the loss's terms only
                value = loss_fn(logits, labels)
            self._data_losses.append(terms.data_loss(value).float() / scale)
            return value / scale if scale != 1 else value

        return loss

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None)


def _present(batches: list[dict[str, torch.Tensor]], key: str) -> bool:
    """Whether every batch has ``key`` (False if none has it; an error if only some do)."""
    count = sum(key in batch for batch in batches)
    if count and count != len(batches):
        raise ForgeError(
            f"'{key}' is in {count} of the step's {len(batches)} micro-batches; it must be in all or none."
        )
    return count > 0
