"""A run: what training holds while it goes, in one object, and what can be done with it.

:class:`Run` holds a run's parts (model, optimizer, scheduler, loss, data, evaluation sets,
metrics backends: :mod:`forge_lm.train.parts`), the :class:`TrainContext` that lifecycle hooks
receive, the checkpoint and plugin managers, and the shapes its saved states must keep
(:class:`~forge_lm.train.run_state.StateShapes`). It does four things:

- :meth:`Run.step`: one optimizer step over the step's micro-batches, when every rank agrees it
  is finite (an fp16 overflow is skipped with a smaller loss scale); the outcome says what
  happened, and a caller's policy decides what a non-finite step or a loss spike means;
- :meth:`Run.save`: a checkpoint of the training point, for an exact resume;
- :meth:`Run.restore`: back to the newest usable checkpoint (model, optimizer, schedule, data
  position, plugin states);
- :meth:`Run.evaluate`: every eval set, ``[eval] evaluators`` and the plugins' ``eval_end``.

:func:`forge_lm.train.train` (``forge train``) is the loop around a Run, with its policies:
intervals, logging, preemption, the hang watchdog, the lifecycle hooks. :func:`start_run` gives
tools and tests a Run of their own, opened as ``forge train`` opens one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from forge_lm import events
from forge_lm.checkpoint import CheckpointManager, check_location
from forge_lm.config import ForgeConfig, to_data
from forge_lm.distributed import is_main_process
from forge_lm.distributed.launch import on_main_process
from forge_lm.distributed.reduce import agree_on_step, mean_over_data_parallel
from forge_lm.errors import ConfigError
from forge_lm.losses.aux import AuxCollector
from forge_lm.model.freezing import follow_schedule
from forge_lm.plugins import PluginManager
from forge_lm.train.batch_ramp import BatchRamp, StepBatch
from forge_lm.train.ending import Teardown, end_run
from forge_lm.train.guards import Guards
from forge_lm.train.init_from import InitialWeights, load_initial_weights, read_initial_weights
from forge_lm.train.loss_scale import LossScaler
from forge_lm.train.parts import Parts, build_parts
from forge_lm.train.run_dir import RunDirectory
from forge_lm.train.run_state import StateShapes, restore_run, roll_back, save_run
from forge_lm.train.spikes import Spike, SpikeDetector
from forge_lm.train.step import compute_gradients, evaluation_mode, guarded_loss, loss_function, on_device


@attrs.define
class TrainContext:
    """What lifecycle hooks receive: the run as it stands."""

    config: ForgeConfig
    run_dir: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step: int = 0  # optimizer steps taken
    tokens_seen: int = 0
    tokens_per_step: int = 0  # the global batch: every data-parallel rank's micro-batches
    loss_scaler: LossScaler | None = None  # precision = "fp16" only; its state is checkpointed
    spike_detector: SpikeDetector | None = None  # [resilience] spike_policy; its window is checkpointed


@attrs.frozen
class StepOutcome:
    """What one :meth:`Run.step` did. ``loss`` and ``grad_norm`` stay on the device as 0-d
    tensors (reading them waits for it): read them on the steps that need the numbers."""

    taken: bool  # the optimizer and scheduler stepped: context.step counts it
    loss: torch.Tensor  # the mean data loss over every rank's micro-batches
    grad_norm: torch.Tensor  # the global gradient norm before clipping
    reports: AuxCollector  # what the modules reported in the last micro-batch
    lr: float  # the learning rate the step used (or would have)
    batch: StepBatch  # its micro-batches and tokens (fewer while a batch ramp grows)
    preempted: bool = False  # a rank had a stop signal by the end of the backward
    overflow: bool = False  # fp16: the gradients overflowed; a smaller loss scale, no step
    spike: Spike | None = None  # [resilience] spike_policy found a spike; no step
    numbers: tuple[float, float] | None = None  # (loss, grad_norm) read already (one process)

    @property
    def nonfinite(self) -> bool:
        """A non-finite loss or gradient that is not an fp16 overflow: the caller's policy decides."""
        return not self.taken and not self.overflow and self.spike is None

    def values(self) -> tuple[float, float]:
        """``(loss, grad_norm)`` as numbers (one wait for the device, unless the step's agreement
        read them already)."""
        if self.numbers is not None:
            return self.numbers
        loss, grad_norm = torch.stack([self.loss.double(), self.grad_norm.double()]).tolist()
        return loss, grad_norm


