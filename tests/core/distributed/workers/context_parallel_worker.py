"""Run under torchrun: one training step of the loop's own code with context parallelism
against the single-process step on the same batch (computed in each rank, from the same weights).

Usage: context_parallel_worker.py OUT_JSON CASES_JSON, CASES_JSON a JSON object of
{case name: [--documents] [--section.key=value ...]}, run in turn in one launch, each with its
own parts (the first joins the process group, the others find it joined), model and batch.
``--documents`` gives the batch packed documents (``document_ids``), whose masks must cross the
ranks' slices. Writes {case: {"loss", "reference_loss", "grad_norm", "reference_grad_norm",
"max_grad_error", ..., "ok"}} from rank 0, "ok" the case's own check; exits 0 once every case ran.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from forge_lm.config import load_config
from forge_lm.distributed.launch import exit_process
from forge_lm.distributed.reduce import agree_on_step
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.train.parts import build_parts
from forge_lm.train.step import compute_gradients

BATCH, SEQ, VOCAB, ACCUM = 2, 16, 257, 2


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main() -> int:
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    results = {name: run_case(rest) for name, rest in cases.items()}
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(results, handle)
    dist.barrier()  # no rank tears its groups down while another still uses them
    dist.destroy_process_group()
    return 0


def run_case(rest: list[str]) -> dict:
    """One case's step against the single-process step: the numbers, and ``ok``."""
    documents = "--documents" in rest
    overrides = [arg for arg in rest if arg != "--documents"]
    manager = PluginManager(PluginSettings(autoload=False))
    base = [
        *TINY_MODEL,
        f"--model.vocab_size={VOCAB}",
        f"--train.seq_len={SEQ}",
        f"--train.batch_size={BATCH}",
        f"--train.grad_accum_steps={ACCUM}",
        "--train.grad_clip=0.05",  # small enough to clip: the clipped gradients are compared
        "--eval.interval=0",
        "--data.name=synthetic",
        '--metrics.backends=["jsonl"]',
    ]
    config = load_config(None, [*base, *overrides], manager.registry)
    parts = build_parts(config, manager)  # joins the process group
    rank = dist.get_rank()
    cp = parts.context_parallel
    dp = parts.mesh["dp"]
    dp_rank, dp_size = dp.get_local_rank(), dp.size()

    reference = build_model(config.model, VOCAB, manager.registry)
    reference.load_state_dict({name: full(value) for name, value in parts.model.state_dict().items()})

    generator = torch.Generator().manual_seed(7)
    micro = []
    for _ in range(ACCUM):
        tokens = torch.randint(0, VOCAB, (BATCH * dp_size, SEQ + 1), generator=generator)
        batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
        if documents:  # boundaries inside the ranks' chunks, and rows with one document
            ids = torch.zeros(BATCH * dp_size, SEQ, dtype=torch.long)
            ids[::2, 3:] = 1
            ids[::2, 11:] = 2
            batch["document_ids"] = ids
        micro.append(batch)
    # Data-parallel rank r reads rows r, r + dp_size, ...; the ranks of a context-parallel group
    # read the same rows, whole, and the step takes each one's slice of them.
    mine = [{key: value[dp_rank::dp_size] for key, value in batch.items()} for batch in micro]

    loss, grad_norm, _ = compute_gradients(parts, iter(mine), config)
    agreement = agree_on_step(loss, grad_norm, False, parts.dims)  # the loop's own mean
    step_loss, finite = agreement.loss, agreement.finite
    loss, grad_norm = step_loss.item(), grad_norm.item()

    reference_loss = 0.0
    for batch in micro:
        logits = reference(batch["input_ids"], batch.get("document_ids"))
        one = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        (one / ACCUM).backward()
        reference_loss += one.item() / ACCUM
    reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), config.train.grad_clip).item()

    expected = dict(reference.named_parameters())
    errors = {
        name: (full(p.grad) - expected[name].grad).abs().max().item() for name, p in parts.model.named_parameters()
    }
    result = {
        "cp": cp.size if cp is not None else 1,
        "cp_rank": cp.rank if cp is not None else 0,
        "dp_size": dp_size,
        "finite": finite,
        "loss": loss,
        "reference_loss": reference_loss,
        "grad_norm": grad_norm,
        "reference_grad_norm": reference_norm,
        "max_grad_error": max(errors.values()),
        "worst_parameter": max(errors, key=errors.get),
        "parameters_compared": len(errors),
        "clipped": reference_norm > config.train.grad_clip,
        "sharded": all(isinstance(p, DTensor) for p in parts.model.parameters()),
        "shard_mesh": list(next(iter(parts.model.parameters())).device_mesh.mesh_dim_names or ()),
    }
    ok = (
        abs(loss - reference_loss) < 1e-4
        and abs(grad_norm - reference_norm) < 1e-4 * max(1.0, reference_norm)
        and result["max_grad_error"] < 1e-4
    )
    print(f"rank {rank}: {result}", flush=True)
    return {**result, "ok": bool(ok)}


if __name__ == "__main__":
    exit_process(main())  # past gloo's destructors, which can abort at exit
