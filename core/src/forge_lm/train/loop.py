"""The training loop: read it top to bottom.

``train(config, manager)`` builds every component from the registry, then runs
``max_steps`` optimizer steps of: forward (under autocast when bf16), loss plus every
auxiliary loss a module reported, backward over ``grad_accum_steps`` micro-batches (gradient
sync only on the last one), gradient clipping, optimizer and scheduler step, metrics,
lifecycle hooks, evaluation and checkpoints at their intervals. It knows no concrete
component: which optimizer, loss, dataset or feed-forward layer runs is the config's business.

Around the steps, what lets a user see inside the run: the event log (``events.jsonl``), the
profiler's window, memory metrics at each log, and the hang watchdog.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.distributed.fsdp import FSDPModule

from forge_lm import events
from forge_lm.checkpoint import CheckpointManager
from forge_lm.components import EvaluationPointOptimizer, EvaluatorContext, call_model
from forge_lm.config import ForgeConfig, model_options, to_data
from forge_lm.data.loader import BatchLoader
from forge_lm.distributed import (
    ParallelDims,
    TransformContext,
    apply_model_transforms,
    detect_launch,
    dp_coordinates,
    init_distributed,
    is_main_process,
)
from forge_lm.distributed.consistency import check_same_plugins
from forge_lm.distributed.context_parallel import ContextParallel, enable_context_parallel
from forge_lm.distributed.grads import clip_grads
from forge_lm.distributed.health import check_health
from forge_lm.distributed.launch import on_main_process, rank_device
from forge_lm.distributed.pipeline import PipelineRunner
from forge_lm.distributed.reduce import agree_on_step, mean_over_data_parallel, rank
from forge_lm.distributed.tensor_parallel import loss_parallel_for
from forge_lm.errors import ConfigError
from forge_lm.losses.aux import AuxCollector, collect_aux
from forge_lm.metrics.measured_peak import remeasure_cpu_peak_with_source
from forge_lm.metrics.memory import MemoryMetrics
from forge_lm.metrics.mfu import is_measured, mfu, world_peak_with_source
from forge_lm.model import build_model
from forge_lm.model.capabilities import check_capabilities
from forge_lm.model.flops import model_flops_per_token
from forge_lm.model.freezing import follow_schedule, staged_parameters_trainable
from forge_lm.model.init import materialize
from forge_lm.model.linear import choose_auto as choose_auto_kernel
from forge_lm.model.linear import kernel_in_use as linear_kernel_in_use
from forge_lm.model.linear import resolve_kernel as resolve_linear_kernel
from forge_lm.model.linear import set_kernel as set_linear_kernel
from forge_lm.model.linear_choice import linear_shapes
from forge_lm.model.memory import check_memory, model_vocab_size
from forge_lm.plugins import PluginManager
from forge_lm.plugins._calls import PluginHookFailed
from forge_lm.train.batch_ramp import BatchRamp
from forge_lm.train.builders import (
    CheckedEvaluator,
    build_dataset,
    build_evaluators,
    build_metrics_backends,
)
from forge_lm.train.cpu_memory import keep_freed_memory
from forge_lm.train.device import autocast_dtype, batch_transfer, resolve_device, seed_everything
from forge_lm.train.ending import Teardown, collective_timeout, end_run, stop_for_plugin, warn_about_unused_plugins
from forge_lm.train.evaluate import EvalSets, build_eval_sets, run_autocast
from forge_lm.train.guards import Guards
from forge_lm.train.init_from import load_initial_weights, read_initial_weights
from forge_lm.train.loss_scale import LossScaler, build_loss_scaler
from forge_lm.train.profiling import StepProfiler
from forge_lm.train.resilience import NonFiniteLoss, Preempted, PreemptionWatcher, agree, check_startup
from forge_lm.train.run_dir import RunDirectory
from forge_lm.train.run_state import StateShapes, restore_run, roll_back, save_run
from forge_lm.train.saving import SavePolicy
from forge_lm.train.spikes import SpikeDetector, handle_spike
from forge_lm.train.watchdog import HangWatchdog


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
class TrainResult:
    run_dir: Path
    steps: int  # the run's steps, this start's and those it resumed from
    final_loss: float  # NaN when this start trained no step
    status: str
    resumed_at: int = 0  # the step this start resumed from (0: a new run); == steps: nothing to train


# What [train] cpu_keep_freed_memory did on a run that is not on the CPU (forge_lm.train.cpu_memory).
_NOT_A_CPU_RUN = "not changed: not a CPU run"


@attrs.define
class _Parts:
    """Everything a run is built from, before anything is written."""

    device: torch.device
    dtype: torch.dtype | None
    dims: ParallelDims
    mesh: Any  # the device mesh; None in one process
    model: torch.nn.Module  # this rank's part of the model, transformed (sharded, compiled, ...)
    pipeline: PipelineRunner | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss_fn: Any
    train_batches: BatchLoader
    evaluator: EvalSets | None  # the eval data: [eval.datasets], or [data]'s held-out split
    evaluators: list[CheckedEvaluator]  # [eval] evaluators
    backends: list[Any]
    tokens_per_step: int
    flops_per_token: float
    peak_flops: float | None  # of the whole world (one device's times the ranks); None: unknown, no MFU
    peak_source: str | None  # where the peak came from (configured, GPU table, theoretical, measured)
    context_parallel: ContextParallel | None = None  # cp > 1: this rank's place in its sequence-splitting group
    cpu_memory: str = _NOT_A_CPU_RUN  # what [train] cpu_keep_freed_memory did (forge_lm.train.cpu_memory)
    guards: Guards | None = None  # the calls into the components, each failure named (forge_lm.train.guards)
    loss_scaler: LossScaler | None = None  # precision = "fp16": the dynamic loss scale (forge_lm.train.loss_scale)
    kernel_reason: str = ""  # why the fp32 CPU linear products take the kernel they take

    @property
    def pp_group(self) -> Any:
        return self.mesh["pp"].get_group() if self.dims.pp > 1 else None


def _choose_linear_kernel(kernel: str, device: torch.device) -> None:
    """Set the kernel of the model's fp32 CPU linear products (forge_lm.model.linear); one the
    machine cannot run is a config error, not a silent fallback."""
    if not set_linear_kernel(kernel) and kernel == "onednn" and device.type == "cpu":
        raise ConfigError(
            "[train] cpu_linear_kernel = 'onednn', but this torch build has no oneDNN (mkldnn) linear kernel; "
            "set it to 'auto' or 'aten'."
        )


def _decide_auto_kernel(config: ForgeConfig, model: torch.nn.Module, device: torch.device, dtype: Any) -> str:
    """For ``cpu_linear_kernel = "auto"`` in an fp32 CPU run: the kernel measured faster on
    this model's products (forge_lm.model.linear_choice), the same on every rank (oneDNN only
    where every rank chose it); why, for the start event. Otherwise what was configured."""
    kernel = config.train.cpu_linear_kernel
    if kernel != "auto" or device.type != "cpu" or dtype is not None:
        return f"configured: {kernel}" if kernel != "auto" else "auto: not an fp32 CPU run"
    tokens = config.train.batch_size * config.train.seq_len
    reason = choose_auto_kernel(linear_shapes(model, tokens))
    onednn = not agree(not resolve_linear_kernel("auto"))  # one rank choosing torch's makes it every rank's
    set_linear_kernel("onednn" if onednn else "aten")
    return reason


def _cpu_memory(keep: bool, device: torch.device) -> str:
    """Keep freed memory in the process for a CPU run (forge_lm.train.cpu_memory); what was done."""
    if device.type != "cpu":
        return _NOT_A_CPU_RUN
    if not keep:
        return "not changed: [train] cpu_keep_freed_memory = false"
    return keep_freed_memory()


def _build(config: ForgeConfig, manager: PluginManager) -> _Parts:
    """Join the process group (under torchrun), then build every component from the registry.
    Raises on any bad config or missing dependency; writes nothing."""
    registry = manager.registry
    launch = detect_launch()
    dims = ParallelDims.resolve(config, launch.world_size)  # checked before any process group exists
    device = rank_device(resolve_device(config.train.device), launch)
    dtype = autocast_dtype(config.train.precision, device)
    _choose_linear_kernel(config.train.cpu_linear_kernel, device)
    cpu_memory = _cpu_memory(config.train.cpu_keep_freed_memory, device)
    init_distributed(launch, device, config.distributed.timeout)
    if config.resilience.health_check and launch.world_size > 1:  # a bad rank is named before anything is built
        health = check_health(device)
        if is_main_process():
            print(f"forge: health check passed: {health.summary()}", file=sys.stderr)
    mesh = dims.build_mesh(device.type)
    check_same_plugins(manager.manifest(), manager.manifest_hash())
    dp_rank, dp_size = dp_coordinates(mesh)
    seed_everything(config.train.seed)  # every rank builds the same initial model
    tokenizer = config.tokenizer.build()
    vocab_size = _vocab_size(config, tokenizer)
    check_memory(config, vocab_size, registry, dims, device, dtype, agree)  # a run that cannot fit stops here
    # Under torchrun no rank holds the whole model: it is built on the meta device (no memory),
    # cut into a stage and transformed, then materialized below, each rank allocating and
    # initialising only its shards. Initial values depend on the seed and parameter names
    # alone, so every layout starts from the one-process weights (forge_lm.model.init).
    on_meta = dims.distributed
    model = build_model(
        config.model, vocab_size, registry, seed=config.train.seed, device="meta" if on_meta else device
    )
    check_capabilities(model, config, dims)  # before any transform: a layout the family cannot run is refused
    kernel_reason = _decide_auto_kernel(config, model, device, dtype)
    guards = Guards(config, registry, model)  # before the transforms: a compiled layer keeps its output check
    flops = model_flops_per_token(model, config.train.seq_len)
    context_parallel = None
    if dims.cp > 1:  # before the transforms: FSDP2 and activation checkpointing wrap the modules it marks
        context_parallel = ContextParallel.from_mesh(mesh)
        enable_context_parallel(model, context_parallel)
    pipeline = None
    if dims.pp > 1:
        pipeline = PipelineRunner(model, dims, mesh, device, dtype, config.train.grad_accum_steps)
        model = pipeline.module  # this rank's stage; the transforms below apply to it
    applied = apply_model_transforms(model, TransformContext(config, dims, mesh, device, dtype), registry)
    if on_meta:
        materialize(model, device, config.train.seed)
    with staged_parameters_trainable(model):  # the optimizer knows what a transform unfreezes later
        optimizer = config.optimizer.build(model)
    loss_fn = config.loss.build()
    if pipeline is not None:
        pipeline.finish(loss_fn)
    evaluator = None
    if config.eval.interval:  # each set's batches are read once here: a set too short fails now
        evaluator = build_eval_sets(config, registry, tokenizer, vocab_size, dp_rank, dp_size, device, dtype)
    evaluators = []
    if config.eval.evaluators and config.eval.interval:  # not under pp or cp: ParallelDims.check refused those
        evaluator_context = EvaluatorContext(
            run_dir=Path(config.train.output_dir),
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            seq_len=config.train.seq_len,
            max_seq_len=model_options(config).max_seq_len,
            batch_size=config.train.batch_size,
            device=device,
            dtype=dtype,
            rank=launch.rank,
            world_size=launch.world_size,
            validation=evaluator.validation,
            eval_sets=evaluator.named,
            autocast=partial(run_autocast, device, dtype),
        )
        evaluators = build_evaluators(config, evaluator_context)
    if dims.distributed and is_main_process():
        print(f"forge: {dims.describe()}; model transforms: {', '.join(applied) or 'none'}", file=sys.stderr)
    train_data = build_dataset(config, registry, tokenizer, vocab_size, "train", dp_rank, dp_size)
    return _Parts(
        device=device,
        dtype=dtype,
        dims=dims,
        mesh=mesh,
        model=model,
        pipeline=pipeline,
        optimizer=optimizer,
        scheduler=config.scheduler.build(optimizer, config.train.max_steps),
        loss_fn=loss_fn,
        train_batches=BatchLoader(
            train_data,
            config.train.batch_size,
            vocab_size,
            f"the '{config.data.name}' data",
            seq_len=config.train.seq_len,
            **batch_transfer(device),
        ),
        evaluator=evaluator,
        evaluators=evaluators,
        # Metrics are the main process's job; the others report through it.
        backends=build_metrics_backends(config, Path(config.train.output_dir)) if is_main_process() else [],
        tokens_per_step=config.train.batch_size * config.train.seq_len * config.train.grad_accum_steps * dp_size,
        flops_per_token=flops,
        **_peak(device, dtype, config.metrics.peak_flops, dims.world_size),
        guards=guards,
        kernel_reason=kernel_reason,
        context_parallel=context_parallel,
        cpu_memory=cpu_memory,
        loss_scaler=build_loss_scaler(config),
    )


def train(config: ForgeConfig, manager: PluginManager) -> TrainResult:
    """Train the run ``config`` describes; under ``torchrun`` every rank calls this."""
    run = RunDirectory(config.train.output_dir)  # locked by rank 0 while the run uses it: see run_dir
    teardown = Teardown()  # barrier, pipeline release, process group destroyed: see Teardown for the order
    together = False  # whether every rank stops here together; a rank failing alone must not wait for the others
    try:
        with run:  # unlocked also on errors; a directory this start created is removed if no step was done
            result = _train_recording_the_end(config, manager, run, teardown)
        together = True
    except (Preempted, NonFiniteLoss):  # every rank stops here together
        together = True
        raise
    finally:
        teardown.close(together=together)
    return result


def _train_recording_the_end(
    config: ForgeConfig, manager: PluginManager, run: RunDirectory, teardown: Teardown
) -> TrainResult:
    """:func:`_train`, then its end in the event log: inside the run directory's ``with``, before
    a directory that this start created (and trained no step in) is removed again. A collective
    that timed out is explained as such (:class:`CollectiveTimedOut`)."""
    try:
        result = _train(config, manager, run, teardown)
    except BaseException as error:
        timed_out = collective_timeout(error, config.distributed.timeout)
        _record_end(timed_out or error)
        if timed_out is not None:
            raise timed_out from error
        raise
    _record_end(None)
    return result


def _record_end(error: BaseException | None) -> None:
    """The last events of this start (when it got as far as opening the event log): the error
    on the rank it happened on, then how the run ended."""
    if events.current() is None:
        return
    code = events.exit_code_of(error)
    if error is not None and not isinstance(error, Preempted | KeyboardInterrupt):
        events.record("error", exit_code=code, error=f"{type(error).__name__}: {error}")
    status = "completed" if error is None else "interrupted" if code in (75, 130) else "failed"
    events.record("end", status=status, exit_code=code)
    events.close_log()


def _train(config: ForgeConfig, manager: PluginManager, run: RunDirectory, teardown: Teardown) -> TrainResult:
    parts = _build(config, manager)
    ramp = BatchRamp.for_run(config, parts.tokens_per_step)  # [train.batch_ramp]: a misfit is refused here
    teardown.hold(parts.pipeline)
    model, optimizer, backends = parts.model, parts.optimizer, parts.backends
    if is_main_process():
        warn_about_unused_plugins(manager)
    check_startup()  # a preemption signal while building: stop before anything is written
    initial = read_initial_weights(config, model, manager)  # [checkpoint] init_from: refused before anything is written
    # Only now, with everything built, is the run directory locked and written (or found, to
    # resume): a failed start leaves nothing behind.
    run_dir, resuming = on_main_process(lambda: run.open(config, manager))
    events.open_log(run_dir, rank())
    events.record(
        "start",
        resuming=resuming,
        world_size=parts.dims.world_size,
        config_hash=_config_hash(config),
        plugins=manager.manifest(),
        plugins_hash=manager.manifest_hash(),
        cpu_linear_kernel=linear_kernel_in_use(),
        cpu_linear_kernel_reason=parts.kernel_reason,
        cpu_memory=parts.cpu_memory,
    )
    checkpoints = CheckpointManager(
        run_dir, config.checkpoint.keep_last_n, config.checkpoint.async_save, retention=config.checkpoint
    )
    context = TrainContext(
        config,
        run_dir,
        model,
        optimizer,
        parts.scheduler,
        tokens_per_step=parts.tokens_per_step,
        loss_scaler=parts.loss_scaler,
        spike_detector=SpikeDetector.for_run(config),
    )
    shapes = StateShapes(parts.scheduler, parts.train_batches)  # what every save must keep (a resume demands it)
    # What a failed checkpoint write does, and a save refused because the weights are not finite.
    rollback = partial(roll_back, checkpoints, context, parts.train_batches, manager)
    saves = SavePolicy(config.checkpoint.max_failed_saves, config.resilience, rollback)
    status, loss, bad_steps = "failed", float("nan"), 0
    resumed_at = 0  # the step this start resumed from; a finished run resumed trains no step
    started = False  # whether train_start was called (then train_end is)
    # From here to the teardown, a hang anywhere (a plugin's train_start, a backend's start) ends the run with 77.
    watchdog = teardown.watch(HangWatchdog(config.resilience.hang_timeout, run_dir, rank()))
    try:
        if resuming:  # before any backend starts: plugins get their state back first (a tracker's run id)
            watchdog.doing("resuming from the newest checkpoint")
            restored = restore_run(checkpoints, context, parts.train_batches, manager)
            resumed_at = context.step
        if initial is not None and not (resuming and restored):  # a run that starts at step 0
            load_initial_weights(model, initial)
            if is_main_process():
                print(f"forge: starting from the weights of '{config.checkpoint.init_from}'", file=sys.stderr)
        initial = None  # the source's copy of the weights is not needed any more
        watchdog.doing("the metrics backends' start")
        for backend in backends:  # guarded: a backend that fails is turned off with a warning
            backend.start(to_data(config), manager.manifest())
        started = True
        watchdog.doing("the plugins' forge_lm_train_start hooks")
        manager.call("forge_lm_train_start", context=context)
        watchdog.doing(None)  # from here on: steps, evaluations, saves
        batches = parts.guards.dataset.batches(_on_device(iter(parts.train_batches), parts.device), parts.train_batches)
        window_start, window_tokens = time.perf_counter(), 0
        memory = MemoryMetrics(parts.device)
        with (
            PreemptionWatcher(config.resilience.signal_timeout) as preemption,
            StepProfiler(config.profiling, run_dir, rank(), parts.device) as profiler,
        ):
            try:  # the last safe point of the start-up; from here on the watcher has the signals
                check_startup()
            except Preempted:
                status = "interrupted"
                raise
            while context.step < config.train.max_steps:
                follow_schedule(model, context.step)  # staged unfreezing: what trains at this step
                parts.guards.scheduler.check_rates(optimizer, context.step)  # not negative: no step uphill
                plan = ramp.at(context.step, context.tokens_seen)  # this step's micro-batches
                lr = plan.applied(optimizer.param_groups[0]["lr"])
                local_loss, step_norm, reports = _train_step(
                    parts, batches, config, context.step + 1, plan.micro_batches
                )
                watchdog.beat()
                stop_noted = preemption.received is not None
                step_loss, finite, preempted = agree_on_step(local_loss, step_norm, stop_noted, parts.dims)
                if not finite:
                    parts.guards.raise_device_findings()  # a component that poisoned the step on purpose
                    loss, grad_norm = torch.stack([step_loss.double(), step_norm.double()]).tolist()
                    if parts.loss_scaler is not None and parts.loss_scaler.overflowed(loss, grad_norm):
                        _skip_overflow(context, manager)  # fp16: a smaller scale, not a bad step
                        continue
                    bad_steps += 1  # the step's one wait for the device was the agreement above
                    _handle_bad_step(context, checkpoints, parts.train_batches, manager, loss, grad_norm, bad_steps)
                    continue
                bad_steps = 0
                spikes = context.spike_detector  # [resilience] spike_policy (forge_lm.train.spikes)
                spike = spikes.check(context.step + 1, step_loss, step_norm) if spikes is not None else None
                if spike is not None:  # the step is not taken
                    handle_spike(spikes, spike, context, parts.train_batches, manager, rollback, plan.micro_batches)
                    continue
                with parts.guards.optimizer.calling("step()", context.step + 1), plan.scaled_lr(optimizer):
                    optimizer.step()
                with parts.guards.scheduler.calling("step()", context.step + 1):
                    parts.scheduler.step()
                if parts.loss_scaler is not None:
                    parts.loss_scaler.stepped()
                context.step += 1
                run.trained = True  # from the first step on, the run directory is kept whatever happens
                context.tokens_seen += plan.tokens
                step, window_tokens = context.step, window_tokens + plan.tokens
                last = step == config.train.max_steps
                events.set_step(step)
                profiler.step(step)

                logging = step % config.metrics.log_interval == 0 or step == 1 or last  # step 1: the starting loss
                metrics: dict[str, float] = {"lr": lr}
                if logging:  # the numbers leave the device only on the steps that log them
                    loss, grad_norm = torch.stack([step_loss.double(), step_norm.double()]).tolist()
                    metrics = {"loss": loss, "lr": lr, "grad_norm": grad_norm, **reports.logged()}
                    if parts.loss_scaler is not None:  # the scale the next step uses
                        metrics["loss_scale"] = parts.loss_scaler.scale
                    metrics.update(plan.logged())  # with a batch ramp: this step's batch_size and tokens_per_step
                    if context.spike_detector is not None:
                        metrics["spikes"] = context.spike_detector.spikes
                try:
                    extra = manager.collect_metrics("forge_lm_step_end", context=context, step=step, metrics=metrics)
                    metrics.update(extra)
                finally:  # the step happened: it is logged even when a plugin's step_end failed
                    if logging:
                        tokens_per_sec = window_tokens / (time.perf_counter() - window_start)
                        metrics["tokens_per_sec"] = tokens_per_sec
                        if parts.peak_flops is not None:  # an unknown device logs no MFU (warned once)
                            metrics["mfu"] = _mfu(parts, tokens_per_sec)
                        metrics.update(memory.read())
                        _log(backends, step, metrics)
                        window_start, window_tokens = time.perf_counter(), 0

                if parts.evaluator and (step % config.eval.interval == 0 or last):
                    checkpoints.note_metrics(step, _evaluate(parts, context, manager))  # for keep_best_n
                    watchdog.beat()
                    window_start = time.perf_counter()  # evaluation time is not training throughput

                # Whether any rank had a preemption signal by the end of this step's backward (agreed
                # with the loss); one arriving later is acted on after the next step.
                if _divides(config.checkpoint.interval, step) or last or preempted:
                    save = partial(save_run, checkpoints, context, parts.train_batches, manager, shapes)
                    saves.attempt(save, last_chance=last or preempted, why="preemption" if preempted else "final")
                    watchdog.beat()
                    window_start = time.perf_counter()
                if preempted:
                    saves.attempt(checkpoints.wait, last_chance=True, why="preemption")
                    status = "interrupted"
                    events.record("preemption", signal=preemption.signal_name)
                    raise Preempted(preemption.signal_name, step)
            saves.attempt(checkpoints.wait, last_chance=True, why="final")
        status = "completed"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except PluginHookFailed as failure:  # a training hook failed: stop, with the last step saved
        save = partial(save_run, checkpoints, context, parts.train_batches, manager, shapes)
        failure.outcome = stop_for_plugin(failure, checkpoints, context.step, parts.dims, save)
        raise
    finally:  # never replaces the exception that ended the run
        watchdog.doing("the run's end (train_end, the metrics backends' finish, the last checkpoint's write)")
        parts.train_batches.close()  # a reader thread (on CUDA) ends here, whatever ended the run
        trained = context.step > resumed_at  # else there is no final loss of this start to report
        summary = {"final_loss": loss, "steps": context.step} if trained else {"steps": context.step}
        end_run(manager, context, status, started, backends, checkpoints, summary)
    return TrainResult(run_dir, context.step, loss, status, resumed_at)


def _peak(device: torch.device, dtype: torch.dtype | None, configured: float | None, world_size: int) -> dict:
    """``peak_flops`` and ``peak_source`` of the run's devices. Measured (on CPU) by rank 0 alone:
    ranks timing matmuls at once would each see a fraction."""
    found = on_main_process(lambda: world_peak_with_source(device, dtype, configured, world_size))
    peak, source = found if found is not None else (None, None)
    return {"peak_flops": peak, "peak_source": source}


def _mfu(parts: _Parts, tokens_per_sec: float) -> float:
    """MFU against the run's peak. Above 1 against a measured CPU peak, the measurement was wrong
    (taken while the machine was busy, or a cached value from before a faster kernel): rank 0,
    which logs it, measures again once and uses the new peak from then on."""
    value = mfu(parts.flops_per_token, tokens_per_sec, parts.peak_flops)
    if value > 1.0 and parts.device.type == "cpu" and is_measured(parts.peak_source or "") and is_main_process():
        _warn(f"MFU {value:.2f} > 1: the measured CPU peak ({parts.peak_source}) was too low; measuring it again")
        peak, source = remeasure_cpu_peak_with_source(parts.dtype)
        parts.peak_flops, parts.peak_source = peak * parts.dims.world_size, f"re-{source}"
        value = mfu(parts.flops_per_token, tokens_per_sec, parts.peak_flops)
    return value


def _config_hash(config: ForgeConfig) -> str:
    """A short fingerprint of the resolved config: two starts with the same hash ran the same config."""
    text = json.dumps(to_data(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _divides(interval: int, step: int) -> bool:
    return bool(interval) and step % interval == 0


def _evaluate(parts: _Parts, context: TrainContext, manager: PluginManager) -> dict[str, float]:
    """Every eval set, then ``[eval] evaluators``, then the plugins' eval_end: one record at this
    step, whose metrics are returned."""
    with _evaluation_mode(parts.model, parts.optimizer):
        loss_of = (
            parts.pipeline.eval_loss
            if parts.pipeline is not None
            else _loss_of(parts.model, parts.loss_fn, parts.context_parallel, context.config)
        )
        loss_of = _guarded(loss_of, parts.guards or Guards.none(), context.step)
        results = parts.evaluator.run(loss_of, lambda value: mean_over_data_parallel(value, parts.mesh, parts.dims))
        with torch.no_grad():
            for evaluator in parts.evaluators:
                results.update(evaluator.evaluate(parts.model, context.step, results))
    try:
        extra = manager.collect_metrics("forge_lm_eval_end", context=context, step=context.step, metrics=results)
        results.update(extra)
    finally:  # the evaluation happened: it is logged even when a plugin's eval_end failed
        _log(parts.backends, context.step, results)
        events.record("evaluation", metrics=results)
    return results


def _skip_overflow(context: TrainContext, manager: PluginManager) -> None:
    """fp16 gradients overflowed (the scaler backed off and recorded it): no optimizer or scheduler step."""
    context.optimizer.zero_grad(set_to_none=True)
    manager.call("forge_lm_step_skipped", context=context, step=context.step)  # as a skipped bad step


def _handle_bad_step(
    context: TrainContext,
    checkpoints: CheckpointManager,
    train_batches: BatchLoader,
    manager: PluginManager,
    loss: float,
    grad_norm: float,
    bad_steps: int,
) -> None:
    """A non-finite loss or gradient: the optimizer did not step; apply the policy."""
    policy = context.config.resilience
    what = f"non-finite loss {loss} / gradient norm {grad_norm} after step {context.step}"
    context.optimizer.zero_grad(set_to_none=True)
    stopping = policy.nan_policy == "stop" or bad_steps >= policy.max_bad_steps
    action = "stop" if stopping else policy.nan_policy
    events.record("nonfinite_step", loss=loss, grad_norm=grad_norm, action=action, bad_steps_in_a_row=bad_steps)
    if stopping:
        reason = (
            "resilience.nan_policy = 'stop'"
            if policy.nan_policy == "stop"
            else (f"{bad_steps} bad steps in a row (resilience.max_bad_steps = {policy.max_bad_steps})")
        )
        raise NonFiniteLoss(
            f"{what}; stopping because of {reason}. The newest checkpoint is intact; lower the learning rate "
            "or check the data, then run the same command to resume."
        )
    # The bad batch's forward and backward ran but no step_end follows: per-step state that
    # components accumulated from it (a router's load counts) is discarded before going on.
    manager.call("forge_lm_step_skipped", context=context, step=context.step)
    if policy.nan_policy == "rollback":
        if roll_back(checkpoints, context, train_batches, manager) is None:  # past the bad batch, not back to it
            raise NonFiniteLoss(f"{what}; resilience.nan_policy = 'rollback' but there is no checkpoint yet.")
        _warn(f"{what}; rolled back to step {context.step} and skipping the bad batch")
    else:
        _warn(f"{what}; skipped the step (no optimizer or scheduler update)")


def _train_step(
    parts: _Parts,
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
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for micro in range(accum):
            batch = next(batches)
            sync = micro == accum - 1 or not config.distributed.defer_grad_reduction
            # Under tp, a loss that can takes the logits split over the vocabulary (forward,
            # loss and backward all inside the region); any other, the full logits.
            sharded_loss = loss_parallel_for(parts.dims.tp, parts.loss_fn)
            calling = guards.model.calling(_PASSES, step)
            with calling, _gradient_sync(model, enabled=sync), collect_aux() as reports, sharded_loss:
                with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                    logits, labels = _forward(model, batch, context_parallel)
                    with guards.loss.calling("its loss function", step):
                        value = parts.loss_fn(logits, labels)
                    loss = _checked_loss(value, config, training=True)
                aux_total = reports.total()
                full = loss if aux_total is None else loss + aux_total
                if parts.loss_scaler is not None:  # fp16: small gradients stay representable
                    full = parts.loss_scaler.scaled(full)
                (full / accum).backward()
            loss_sum = loss_sum + reports.data_loss(loss).double()
    if parts.loss_scaler is not None:  # clipping, the norm and the optimizer see true gradients
        parts.loss_scaler.unscale(model.parameters())
    max_norm = config.train.grad_clip or math.inf  # inf: measure the norm without clipping
    grad_norm = clip_grads(model.parameters(), max_norm, parts.pp_group)
    return loss_sum / accum, grad_norm, reports


_PASSES = "the forward or backward pass"  # what a failure inside the model was raised in


def _forward(
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


def _loss_of(
    model: torch.nn.Module,
    loss_fn: Any,
    context_parallel: ContextParallel | None = None,
    config: ForgeConfig | None = None,
) -> Any:
    def loss_of(batch: dict[str, torch.Tensor]) -> float:
        logits, labels = _forward(model, batch, context_parallel)
        value = loss_fn(logits, labels)
        return (value if config is None else _checked_loss(value, config, training=False)).item()

    return loss_of


def _guarded(loss_of: Any, guards: Guards, step: int) -> Any:
    """``loss_of`` with a failure inside the model named (forge_lm.train.guards)."""

    def guarded(batch: dict[str, torch.Tensor]) -> float:
        with guards.model.calling("the evaluation's forward pass", step):
            return loss_of(batch)

    return guarded


def _checked_loss(value: Any, config: ForgeConfig, training: bool) -> torch.Tensor:
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


def _gradient_sync(model: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
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
def _evaluation_mode(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
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


def _on_device(batches: Iterator[dict[str, torch.Tensor]], device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    for batch in batches:
        yield {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def _log(backends: list[Any], step: int, metrics: dict[str, float]) -> None:
    for backend in backends:
        backend.log(step, metrics)


def _warn(message: str) -> None:
    print(f"forge: warning: {message}", file=sys.stderr, flush=True)


def _vocab_size(config: ForgeConfig, tokenizer: Any) -> int:
    return model_vocab_size(config, tokenizer)  # shared with `forge config validate`
