"""Expert parallelism: each MoE layer's experts split across the ``ep`` ranks, tokens exchanged
with all-to-all.

Layout. With ``[distributed] ep = P`` the core's mesh splits ``dp_shard`` into ``efsdp x ep``;
the ``P`` ranks of an ``ep`` group are data-parallel ranks (each reads its own slice of the
global batch) that also split the experts: rank ``r`` of the group owns experts
``[r * E / P, (r + 1) * E / P)``. The stacked expert weights become DTensors ``Shard(0)`` on
the ``ep`` mesh (a checkpoint stores the whole ``[E, ...]`` tensor and loads into any ``ep``;
the core's gradient clipping groups them by mesh). The router and the shared experts stay
ordinary replicated parameters. The experts module is marked ``fsdp_mesh_dims`` = the
data-parallel dimensions left (``efsdp``, with ``dp_replicate`` under HSDP): FSDP2 shards and
reduces it over those ranks only, dividing its gradient by the number of data-parallel ranks.

Forward of one MoE layer on one rank: route the rank's own tokens, apply the capacity rule,
sort the kept (token, expert) assignments by expert (so they are grouped by owner), exchange
the per-expert counts (one small all-to-all), send the token rows to the experts' owners
(all-to-all with uneven splits), regroup the received rows by local expert, run the local
experts with the grouped kernel, send the results back (the inverse all-to-all) and combine
them with the routing weights. Both all-to-alls are differentiable: the backward of one is
the other with the splits swapped. The gradient of a local expert therefore sums the
contributions of every rank's tokens, as the single-process gradient sums over the whole
batch; the ``1 / dp`` of the mean over ranks is FSDP2's divide factor.

Capacity is per rank: each rank applies ``C = ceil(capacity_factor * its tokens * top_k / E)``
to its own assignments before sending them (first choices first, then its token order), the
rule a single process applies to that rank's micro-batch, and the one data parallelism without
EP applies too; an expert then receives at most ``P * C`` rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from forge_lm.api import ModelTransform, TransformContext, model_options
from forge_lm.errors import ConfigError
from forge_moe.options import MoEOptions
from forge_moe.plugin import check_expert_parallel

# -- the token exchange -------------------------------------------------------------------------
# Functional collectives (``_c10d_functional.all_to_all_single``) rather than
# ``dist.all_to_all_single``: selective activation checkpointing keeps their outputs
# (forge_lm.distributed.activation_checkpointing), so backward does not exchange the tokens a
# second time, and torch.compile can trace them.


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0 with uneven splits: rows
    ``x[sum(input_splits[:j]) : ...]`` go to rank ``j``; rank ``j``'s rows for this rank arrive in
    block ``j`` of the output (``output_splits[j]`` rows). Backward: the same exchange of the
    gradient with the splits swapped."""
    return funcol.all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group)


