"""FSDP2 (``fully_shard``): every parameter sharded over the data-parallel ranks.

Each transformer block is one FSDP unit (its parameters are gathered just before it runs and
freed after), then the root holds the rest (embedding, final norm, head). With
``dp_replicate > 1`` the mesh is 2-D and FSDP2 runs as HSDP: sharded within a group,
replicated across groups. With bf16 precision the parameters are gathered and computed in
bf16 and gradients reduced in fp32, while the sharded master weights stay fp32. With
``[distributed] cpu_offload`` every unit gets FSDP2's ``CPUOffloadPolicy``
(:mod:`forge_lm.distributed.offload`): the shards, their gradients and the optimizer state live in
host memory. A one-process run with ``cpu_offload`` runs FSDP2 too, over a mesh of its one rank.

A submodule may set ``fsdp_mesh_dims`` (a tuple of mesh dimension names) to be sharded as its
own unit over those dimensions, before its block: the MoE plugin shards expert weights, which
expert parallelism already split over ``ep``, over the remaining data-parallel ranks this way.
Gradients of every unit are divided by the number of data-parallel ranks (``dp_size``, times
``cp`` under context parallelism): each rank's loss is the mean over its own tokens, and the
step's loss is the mean over ranks (FSDP2's default for units over the whole data-parallel mesh;
set explicitly for the others).

Under context parallelism (``cp > 1``) the units span ``dp_shard_cp`` (``dp_shard x cp``): a cp
rank's gradient holds its own queries' share and, through the key/value gather's backward, what
the other ranks' queries sent back to its keys and values, so the sum over the group is the
gradient of the sum of their losses, and FSDP2's average is that of their mean.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from forge_lm.components import OwnFSDPUnit
from forge_lm.distributed.compression import build_compressor
from forge_lm.distributed.offload import fsdp_in_one_process, offload_policy
from forge_lm.distributed.transforms import ModelTransform, TransformContext, transformer_blocks

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # [distributed] reduce_dtype


def _enabled(context: TransformContext) -> bool:
    if context.dims.shard_size > 1:  # the data-parallel ranks, and under cp the ranks splitting sequences
        return True
    # cpu_offload in one process: FSDP2 over the mesh of that one rank (forge_lm.distributed.offload)
    return context.mesh is not None and fsdp_in_one_process(context.config, context.dims)


def _apply(model: nn.Module, context: TransformContext) -> None:
    dims = context.dims
    names = ("dp_replicate", "dp_shard") if dims.dp_replicate > 1 else ("dp_shard",)
    if dims.cp > 1:  # parameters are sharded over the sequence-splitting ranks too (dp_replicate = 1 then)
        names = ("dp_shard_cp",)
    compressor = build_compressor(context)  # [distributed.compression]; None unless asked for
    if compressor is not None:  # sharded over dp_shard alone: its hook reduces across the replicas
        names = ("dp_shard",)
    mesh = context.submesh(*names)
    reduce_dtype = REDUCE_DTYPES[context.config.distributed.reduce_dtype]
    low_precision = context.dtype is not None or reduce_dtype != torch.float32
    policy = MixedPrecisionPolicy(param_dtype=context.dtype, reduce_dtype=reduce_dtype) if low_precision else None
    common = {"mp_policy": policy} if policy is not None else {}
    offload = offload_policy(context)  # [distributed] cpu_offload: shards, gradients, optimizer state on the host
    if offload is not None:
        common["offload_policy"] = offload
    # Under pipeline parallelism every microbatch would gather the weights again: keep them.
    reshard = dims.pp == 1
    for module in model.modules():
        if isinstance(module, OwnFSDPUnit) and module.fsdp_mesh_dims:
            unit_mesh = context.submesh(*module.fsdp_mesh_dims)
            fully_shard(module, mesh=unit_mesh, reshard_after_forward=reshard, **common)
            module.set_gradient_divide_factor(float(dims.shard_size))
            if dist.get_backend(unit_mesh.get_group(unit_mesh.ndim - 1)) == "gloo" and unit_mesh.size(-1) > 1:
                # A divide factor other than the group size makes FSDP2 reduce with PREMUL_SUM,
                # which gloo lacks: sum, then divide. (Not on a 1-rank group, where torch 2.13
                # would divide twice.)
                module.set_force_sum_reduction_for_comms(True)
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **common)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **common)
    if compressor is not None:
        blocks = set(transformer_blocks(model))
        units = [(name, module) for name, module in model.named_modules() if module in blocks]
        compressor.install(model, [*units, ("", model)])
    # FSDP2 warns when a unit returns a view: an in-place op on that view would skip the unit's
    # pre-backward hook. A block's output (the residual stream) and the model's (the logits) are
    # only ever read out of place in Forge, so for these two units the warning is noise; other
    # units (a plugin's own, above) keep it.
    warnings.filterwarnings(
        "ignore",
        message=r"FSDP2-wrapped module \(FSDP(Block|Transformer)\) returned a view tensor",
        category=UserWarning,
    )


def fsdp2_transform(options: object) -> ModelTransform:
    """The ``fsdp2`` transform (slot ``data_parallel``): on when more than one rank reads data."""
    return ModelTransform(slot="data_parallel", enabled=_enabled, apply=_apply)
