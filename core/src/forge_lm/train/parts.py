"""The parts of a run, built before anything is written: join the process group (under
torchrun; a group of its own for ``cpu_offload`` in one process), build the model on the meta
device or this process's, cut it into a pipeline stage,
apply the model transforms, then the optimizer, scheduler, loss, data, evaluation sets,
evaluators and metrics backends. Any bad config or missing dependency is refused here, with
nothing written: :func:`build_parts` raises, the run directory is not touched yet."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import torch

from forge_lm.components import EvaluatorContext
from forge_lm.config import ForgeConfig, model_options
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
from forge_lm.distributed.health import check_health
from forge_lm.distributed.launch import init_one_rank_group, on_main_process, rank_device
from forge_lm.distributed.offload import buffers_to, check_offload, fsdp_in_one_process, parameters_device
from forge_lm.distributed.pipeline import PipelineRunner
from forge_lm.errors import ConfigError
from forge_lm.metrics.mfu import world_peak_with_source
from forge_lm.model import build_model
from forge_lm.model.capabilities import check_capabilities
from forge_lm.model.flops import model_flops_per_token
from forge_lm.model.freezing import staged_parameters_trainable
from forge_lm.model.init import materialize
from forge_lm.model.linear import choose_auto as choose_auto_kernel
from forge_lm.model.linear import resolve_kernel as resolve_linear_kernel
from forge_lm.model.linear import set_kernel as set_linear_kernel
from forge_lm.model.linear_choice import linear_shapes
from forge_lm.model.memory import check_memory, model_vocab_size
from forge_lm.plugins import PluginManager
from forge_lm.train.builders import (
    CheckedEvaluator,
    build_dataset,
    build_evaluators,
    build_metrics_backends,
)
from forge_lm.train.cpu_memory import keep_freed_memory
from forge_lm.train.device import autocast_dtype, batch_transfer, resolve_device, seed_everything
from forge_lm.train.evaluate import EvalSets, build_eval_sets, run_autocast
from forge_lm.train.guards import Guards
from forge_lm.train.loss_scale import LossScaler, build_loss_scaler
from forge_lm.train.resilience import agree

# What [train] cpu_keep_freed_memory did on a run that is not on the CPU (forge_lm.train.cpu_memory).
_NOT_A_CPU_RUN = "not changed: not a CPU run"


@attrs.define
class Parts:
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


def choose_linear_kernel(kernel: str, device: torch.device) -> None:
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


def keep_cpu_memory(keep: bool, device: torch.device) -> str:
    """Keep freed memory in the process for a CPU run (forge_lm.train.cpu_memory); what was done."""
    if device.type != "cpu":
        return _NOT_A_CPU_RUN
    if not keep:
        return "not changed: [train] cpu_keep_freed_memory = false"
    return keep_freed_memory()


def build_parts(config: ForgeConfig, manager: PluginManager) -> Parts:
    """Join the process group (under torchrun), then build every component from the registry.
    Raises on any bad config or missing dependency; writes nothing."""
    registry = manager.registry
    launch = detect_launch()
    dims = ParallelDims.resolve(config, launch.world_size)  # checked before any process group exists
    device = rank_device(resolve_device(config.train.device), launch)
    dtype = autocast_dtype(config.train.precision, device)
    check_offload(config, device, dims)  # nothing to offload to on a CPU; under torchrun cpu_offload needs FSDP2
    choose_linear_kernel(config.train.cpu_linear_kernel, device)
    cpu_memory = keep_cpu_memory(config.train.cpu_keep_freed_memory, device)
    init_distributed(launch, device, config.distributed.timeout)
    one_rank_fsdp = fsdp_in_one_process(config, dims)  # cpu_offload on one GPU: FSDP2 over a mesh of one rank
    if one_rank_fsdp:
        init_one_rank_group(device, config.distributed.timeout)
    if config.resilience.health_check and launch.world_size > 1:  # a bad rank is named before anything is built
        health = check_health(device)
        if is_main_process():
            print(f"forge: health check passed: {health.summary()}", file=sys.stderr)
    mesh = dims.build_mesh(device.type, one_rank=one_rank_fsdp)
    check_same_plugins(manager.manifest(), manager.manifest_hash())
    dp_rank, dp_size = dp_coordinates(mesh)
    seed_everything(config.train.seed)  # every rank builds the same initial model
    tokenizer = config.tokenizer.build()
    vocab_size = model_vocab_size(config, tokenizer)  # as `forge config validate` finds it
    check_memory(config, vocab_size, registry, dims, device, dtype, agree)  # a run that cannot fit stops here
    # Under torchrun no rank holds the whole model: it is built on the meta device (no memory),
    # cut into a stage and transformed, then materialized below, each rank allocating and
    # initialising only its shards. Initial values depend on the seed and parameter names
    # alone, so every layout starts from the one-process weights (forge_lm.model.init). So is a
    # one-process run with cpu_offload: its parameters are created on the host, never whole on the GPU.
    on_meta = dims.distributed or one_rank_fsdp
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
    if on_meta:  # under cpu_offload the parameters on the host (FSDP2 wants them there), the buffers on the device
        materialize(model, parameters_device(config, device), config.train.seed)
        buffers_to(model, device)
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
    return Parts(
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


def _peak(device: torch.device, dtype: torch.dtype | None, configured: float | None, world_size: int) -> dict:
    """``peak_flops`` and ``peak_source`` of the run's devices. Measured (on CPU) by rank 0 alone:
    ranks timing matmuls at once would each see a fraction."""
    found = on_main_process(lambda: world_peak_with_source(device, dtype, configured, world_size))
    peak, source = found if found is not None else (None, None)
    return {"peak_flops": peak, "peak_source": source}