class ExpertParallel:
    """One MoE layer's place in its ``ep`` group: the group, its size, this rank's index."""

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def __repr__(self) -> str:
        return f"ExpertParallel(size={self.size}, rank={self.rank})"

    def run(
        self,
        experts: nn.Module,
        rows: torch.Tensor,
        counts: torch.Tensor,
        kernel: str,
        capacity_limit: int | None,
    ) -> torch.Tensor:
        """The experts' outputs for this rank's ``rows`` (``[M, dim]``, sorted by global expert,
        ``counts[e]`` rows for expert ``e``), computed by the experts' owners; ``[M, dim]``."""
        size = self.size
        local = counts.numel() // size
        # counts[j * local + e]: rows for rank j's local expert e; after the exchange,
        # received[j * local + e]: rows from rank j for this rank's local expert e.
        received = funcol.all_to_all_single(counts.contiguous(), None, None, self.group)  # even splits
        send = counts.view(size, local).sum(1)
        recv = received.view(size, local)
        # The layer's one host sync, and an inherent one: the row exchange below needs its split
        # sizes as Python integers (NCCL and gloo size their buffers from them before sending).
        splits = torch.cat([send, recv.sum(1)]).tolist()
        send_splits, recv_splits = splits[:size], splits[size:]
        inbound = all_to_all(rows, recv_splits, send_splits, self.group)  # blocks: source rank, then expert
        # Regroup by local expert (sources in rank order within an expert) for the grouped kernel.
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=rows.device).repeat(size), recv.reshape(-1), output_size=inbound.shape[0]
        )
        order = torch.argsort(expert_of_row, stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        pad_to = None if capacity_limit is None else capacity_limit * size
        outbound = experts(inbound[order], recv.sum(0), kernel, pad_to)[inverse]
        return all_to_all(outbound, send_splits, recv_splits, self.group)


# -- the transforms -----------------------------------------------------------------------------


def _moe_layers(model: nn.Module) -> list[nn.Module]:
    from forge_moe.layer import MoELayer

    return [module for module in model.modules() if isinstance(module, MoELayer)]


def _is_moe(context: TransformContext) -> bool:
    ffn = getattr(model_options(context.config), "ffn", None)
    return ffn is not None and isinstance(ffn.options, MoEOptions)


def shard_experts(experts: nn.Module, ep_mesh: Any) -> None:
    """Replace the stacked weights of ``experts`` by this rank's slice, as DTensors ``Shard(0)``
    on ``ep_mesh``, without communication. In the training loop the weights are still on the
    meta device: the slice is a shape, and materializing the model later fills it with this
    rank's experts of the one-process model (``GroupedExperts.init_weights``). Weights built
    with values (the same on every rank, from one seed) keep their values."""
    from torch.distributed.tensor import DTensor, Shard

    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name in ("w1", "w3", "w2"):
        full = getattr(experts, name)
        local = full.shape[0] // size
        shard = full.detach()[rank * local : (rank + 1) * local].clone()
        dtensor = DTensor.from_local(
            shard, ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
        setattr(experts, name, nn.Parameter(dtensor, requires_grad=full.requires_grad))


def _apply_expert_parallel(model: nn.Module, context: TransformContext) -> None:
    check_expert_parallel(context.config)
    dims = context.dims
    if dims.tp > 1:
        raise ConfigError(
            "[distributed] ep > 1 together with tp > 1 is not supported yet (the MoE layer would need the "
            "sequence-parallel input gathered first); set tp = 1 or ep = 1."
        )
    if context.config.train.activation_checkpointing == "selective":
        raise ConfigError(
            "[train] activation_checkpointing = 'selective' with [distributed] ep > 1 fails in backward: the "
            "experts' own FSDP2 unit runs different profiler operations when the block is replayed, which "
            "torch's selective checkpointing refuses. Use activation_checkpointing = 'full' (or 'none')."
        )
    ep_mesh = context.submesh("ep")
    parallel = ExpertParallel(ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank())
    # The data-parallel ranks that hold the same experts: FSDP2 shards and reduces them there.
    fsdp_dims = ("dp_replicate", "efsdp") if dims.dp_replicate > 1 else ("efsdp",)
    for layer in _moe_layers(model):  # a pipeline stage may hold none
        shard_experts(layer.experts, ep_mesh)
        layer.experts.fsdp_mesh_dims = fsdp_dims
        layer.expert_parallel = parallel


def expert_parallel_transform(options: object) -> ModelTransform:
    """The ``expert_parallel`` transform: on when ``[distributed] ep > 1``."""
    return ModelTransform(
        slot="model_parallel", enabled=lambda context: context.dims.ep > 1, apply=_apply_expert_parallel
    )


def _apply_load_sync(model: nn.Module, context: TransformContext) -> None:
    group = context.submesh("dp").get_group()
    for layer in _moe_layers(model):
        layer.load_group = group


def load_sync_transform(options: object) -> ModelTransform:
    """The ``moe_load_sync`` transform (slot ``model_parallel``), on with more than one
    data-parallel rank: a router's pending expert load (the sigmoid router's balancing rule) is
    summed over the data-parallel ranks before its update, so every rank moves its bias from the
    global batch's load, as one process would, and the biases stay identical."""
    return ModelTransform(
        slot="model_parallel",
        enabled=lambda context: context.dims.dp_size > 1 and _is_moe(context),
        apply=_apply_load_sync,
    )
