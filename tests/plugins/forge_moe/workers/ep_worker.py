"""Run under ``torchrun``: expert parallelism (ep = 2; with 2 ranks dp_shard = 2 and FSDP2 runs
too, the experts' FSDP unit over a 1-rank ``efsdp``) against one process on the same global batch.

For each case, every rank builds the same tiny MoE model from one seed and keeps an untouched
copy (the single-process reference); the copy runs the whole global batch of 4 sequences, the
transformed model runs rows ``[2r, 2r + 2)`` on rank ``r`` (``[r, r + 1)`` with 4 ranks). One
forward and backward each, in training mode, the loss the mean cross-entropy over the tokens
(auxiliary losses are not collected). Rank 0 writes the largest differences to ``argv[1]``
(JSON); the test checks them.

Cases: ``softmax`` (grouped_mm kernel, a shared expert, capacity factor E / top_k so nothing
drops); ``sigmoid`` (padded kernel, the balancing bias updated after the step from the load
summed over the ranks); ``dropping`` (capacity factor 1: tokens are dropped, per rank, so the
reference is one process running each rank's rows as its own micro-batch, gradients averaged);
``checkpointed`` (the default kernel, every block recomputed in backward, exchanges included);
``loop`` (the training loop's own step, see :func:`run_loop_case`).

Usage: ep_worker.py OUT_JSON [--section.key=value ...] (extra overrides for every case).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from forge_lm.config import load_config
from forge_lm.distributed import (
    ParallelDims,
    TransformContext,
    apply_model_transforms,
    detect_launch,
    init_distributed,
)
from forge_lm.distributed.grads import clip_grad_norm
from forge_lm.distributed.launch import exit_process
from forge_lm.distributed.reduce import mean_over_data_parallel
from forge_lm.losses.aux import collect_aux
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train.parts import build_parts
from forge_lm.train.step import compute_gradients
from forge_moe.layer import MoELayer, after_optimizer_step

VOCAB, BATCH, SEQ, N_EXPERTS, TOP_K = 257, 4, 16, 4, 2  # 257: the default tokenizer's (the loop case)
BASE = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    f"--model.max_seq_len={SEQ}",
    f"--train.seq_len={SEQ}",
    "--model.ffn.name=moe",
    f"--model.ffn.n_experts={N_EXPERTS}",
    f"--model.ffn.top_k={TOP_K}",
    "--model.ffn.expert_multiplier=0.5",
    "--distributed.ep=2",
]
CASES = {
    "softmax": [
        "--model.ffn.n_shared_experts=1",
        f"--model.ffn.capacity_factor={N_EXPERTS / TOP_K}",  # C = tokens: an expert takes each token at most once
        "--model.ffn.expert_kernel=grouped_mm",
    ],
    "sigmoid": [
        "--model.ffn.router.name=sigmoid_topk",
        "--model.ffn.router.bias_update_rate=0.125",
        f"--model.ffn.capacity_factor={N_EXPERTS / TOP_K}",
        "--model.ffn.expert_kernel=padded",
    ],
    "dropping": ["--model.ffn.capacity_factor=1.0", "--model.ffn.expert_kernel=loop"],
    "checkpointed": ["--train.activation_checkpointing=full"],  # the all-to-alls run again in backward
}


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def run_case(name: str, manager: PluginManager, mesh, rank: int, checkpoint_dir: str, extra: list[str]) -> dict:
    config = load_config(None, BASE + CASES[name] + extra, manager.registry)
    manager.configure(config)
    dims = ParallelDims.resolve(config, dist.get_world_size())
    torch.manual_seed(0)
    model = build_model(config.model, VOCAB, manager.registry).train()
    reference = build_model(config.model, VOCAB, manager.registry).train()
    reference.load_state_dict(model.state_dict())
    context = TransformContext(config, dims, mesh, torch.device("cpu"), None)
    applied = apply_model_transforms(model, context, manager.registry)

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    world = dist.get_world_size()
    per_rank = BATCH // world
    slices = [slice(r * per_rank, (r + 1) * per_rank) for r in range(world)]

    def loss_of(module, row_slice):
        return F.cross_entropy(module(ids[row_slice]).flatten(0, 1), labels[row_slice].flatten())

    with collect_aux() as aux:  # for the routing statistics; the auxiliary losses are left out
        loss = loss_of(model, slices[rank])
    loss.backward()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    global_loss /= world
    if name == "dropping":  # capacity is per rank: one process running each rank's rows alone
        ref_loss = sum(loss_of(reference, rows) for rows in slices) / world
    else:
        ref_loss = loss_of(reference, slice(0, BATCH))
    ref_loss.backward()

    dropped = torch.tensor([aux.metrics[f"moe/layer{i}/drop_fraction"] for i in range(config.model.options.n_layers)])
    dist.all_reduce(dropped)
    result = {"applied": applied, "loss": global_loss.item(), "ref_loss": ref_loss.item()}
    result["drop_fraction"] = (dropped / world).tolist()
    result["loss_diff"] = abs(result["loss"] - result["ref_loss"])
    grads, expert_ratio = {}, {}
    ref_params = dict(reference.named_parameters())
    for param_name, param in model.named_parameters():
        grad, ref_grad = full(param.grad), ref_params[param_name].grad
        grads[param_name] = max_diff(grad, ref_grad)
        if ".experts." in param_name:
            expert_ratio[param_name] = (grad.norm() / ref_grad.norm()).item()
    result["grad_diff"] = grads
    result["grad_scale"] = max(ref.grad.abs().max().item() for ref in ref_params.values())
    result["expert_grad_norm_ratio"] = expert_ratio
    result["grad_norm"] = clip_grad_norm(model.parameters(), 0)  # forge's cross-mesh norm
    result["ref_grad_norm"] = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    experts = layers[0].experts
    result["expert_layout"] = {
        "dtensor": isinstance(experts.w1, DTensor),
        "mesh_dims": list(experts.w1.device_mesh.mesh_dim_names) if isinstance(experts.w1, DTensor) else None,
        "local_experts": experts.w1.to_local().shape[0] if isinstance(experts.w1, DTensor) else None,
        "fsdp_unit": type(experts).__name__,
    }

    if name == "sigmoid":
        local = [m.router.pending_load.clone() for m in layers]
        after_optimizer_step(model)
        after_optimizer_step(reference)
        ref_layers = [m for m in reference.modules() if isinstance(m, MoELayer)]
        biases = [m.router.expert_bias for m in layers]
        result["bias"] = [b.tolist() for b in biases]
        result["ref_bias"] = [m.router.expert_bias.tolist() for m in ref_layers]
        # What a rank would have done from its own load only: must differ somewhere, or this
        # case could not tell the summed load from the local one.
        rate = config.model.options.ffn.options.router.options.bias_update_rate
        result["local_only_bias_differs"] = any(
            not torch.equal(rate * torch.sign(load.mean() - load), b) for load, b in zip(local, biases, strict=True)
        )
        gathered = [torch.zeros_like(biases[0]) for _ in range(world)]
        dist.all_gather(gathered, biases[0])
        result["bias_same_on_ranks"] = all(torch.equal(g, gathered[0]) for g in gathered)

    # The checkpoint layout: DCP from the ep=2 (+FSDP2) model, loaded back into one process's
    # plain state dict, gives the original full tensors (experts included).
    if name == "softmax":
        dcp.save(get_model_state_dict(model), checkpoint_id=checkpoint_dir)
        if rank == 0:
            state = {k: torch.zeros_like(v) for k, v in reference.state_dict().items()}
            dcp.load(state, checkpoint_id=checkpoint_dir, no_dist=True)
            result["checkpoint_diff"] = max(max_diff(v, reference.state_dict()[k]) for k, v in state.items())
        dist.barrier()
    return result


def run_loop_case(manager: PluginManager, extra: list[str]) -> dict:
    """The training loop's own step (``build_parts`` + ``compute_gradients``: interleaved rows, gradient
    accumulation with the sync skipped on the first micro-batch, the router's z-loss added to the
    loss, the global gradient norm) against one process's step on the same global batch; then
    forge's clipping of those gradients against ``clip_grad_norm_`` of the reference's."""
    accum, per_rank, clip = 2, 2, 0.05
    overrides = [
        *BASE,
        "--model.ffn.n_shared_experts=1",
        "--model.ffn.router.balance_loss_weight=0",  # a product of batch means: not a mean over ranks
        "--model.ffn.router.z_loss_weight=0.01",  # a mean over tokens: equal to the mean over ranks
        f"--model.vocab_size={VOCAB}",
        f"--train.batch_size={per_rank}",
        f"--train.grad_accum_steps={accum}",
        "--train.grad_clip=0",  # measure the norm only; clipping is checked below
        "--eval.interval=0",
        "--data.name=synthetic",
        '--metrics.backends=["jsonl"]',
        *extra,
    ]
    config = load_config(None, overrides, manager.registry)
    parts = build_parts(config, manager)
    dp = parts.mesh["dp"]
    dp_rank, dp_size = dp.get_local_rank(), dp.size()
    reference = build_model(config.model, VOCAB, manager.registry).train()
    reference.load_state_dict({name: full(value) for name, value in parts.model.state_dict().items()})

    generator = torch.Generator().manual_seed(7)
    micro = [torch.randint(0, VOCAB, (per_rank * dp_size, SEQ + 1), generator=generator) for _ in range(accum)]
    # The data sampler interleaves: data-parallel rank r reads rows r, r + dp_size, ...
    mine = [{"input_ids": m[dp_rank::dp_size, :-1], "labels": m[dp_rank::dp_size, 1:]} for m in micro]
    loss, grad_norm, reports = compute_gradients(parts, iter(mine), config)
    loss = mean_over_data_parallel(loss, parts.mesh, parts.dims).item()  # the step returns this rank's loss
    grad_norm, logged = grad_norm.item(), reports.logged()

    ref_loss = 0.0
    for m in micro:
        with collect_aux() as aux:
            step_loss = F.cross_entropy(reference(m[:, :-1]).flatten(0, 1), m[:, 1:].flatten())
            ((step_loss + aux.total()) / accum).backward()
        ref_loss += step_loss.item() / accum
    ref_params = dict(reference.named_parameters())
    params = dict(parts.model.named_parameters())

    def grad_diff() -> dict[str, float]:
        return {name: max_diff(full(p.grad), ref_params[name].grad) for name, p in params.items()}

    result = {
        "loss": loss,
        "ref_loss": ref_loss,
        "grad_norm": grad_norm,
        "ref_grad_norm": torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item(),
        "z_loss_logged": "moe/layer0/z_loss" in logged,
        "grad_diff": grad_diff(),
        "grad_scale": max(p.grad.abs().max().item() for p in ref_params.values()),
    }
    torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
    try:  # every rank fails alike (after the norm's collectives), so the launch goes on
        clip_grad_norm(parts.model.parameters(), clip)
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["clip_error"] = f"{type(error).__name__}: {error}"
    else:
        result["clipped_grad_diff"] = grad_diff()
        result["clipped_scale"] = max(p.grad.abs().max().item() for p in ref_params.values())
    return result


def main() -> None:
    out, extra = sys.argv[1], sys.argv[2:]  # extra: more overrides, e.g. --distributed.dp_replicate=2
    launch = detect_launch()
    init_distributed(launch, torch.device("cpu"))
    rank = dist.get_rank()
    manager = PluginManager(PluginSettings(allow=("moe",)))
    config = load_config(None, BASE + extra, manager.registry)
    mesh = ParallelDims.resolve(config, launch.world_size).build_mesh("cpu")
    checkpoint_dir = str(Path(out).parent / "ep_checkpoint")  # beside the results: one machine, every rank
    results = {name: run_case(name, manager, mesh, rank, checkpoint_dir, extra) for name in CASES}
    results["loop"] = run_loop_case(manager, extra)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()  # no rank tears its groups down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)  # past gloo's destructors, which can abort at exit
