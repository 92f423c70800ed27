"""Pipeline parallelism against one process, under ``torchrun`` with 2 ranks (gloo, CPU).

Usage: ``torchrun --standalone --nproc_per_node=2 pipeline_worker.py RESULT_JSON``

For each case (schedule, micro-batches, with and without ``document_ids``) every rank builds
the same tiny model from one seed, keeps a copy as the single-process reference, and pipelines
the other over ``pp = 2`` stages. Two training steps (an evaluation between them) compare the
step's loss, every parameter gradient of this rank's stage (by name, with the reference
model's) and the global gradient norm; the evaluation compares ``eval_loss``. A last case
checks that a reported auxiliary loss is refused. Rank 0 writes what every rank found to
RESULT_JSON; every rank exits 1 on any mismatch.
"""

from __future__ import annotations

import copy
import json
import sys
import time
import traceback

import torch
import torch.distributed as dist

from forge_lm.components import IGNORE_INDEX
from forge_lm.config import load_config
from forge_lm.distributed import (
    ParallelDims,
    TransformContext,
    apply_model_transforms,
    detect_launch,
    init_distributed,
    shutdown_distributed,
)
from forge_lm.distributed.grads import clip_grad_norm
from forge_lm.distributed.launch import exit_process
from forge_lm.distributed.pipeline import PipelineRunner
from forge_lm.errors import ForgeError
from forge_lm.losses.aux import collect_aux, report_aux_loss
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager

VOCAB, BATCH, SEQ = 97, 2, 16
ATOL, RTOL = 1e-6, 1e-5
CASES = [
    {"name": "gpipe-accum2", "schedule": "gpipe", "accum": 2, "documents": False},
    {"name": "gpipe-accum2-documents", "schedule": "gpipe", "accum": 2, "documents": True},
    {"name": "1f1b-accum2-documents", "schedule": "1f1b", "accum": 2, "documents": True},
    # 5 layers split 3 + 2; activation checkpointing applied to the stage's ModuleDict of blocks.
    {"name": "1f1b-accum4-5layers-checkpointed", "schedule": "1f1b", "accum": 4, "documents": False, "layers": 5},
    # bf16 autocast, which the runner applies itself: compared with the reference under autocast.
    {"name": "gpipe-accum2-documents-bf16", "schedule": "gpipe", "accum": 2, "documents": True, "bf16": True},
    # A z-loss: in the gradients, not in the returned (logged) loss.
    {"name": "1f1b-accum2-z-loss", "schedule": "1f1b", "accum": 2, "documents": False, "z_loss": 0.05},
]


def overrides(case: dict) -> list[str]:
    return [
        "--model.dim=64",
        f"--model.n_layers={case.get('layers', 4)}",
        "--model.n_heads=4",
        "--model.tie_embeddings=false",
        f"--train.seq_len={SEQ}",
        f"--train.batch_size={BATCH}",
        f"--train.grad_accum_steps={case['accum']}",
        "--train.device=cpu",
        "--distributed.pp=2",
        f"--distributed.pp_schedule={case['schedule']}",
        *(["--train.activation_checkpointing=full"] if "checkpointed" in case["name"] else []),
        *([f"--loss.z_loss_weight={case['z_loss']}"] if "z_loss" in case else []),
    ]


def make_batch(generator: torch.Generator, documents: bool) -> dict[str, torch.Tensor]:
    batch = {
        "input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
        "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
    }
    # Some ignored labels: the per-micro-batch mean then differs from the mean over the step.
    batch["labels"][torch.rand(BATCH, SEQ, generator=generator) < 0.15] = IGNORE_INDEX
    if documents:  # packed documents: ids rise along each row
        batch["document_ids"] = torch.cumsum(torch.rand(BATCH, SEQ, generator=generator) < 0.25, dim=1)
    return batch


def autocast(dtype: torch.dtype | None) -> torch.autocast:
    return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


def reference_step(
    model: torch.nn.Module, loss_fn, micro_batches: list[dict[str, torch.Tensor]], dtype: torch.dtype | None
) -> float:
    """The single-process loop's step: mean over micro-batches, ``(loss / accum).backward()``."""
    total = 0.0
    for batch in micro_batches:
        with autocast(dtype), collect_aux() as aux:
            loss = loss_fn(model(batch["input_ids"], batch.get("document_ids")), batch["labels"])
        (loss / len(micro_batches)).backward()
        total += aux.data_loss(loss).item()  # the logged loss: without the z-loss term
    return total / len(micro_batches)


