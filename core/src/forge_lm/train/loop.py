"""The training loop and its policies: read it top to bottom.

``train(config, manager)`` builds every component from the registry (:mod:`forge_lm.train.parts`),
opens the run directory, and drives a :class:`~forge_lm.train.run.Run` for ``max_steps``
optimizer steps: each step (forward under autocast when bf16, loss plus every auxiliary loss a
module reported, backward over ``grad_accum_steps`` micro-batches, clipping, optimizer and
scheduler step) is the Run's; what the loop decides is what happens around it: a non-finite
step or a loss spike (``[resilience]``), the metrics it logs and when, evaluation and checkpoints
at their intervals, the lifecycle hooks, a preemption signal. It knows no concrete component:
which optimizer, loss, dataset or feed-forward layer runs is the config's business.

Around the steps, what lets a user see inside the run: the event log (``events.jsonl``), the
profiler's window, memory metrics at each log, and the hang watchdog.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import attrs

from forge_lm import events
from forge_lm.checkpoint import check_location
from forge_lm.config import ForgeConfig, to_data
from forge_lm.distributed import is_main_process
from forge_lm.distributed.launch import on_main_process
from forge_lm.distributed.reduce import rank
from forge_lm.metrics.measured_peak import remeasure_cpu_peak_with_source
from forge_lm.metrics.memory import MemoryMetrics
from forge_lm.metrics.mfu import is_measured, mfu
from forge_lm.model.linear import kernel_in_use as linear_kernel_in_use
from forge_lm.notices import warn
from forge_lm.plugins import PluginManager
from forge_lm.plugins._calls import PluginHookFailed
from forge_lm.train.batch_ramp import BatchRamp
from forge_lm.train.ending import Teardown, collective_timeout, end_run, stop_for_plugin, warn_about_unused_plugins
from forge_lm.train.init_from import read_initial_weights
from forge_lm.train.parts import Parts, build_parts
from forge_lm.train.profiling import StepProfiler
from forge_lm.train.resilience import NonFiniteLoss, Preempted, PreemptionWatcher, check_startup
from forge_lm.train.run import Run
from forge_lm.train.run_dir import RunDirectory
from forge_lm.train.saving import SavePolicy
from forge_lm.train.spikes import handle_spike
from forge_lm.train.watchdog import HangWatchdog


@attrs.frozen
class TrainResult:
    run_dir: Path
    steps: int  # the run's steps, this start's and those it resumed from
    final_loss: float  # NaN when this start trained no step
    status: str
    resumed_at: int = 0  # the step this start resumed from (0: a new run); == steps: nothing to train


def train(config: ForgeConfig, manager: PluginManager) -> TrainResult:
    """Train the run ``config`` describes; under ``torchrun`` every rank calls this."""
    directory = RunDirectory(config.train.output_dir)  # locked by rank 0 while the run uses it: see run_dir
    teardown = Teardown()  # barrier, pipeline release, process group destroyed: see Teardown for the order
    together = False  # whether every rank stops here together; a rank failing alone must not wait for the others
    try:
        with directory:  # unlocked also on errors; a directory this start created is removed if no step was done
            result = _train_recording_the_end(config, manager, directory, teardown)
        together = True
    except (Preempted, NonFiniteLoss):  # every rank stops here together
        together = True
        raise
    finally:
        teardown.close(together=together)
    return result


def _train_recording_the_end(
    config: ForgeConfig, manager: PluginManager, directory: RunDirectory, teardown: Teardown
) -> TrainResult:
    """:func:`_train`, then its end in the event log: inside the run directory's ``with``, before
    a directory that this start created (and trained no step in) is removed again. A collective
    that timed out is explained as such (:class:`CollectiveTimedOut`)."""
    try:
        result = _train(config, manager, directory, teardown)
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


def _train(config: ForgeConfig, manager: PluginManager, directory: RunDirectory, teardown: Teardown) -> TrainResult:
    parts = build_parts(config, manager)
    ramp = BatchRamp.for_run(config, parts.tokens_per_step)  # [train.batch_ramp]: a misfit is refused here
    teardown.hold(parts.pipeline)
    if is_main_process():
        warn_about_unused_plugins(manager)
    check_startup()  # a preemption signal while building: stop before anything is written
    check_location(config.checkpoint.dir)  # [checkpoint] dir on an object store: reachable, before writing
    initial = read_initial_weights(config, parts.model, manager)  # [checkpoint] init_from: refused before writing
    # Only now, with everything built, is the run directory locked and written (or found, to
    # resume): a failed start leaves nothing behind.
    run_dir, resuming = on_main_process(lambda: directory.open(config, manager))
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
    run = Run(config, manager, parts, run_dir, ramp)
    context = run.context
    # What a failed checkpoint write does, and a save refused because the weights are not finite.
    saves = SavePolicy(config.checkpoint.max_failed_saves, config.resilience, run.roll_back)
    status, loss, bad_steps = "failed", float("nan"), 0
    started = False  # whether train_start was called (then train_end is)
    # From here to the teardown, a hang anywhere (a plugin's train_start, a backend's start) ends the run with 77.
    watchdog = teardown.watch(HangWatchdog(config.resilience.hang_timeout, run_dir, rank()))
    try:
        # Before any backend starts: plugins get their state back first (a tracker's run id).
        watchdog.doing("resuming from the newest checkpoint" if resuming else "loading the initial weights")
        run.begin(resuming, initial)
        initial = None  # the source's copy of the weights is not needed any more
        watchdog.doing("the metrics backends' start")
        run.start_backends()
        started = True
        watchdog.doing("the plugins' forge_lm_train_start hooks")
        manager.call("forge_lm_train_start", context=context)
        watchdog.doing(None)  # from here on: steps, evaluations, saves
        window_start, window_tokens = time.perf_counter(), 0
        with (
            PreemptionWatcher(config.resilience.signal_timeout) as preemption,
            StepProfiler(config.profiling, run_dir, rank(), parts.device) as profiler,
            MemoryMetrics(parts.device) as memory,
        ):
            try:  # the last safe point of the start-up; from here on the watcher has the signals
                check_startup()
            except Preempted:
                status = "interrupted"
                raise
            while context.step < config.train.max_steps:
                outcome = run.step(stop_requested=preemption.received is not None)
                watchdog.beat()
                if outcome.overflow:  # fp16: a smaller scale, not a bad step
                    continue
                if outcome.nonfinite:
                    bad_steps += 1  # the step's one wait for the device was the agreement
                    _handle_bad_step(run, *outcome.values(), bad_steps)
                    continue
                bad_steps = 0
                if outcome.spike is not None:  # the step is not taken
                    handle_spike(
                        context.spike_detector,
                        outcome.spike,
                        context,
                        parts.train_batches,
                        manager,
                        run.roll_back,
                        outcome.batch.micro_batches,
                    )
                    continue
                directory.trained = True  # from the first step on, the run directory is kept whatever happens
                step, window_tokens = context.step, window_tokens + outcome.batch.tokens
                last = step == config.train.max_steps
                profiler.step(step)

                logging = step % config.metrics.log_interval == 0 or step == 1 or last  # step 1: the starting loss
                metrics: dict[str, float] = {"lr": outcome.lr}
                if logging:  # the numbers leave the device only on the steps that log them
                    loss, grad_norm = outcome.values()
                    metrics = {"loss": loss, "lr": outcome.lr, "grad_norm": grad_norm, **outcome.reports.logged()}
                    if parts.loss_scaler is not None:  # the scale the next step uses
                        metrics["loss_scale"] = parts.loss_scaler.scale
                    metrics.update(outcome.batch.logged())  # with a batch ramp: this step's batch_size and tokens
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
                        run.log(step, metrics)
                        window_start, window_tokens = time.perf_counter(), 0

                if parts.evaluator and (step % config.eval.interval == 0 or last):
                    run.evaluate()  # logged, and noted for keep_best_n
                    watchdog.beat()
                    window_start = time.perf_counter()  # evaluation time is not training throughput

                # Whether any rank had a preemption signal by the end of this step's backward (agreed
                # with the loss); one arriving later is acted on after the next step.
                preempted = outcome.preempted
                if _divides(config.checkpoint.interval, step) or last or preempted:
                    saves.attempt(run.save, last_chance=last or preempted, why="preemption" if preempted else "final")
                    watchdog.beat()
                    window_start = time.perf_counter()
                if preempted:
                    saves.attempt(run.checkpoints.wait, last_chance=True, why="preemption")
                    status = "interrupted"
                    events.record("preemption", signal=preemption.signal_name)
                    raise Preempted(preemption.signal_name, step)
            saves.attempt(run.checkpoints.wait, last_chance=True, why="final")
        status = "completed"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except PluginHookFailed as failure:  # a training hook failed: stop, with the last step saved
        failure.outcome = stop_for_plugin(failure, run.checkpoints, context.step, parts.dims, run.save)
        raise
    finally:  # never replaces the exception that ended the run
        watchdog.doing("the run's end (train_end, the metrics backends' finish, the last checkpoint's write)")
        parts.train_batches.close()  # a reader thread (on CUDA) ends here, whatever ended the run
        trained = context.step > run.resumed_at  # else there is no final loss of this start to report
        summary = {"final_loss": loss, "steps": context.step} if trained else {"steps": context.step}
        end_run(manager, context, status, started, parts.backends, run.checkpoints, summary)
    return TrainResult(run_dir, context.step, loss, status, run.resumed_at)


def _handle_bad_step(run: Run, loss: float, grad_norm: float, bad_steps: int) -> None:
    """A non-finite loss or gradient: the optimizer did not step; apply the policy."""
    context, manager = run.context, run.manager
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
        if run.roll_back() is None:  # past the bad batch, not back to it
            raise NonFiniteLoss(f"{what}; resilience.nan_policy = 'rollback' but there is no checkpoint yet.")
        warn(f"{what}; rolled back to step {context.step} and skipping the bad batch")
    else:
        warn(f"{what}; skipped the step (no optimizer or scheduler update)")


def _mfu(parts: Parts, tokens_per_sec: float) -> float:
    """MFU against the run's peak. Above 1 against a measured CPU peak, the measurement was wrong
    (taken while the machine was busy, or a cached value from before a faster kernel): rank 0,
    which logs it, measures again once and uses the new peak from then on."""
    value = mfu(parts.flops_per_token, tokens_per_sec, parts.peak_flops)
    if value > 1.0 and parts.device.type == "cpu" and is_measured(parts.peak_source or "") and is_main_process():
        warn(f"MFU {value:.2f} > 1: the measured CPU peak ({parts.peak_source}) was too low; measuring it again")
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