class Run:
    """One run's state and parts (the module docstring). ``Run(config, manager, parts, run_dir,
    ramp)`` joins parts built by :func:`~forge_lm.train.parts.build_parts` to an open run
    directory; :func:`start_run` does all of it."""

    def __init__(
        self, config: ForgeConfig, manager: PluginManager, parts: Parts, run_dir: Path, ramp: BatchRamp
    ) -> None:
        self.config, self.manager, self.parts, self.run_dir, self.ramp = config, manager, parts, run_dir, ramp
        self.checkpoints = CheckpointManager(
            run_dir,
            config.checkpoint.keep_last_n,
            config.checkpoint.async_save,
            retention=config.checkpoint,
            location=config.checkpoint.dir,
        )
        self.context = TrainContext(
            config,
            run_dir,
            parts.model,
            parts.optimizer,
            parts.scheduler,
            tokens_per_step=parts.tokens_per_step,
            loss_scaler=parts.loss_scaler,
            spike_detector=SpikeDetector.for_run(config),
        )
        # As built, before any step or resume loads into them: the shapes every save must keep.
        self.shapes = StateShapes(parts.scheduler, parts.train_batches)
        self.resumed_at = 0  # the step this start resumed from (0: a new run)
        self._guards = parts.guards or Guards.none()  # parts built by hand (tests, benchmarks): nothing named
        self._batches: Iterator[dict[str, torch.Tensor]] | None = None  # read from the first step on
        self._owned: tuple[RunDirectory, Teardown] | None = None  # what start_run opened, closed by close()

    @property
    def step_count(self) -> int:
        """The optimizer steps the run has taken (this start's and those it resumed from)."""
        return self.context.step

    def begin(self, resuming: bool, initial: InitialWeights | None = None) -> None:
        """Where this start begins: the newest checkpoint of a resumed run, else step 0 (with
        ``[checkpoint] init_from``'s weights when ``initial`` holds them)."""
        restored = resuming and restore_run(self.checkpoints, self.context, self.parts.train_batches, self.manager)
        self.resumed_at = self.context.step
        if initial is not None and not restored:  # a run that starts at step 0
            load_initial_weights(self.parts.model, initial)
            if is_main_process():
                print(f"forge: starting from the weights of '{self.config.checkpoint.init_from}'", file=sys.stderr)

    def start_backends(self) -> None:
        """Start the metrics backends (each guarded: one that fails is turned off with a warning)."""
        for backend in self.parts.backends:
            backend.start(to_data(self.config), self.manager.manifest())

    def step(self, stop_requested: bool = False) -> StepOutcome:
        """One optimizer step, taken when every rank's loss and gradient norm are finite.
        ``stop_requested``: this rank had a stop signal; the ranks agree on it with the loss, and
        :attr:`StepOutcome.preempted` says whether any rank had one."""
        parts, context, config = self.parts, self.context, self.config
        optimizer = parts.optimizer
        follow_schedule(parts.model, context.step)  # staged unfreezing: what trains at this step
        self._guards.scheduler.check_rates(optimizer, context.step)  # not negative: no step uphill
        batch = self.ramp.at(context.step, context.tokens_seen)  # this step's micro-batches
        lr = batch.applied(optimizer.param_groups[0]["lr"])
        number = context.step + 1  # the step this is, for messages
        local_loss, norm, reports = compute_gradients(parts, self._train_batches(), config, number, batch.micro_batches)
        agreed = agree_on_step(local_loss, norm, stop_requested, parts.dims)
        loss, preempted = agreed.loss, agreed.stop

        def outcome(taken: bool, **changes: Any) -> StepOutcome:
            return StepOutcome(taken, loss, norm, reports, lr, batch, preempted, numbers=agreed.numbers, **changes)

        if not agreed.finite:
            self._guards.raise_device_findings()  # a component that poisoned the step on purpose
            if parts.loss_scaler is not None and parts.loss_scaler.overflowed(*outcome(False).values()):
                optimizer.zero_grad(set_to_none=True)  # fp16: a smaller scale, not a bad step
                self.manager.call("forge_lm_step_skipped", context=context, step=context.step)
                return outcome(False, overflow=True)
            return outcome(False)
        spikes = context.spike_detector  # [resilience] spike_policy (forge_lm.train.spikes)
        spike = spikes.check(number, loss, norm) if spikes is not None else None
        if spike is not None:  # the step is not taken
            return outcome(False, spike=spike)
        with self._guards.optimizer.calling("step()", number), batch.scaled_lr(optimizer):
            optimizer.step()
        with self._guards.scheduler.calling("step()", number):
            parts.scheduler.step()
        if parts.loss_scaler is not None:
            parts.loss_scaler.stepped()
        context.step += 1
        context.tokens_seen += batch.tokens
        events.set_step(context.step)
        return outcome(True)  # built once, where the step ends (attrs.evolve of a draft costs 40 us a step)

    def save(self) -> None:
        """Checkpoint the run at its step (written in the background with ``[checkpoint]
        async_save``). A scheduler or data state that a resume would refuse is not written: the
        error names the component (:mod:`forge_lm.train.run_state`)."""
        save_run(self.checkpoints, self.context, self.parts.train_batches, self.manager, self.shapes)

    def restore(self) -> bool:
        """Load the newest usable checkpoint into the run, its data position included (the next
        step reads what followed it); False when there is none."""
        self.checkpoints.wait()  # a save still being written is the newest
        return restore_run(self.checkpoints, self.context, self.parts.train_batches, self.manager, at_start=False)

    def roll_back(self) -> int | None:
        """Restore the newest checkpoint but keep the data position, going on past the data read
        since (``nan_policy = "rollback"``); the step restored, or None when there is none."""
        return roll_back(self.checkpoints, self.context, self.parts.train_batches, self.manager)

    def evaluate(self) -> dict[str, float]:
        """Every eval set, then ``[eval] evaluators``, then the plugins' ``eval_end``: one record
        at this step, logged to the metrics backends and noted for ``keep_best_n``; its metrics."""
        parts, context = self.parts, self.context
        if parts.evaluator is None:
            raise ConfigError("[eval] interval = 0: the run built no eval data; set [eval] interval to evaluate it.")
        with evaluation_mode(parts.model, parts.optimizer):
            loss_of = (
                parts.pipeline.eval_loss
                if parts.pipeline is not None
                else loss_function(parts.model, parts.loss_fn, parts.context_parallel, self.config)
            )
            loss_of = guarded_loss(loss_of, self._guards, context.step)
            results = parts.evaluator.run(loss_of, lambda value: mean_over_data_parallel(value, parts.mesh, parts.dims))
            with torch.no_grad():
                for evaluator in parts.evaluators:
                    results.update(evaluator.evaluate(parts.model, context.step, results))
        try:
            extra = self.manager.collect_metrics(
                "forge_lm_eval_end", context=context, step=context.step, metrics=results
            )
            results.update(extra)
        finally:  # the evaluation happened: it is logged even when a plugin's eval_end failed
            self.log(context.step, results)
            events.record("evaluation", metrics=results)
        self.checkpoints.note_metrics(context.step, results)  # for keep_best_n
        return results

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Hand ``metrics`` of ``step`` to every metrics backend (rank 0's; the others have none)."""
        for backend in self.parts.backends:
            backend.log(step, metrics)

    def close(self, *, failed: bool = False) -> None:
        """End a run that :func:`start_run` opened: the data reader, the metrics backends and the
        checkpoint writer finish (a save in the background is completed), the run directory is
        unlocked, and under torchrun the process group goes. Closing twice does nothing."""
        if self._owned is None:
            return
        (directory, teardown), self._owned = self._owned, None
        try:
            self.parts.train_batches.close()
            status = "failed" if failed else "completed"
            end_run(self.manager, self.context, status, False, self.parts.backends, self.checkpoints, {})
        finally:
            try:
                directory.trained = directory.trained or self.context.step > self.resumed_at  # then kept
                directory.close(failed=failed)
            finally:
                teardown.close(together=not failed)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(failed=exc_type is not None)

    def _train_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._batches is None:  # a restore before the first step loaded the position it starts from
            loader = self.parts.train_batches
            self._batches = self._guards.dataset.batches(on_device(iter(loader), self.parts.device), loader)
        return self._batches


def start_run(config: ForgeConfig, manager: PluginManager) -> Run:
    """The run ``config`` describes, built and opened as ``forge train`` opens it: its directory
    locked, with its ``config.toml``, ``plugins.json`` and run id, or resumed from its newest
    checkpoint; the metrics backends started. Nothing is written when building fails.

    The caller drives it (:meth:`Run.step`, :meth:`Run.save`, :meth:`Run.evaluate`) and ends it
    with :meth:`Run.close` or a ``with`` block. Unlike ``forge train`` it keeps no event log,
    no hang watchdog or preemption handler, calls no ``train_start``, ``step_end`` or
    ``train_end`` hooks, and saves or evaluates only when asked."""
    teardown, directory = Teardown(), RunDirectory(config.train.output_dir)
    parts = None
    try:
        parts = build_parts(config, manager)
        teardown.hold(parts.pipeline)
        ramp = BatchRamp.for_run(config, parts.tokens_per_step)  # [train.batch_ramp]: a misfit is refused here
        check_location(config.checkpoint.dir)  # an object store's bucket and credentials, before writing
        initial = read_initial_weights(config, parts.model, manager)
        run_dir, resuming = on_main_process(lambda: directory.open(config, manager))
        run = Run(config, manager, parts, run_dir, ramp)
        run.begin(resuming, initial)
        run.start_backends()
    except BaseException:
        try:
            if parts is not None:
                parts.train_batches.close()  # a reader thread (on CUDA) ends with the start that failed
            directory.close(failed=True)
        finally:
            teardown.close(together=False)
        raise
    run._owned = (directory, teardown)
    return run