def run_case(case: dict, manager: PluginManager, mesh, pp_group, rank: int) -> dict:
    registry = manager.registry
    config = load_config(None, overrides(case), registry)
    dims = ParallelDims.resolve(config, dist.get_world_size())
    assert (dims.pp, dims.dp_shard) == (2, 1), dims
    device = torch.device("cpu")
    dtype = torch.bfloat16 if case.get("bf16") else None
    torch.manual_seed(config.train.seed)
    model = build_model(config.model, VOCAB, registry)
    reference = copy.deepcopy(model)
    runner = PipelineRunner(model, dims, mesh, device, dtype, case["accum"])
    applied = apply_model_transforms(runner.module, TransformContext(config, dims, mesh, device, dtype), registry)
    loss_fn = config.loss.build()
    runner.finish(loss_fn)

    reference_params = dict(reference.named_parameters())
    names = [name for name, _ in runner.module.named_parameters()]
    result: dict = {
        "rank": rank,
        "transforms": applied,
        "names": names,
        "full_model_names": list(reference_params),
        "problems": [],
        "steps": [],
    }
    problems = result["problems"]
    unknown = [name for name in names if name not in reference_params]
    if unknown:
        problems.append(f"parameters not in the full model: {unknown}")

    generator = torch.Generator().manual_seed(1000 + CASES.index(case))
    for step in range(2):
        micro_batches = [make_batch(generator, case["documents"]) for _ in range(case["accum"])]
        runner.module.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        loss = runner.train_step(micro_batches)
        reference_loss = reference_step(reference, loss_fn, micro_batches, dtype)
        expected = reference_loss if runner.is_last else 0.0
        record = {"step": step, "loss": loss, "reference_loss": reference_loss}
        if abs(loss - expected) > 1e-5 * max(1.0, abs(expected)):
            problems.append(f"step {step}: loss {loss} != {expected}")
        worst = 0.0
        for name, param in runner.module.named_parameters():
            want = reference_params[name].grad
            if param.grad is None:
                problems.append(f"step {step}: {name} has no gradient")
                continue
            worst = max(worst, (param.grad - want).abs().max().item())
            if not torch.allclose(param.grad, want, atol=ATOL, rtol=RTOL):
                problems.append(f"step {step}: gradient of {name} differs by {(param.grad - want).abs().max().item()}")
        record["grad_max_diff"] = worst
        norm = clip_grad_norm(runner.module.parameters(), 0.0, pp_group)
        reference_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
        record["grad_norm"], record["reference_grad_norm"] = norm, reference_norm
        if abs(norm - reference_norm) > 1e-5 * reference_norm:
            problems.append(f"step {step}: gradient norm {norm} != {reference_norm}")
        if step == 0:  # evaluation between the two steps: the training schedule must go on afterwards
            batch = make_batch(generator, case["documents"])
            with torch.no_grad(), autocast(dtype):  # as the Evaluator calls it
                eval_loss = runner.eval_loss(batch)
                reference_eval = loss_fn(reference(batch["input_ids"], batch.get("document_ids")), batch["labels"])
            expected = reference_eval.item() if runner.is_last else 0.0
            record["eval_loss"], record["reference_eval_loss"] = eval_loss, reference_eval.item()
            if abs(eval_loss - expected) > 1e-5 * max(1.0, abs(expected)):
                problems.append(f"eval loss {eval_loss} != {expected}")
        result["steps"].append(record)
    return result


def run_aux_case(manager: PluginManager, mesh, rank: int) -> dict:
    """A module that reports an auxiliary loss: the step must raise a ForgeError on every stage."""
    registry = manager.registry
    case = {"name": "aux", "schedule": "gpipe", "accum": 2, "documents": False}
    config = load_config(None, overrides(case), registry)
    dims = ParallelDims.resolve(config, dist.get_world_size())
    torch.manual_seed(0)
    runner = PipelineRunner(build_model(config.model, VOCAB, registry), dims, mesh, torch.device("cpu"), None, 2)
    runner.finish(config.loss.build())
    for block in runner.module.layers.values():
        block.feed_forward.register_forward_hook(lambda module, args, out: report_aux_loss("balance", out.sum()))
    generator = torch.Generator().manual_seed(7)
    try:
        runner.train_step([make_batch(generator, False) for _ in range(2)])
    except ForgeError as error:
        return {"rank": rank, "error": str(error), "problems": []}
    return {"rank": rank, "error": None, "problems": ["no ForgeError for a reported auxiliary loss"]}


def main() -> int:
    out_path = sys.argv[1]
    start = time.perf_counter()
    launch = detect_launch()
    init_distributed(launch, torch.device("cpu"))
    rank = dist.get_rank()
    manager = PluginManager()
    first = load_config(None, overrides(CASES[0]), manager.registry)
    dims = ParallelDims.resolve(first, launch.world_size)
    mesh = dims.build_mesh("cpu")
    pp_group = mesh["pp"].get_group()
    results: dict = {}
    for case in CASES:
        try:
            results[case["name"]] = run_case(case, manager, mesh, pp_group, rank)
        except Exception:  # noqa: BLE001 - recorded, so the other cases (and ranks) still report
            results[case["name"]] = {"rank": rank, "problems": [traceback.format_exc()]}
    try:
        results["aux"] = run_aux_case(manager, mesh, rank)
    except Exception:  # noqa: BLE001 - recorded likewise
        results["aux"] = {"rank": rank, "problems": [traceback.format_exc()]}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    for case in CASES:  # the stages hold every parameter of the full model, each exactly once
        per_rank = [ranks[case["name"]] for ranks in gathered]
        if all("names" in result for result in per_rank):
            held = [name for result in per_rank for name in result["names"]]
            if sorted(held) != sorted(per_rank[0]["full_model_names"]):
                results[case["name"]]["problems"].append(f"the stages hold {sorted(held)}, not the full model's")
    ok = all(not result["problems"] for per_rank in gathered for result in per_rank.values())
    ok = ok and all(not result["problems"] for result in results.values())
    if rank == 0:
        summary = {
            "ok": ok,
            "seconds": time.perf_counter() - start,
            "cases": {name: [per_rank[name] for per_rank in gathered] for name in results},
        }
        with open(out_path, "w") as f:
            json.dump(summary, f, indent=1)
    shutdown_distributed(wait_for_all=True)  # no rank tears down while another still finishes
    return 0 if ok else 1


if __name__ == "__main__":
    exit_process(main())  # past gloo's destructors, which can abort at exit
