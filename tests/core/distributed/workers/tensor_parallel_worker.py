"""Run under torchrun by tests/core/distributed/test_tensor_parallel.py: a tensor-parallel model
(and FSDP2 when there are data-parallel ranks) against the same model in one process.

    torchrun --nproc_per_node=N tensor_parallel_worker.py RESULT.json CASES_JSON

``CASES_JSON``: a JSON object of {case name: [--vocab V] [--stages] [config overrides...]}; the
cases run in turn in one launch (the first joins the process group, the others find it joined),
each with its own config, mesh, models and optimizers.
Every rank builds the same initial model (same seed) twice: one copy goes through Forge's model
transforms, the other stays whole as the reference, which runs the global batch (every
data-parallel rank's slice). Four training steps, causal then with packed documents
(``document_ids``), an SGD update after each: the first two with the full logits and
``F.cross_entropy``, as evaluation and any loss outside the training step see them; the last
two as the training loop computes its loss, with the registry's ``cross_entropy`` inside
``loss_parallel_for`` (loss parallelism), recording what reaches the loss (under tp a DTensor
split over the vocabulary, never the full logits). Each step compares this rank's loss and
logits with the reference's on the same rows, every parameter's gradient (gathered with
``full_tensor()``) with the reference's, and the global gradient norm. Then a sequence that
tp does not divide must be refused. Rank 0 writes each case's largest differences to
RESULT.json ({case: report}), with the failures found (``failures``, ``any_rank_failed``);
every rank exits 0 once every case ran.

``--stages``: the transformed model is split into two pipeline stages that run one after the
other in each process (no schedule), to check the hidden state passed between them.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from forge_lm.config import load_config
from forge_lm.distributed import (
    ParallelDims,
    TransformContext,
    apply_model_transforms,
    detect_launch,
    dp_coordinates,
    init_distributed,
)
from forge_lm.distributed.grads import clip_grad_norm
from forge_lm.distributed.launch import exit_process
from forge_lm.distributed.tensor_parallel import loss_parallel_for
from forge_lm.errors import ForgeError
from forge_lm.losses.vocab_parallel import VocabParallelLoss
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager

BATCH = 4  # global batch: split over the data-parallel ranks
ATOL, RTOL = 1e-5, 1e-4  # fp32; the model's values are O(1), gradients O(1e-2)
LR = 0.5


def batch(step: int, vocab: int, seq: int, documents: bool) -> tuple[torch.Tensor, ...]:
    """The global batch of ``step``: ids, labels, and document ids (or None), the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (BATCH, seq), generator=g)
    labels = torch.randint(0, vocab, (BATCH, seq), generator=g)
    if not documents:
        return ids, labels, None
    starts = torch.rand(BATCH, seq, generator=g) < 0.25  # a new document starts with probability 1/4
    starts[:, 0] = True
    return ids, labels, starts.long().cumsum(1)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest ``|got - want|`` beyond the tolerance ``ATOL + RTOL * |want|`` (0 when within)."""
    excess = (got.detach().float() - want.detach().float()).abs() - (ATOL + RTOL * want.detach().float().abs())
    return max(excess.max().item(), 0.0)


def max_abs(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.detach().float() - want.detach().float()).abs().max().item()


def two_stages(model: nn.Module) -> list[nn.Module]:
    """Copies of ``model`` as the two stages of a pipeline (layout of forge_lm.distributed.pipeline:
    the other stage's parts set to None, ``layers`` a ModuleDict keyed by global block index), to
    run one after the other in this process: what tensor parallelism does at the boundary."""
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    half = len(model.layers) // 2
    first.layers = nn.ModuleDict({str(i): first.layers[i] for i in range(half)})
    first.norm = first.output = None
    second.layers = nn.ModuleDict({str(i): second.layers[i] for i in range(half, len(model.layers))})
    second.tok_embeddings = None
    return [first, second]


def recording(loss_fn: VocabParallelLoss, seen: list[dict]) -> VocabParallelLoss:
    """``loss_fn`` (still declaring loss parallelism), noting what each call's logits are."""

    def record(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seen.append(
            {
                "type": type(logits).__name__,
                "placements": str(logits.placements) if isinstance(logits, DTensor) else None,
                "shape": list(logits.shape),
                "local_shape": list(logits.to_local().shape if isinstance(logits, DTensor) else logits.shape),
            }
        )
        return loss_fn.loss_fn(logits, labels)

    return VocabParallelLoss(record)


def main() -> int:
    result, cases = sys.argv[1], json.loads(sys.argv[2])
    reports = {name: run_case(argv) for name, argv in cases.items()}
    if dist.get_rank() == 0:
        with open(result, "w") as f:
            json.dump(reports, f, indent=1)
    dist.barrier()  # no rank tears its groups down while another still uses them
    dist.destroy_process_group()
    return 0


def run_case(argv: list[str]) -> dict:
    """One case: the tensor-parallel model against the one-process model; its report."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=301)
    parser.add_argument("--stages", action="store_true", help="split the model into two pipeline stages")
    args, overrides = parser.parse_known_args(argv)

    manager = PluginManager(entry_points=False)  # built-in components only: nothing installed interferes
    config = load_config(None, overrides, manager.registry)
    launch = detect_launch()
    device = torch.device("cpu")
    init_distributed(launch, device)
    dims = ParallelDims.resolve(config, launch.world_size)
    mesh = dims.build_mesh("cpu")
    dp_rank, dp_size = dp_coordinates(mesh)
    rows = slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size)

    torch.manual_seed(0)
    model = build_model(config.model, args.vocab, manager.registry)
    reference = build_model(config.model, args.vocab, manager.registry)
    reference.load_state_dict(model.state_dict())
    tied = model.tied
    parts = two_stages(model) if args.stages else [model]
    context = TransformContext(config, dims, mesh, device, None)
    applied = [apply_model_transforms(part, context, manager.registry) for part in parts]
    parameters = [(name, p) for part in parts for name, p in part.named_parameters()]

    def forward(ids: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
        out = ids
        for part in parts:
            out = part(out, document_ids)
        return out

    report = {
        "applied": applied[0],  # the same for every stage
        "dims": dims.describe(),
        "stages": len(parts),
        "vocab": args.vocab,
        "tied_before": tied,
        "tied_after": not args.stages and model.output.weight is model.tok_embeddings.weight,
        "same_names": [name for name, _ in parameters] == [name for name, _ in reference.named_parameters()],
        "all_dtensor": all(isinstance(p, DTensor) for _, p in parameters),
        "placements": {n: str(p.placements) for n, p in parameters if isinstance(p, DTensor)},
        "steps": [],
    }
    optimizer = torch.optim.SGD([p for _, p in parameters], lr=LR)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    seq = config.train.seq_len
    train_loss = config.loss.build()  # cross_entropy, as the loop builds it
    for step, (documents, in_loop) in enumerate(((False, False), (True, False), (False, True), (True, True))):
        ids, labels, document_ids = batch(step, args.vocab, seq, documents)
        local_docs = document_ids[rows] if document_ids is not None else None
        seen: list[dict] = []
        if in_loop:  # the training loop's way (forge_lm.train.step.compute_gradients)
            loss_fn = recording(train_loss, seen)
            with loss_parallel_for(dims.tp, loss_fn):
                logits = forward(ids[rows], local_docs)
                loss = loss_fn(logits, labels[rows])
                loss.backward()
        else:
            logits = forward(ids[rows], local_docs)
            loss = F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten())
            loss.backward()
        norm = clip_grad_norm([p for _, p in parameters], 0)

        ref_logits = reference(ids, document_ids)
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
        ref_loss.backward()
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
        ref_local_loss = F.cross_entropy(ref_logits[rows].flatten(0, 1), labels[rows].flatten())

        missing = [n for n, p in parameters if p.grad is None]
        reference_params = dict(reference.named_parameters())
        grads = {
            n: (full(p.grad), reference_params[n].grad)
            for n, p in parameters
            if p.grad is not None and n in reference_params
        }
        found = {
            "documents": documents,
            "in_loop": in_loop,
            "loss_inputs": seen,
            "loss_type": type(loss).__name__,
            "loss": [loss.item(), ref_local_loss.item()],
            "loss_excess": difference(loss, ref_local_loss),
            "logits_type": type(logits).__name__,
            "logits_excess": difference(full(logits), ref_logits[rows]),
            "logits_max_abs": max_abs(full(logits), ref_logits[rows]),
            "grad_excess": {n: difference(got, want) for n, (got, want) in grads.items()},
            "grad_max_abs": max(max_abs(got, want) for got, want in grads.values()),
            "grad_max": max(want.abs().max().item() for _, want in grads.values()),
            "norm": [norm, ref_norm],
            "norm_excess": difference(torch.tensor(norm), torch.tensor(ref_norm)),
            "missing_grads": missing,
        }
        report["steps"].append(found)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference_optimizer.zero_grad(set_to_none=True)

    try:  # sequence parallelism needs a length tp divides: refused before any collective runs
        forward(ids[:, : seq - 1], None)
        report["short_sequence_error"] = None
    except ForgeError as error:
        report["short_sequence_error"] = str(error)

    failures = [key for key in ("same_names", "all_dtensor") if not report[key]]
    if report["tied_after"] != tied:
        failures.append("tied_after")
    if dims.tp > 1 and report["short_sequence_error"] is None:
        failures.append("a sequence that tp does not divide was not refused")
    for found in report["steps"]:
        where = ("documents" if found["documents"] else "causal") + (" in the loop's way" if found["in_loop"] else "")
        failures += [f"{where}: {key}" for key in ("loss_excess", "logits_excess", "norm_excess") if found[key] > 0]
        failures += [f"{where}: grad {n}" for n, excess in found["grad_excess"].items() if excess > 0]
        failures += [f"{where}: no grad {n}" for n in found["missing_grads"]]
        split = found["in_loop"] and dims.tp > 1  # loss parallelism: the logits stay split
        if found["logits_type"] != ("DTensor" if split else "Tensor"):
            failures.append(f"{where}: logits are a {found['logits_type']} (loss parallelism: {split})")
        if found["loss_type"] != "Tensor":
            failures.append(f"{where}: the loss is a {found['loss_type']}, not a plain Tensor")
    # Every rank checks its own rows; the ranks agree on the outcome.
    flag = torch.tensor([float(bool(failures))])
    dist.all_reduce(flag)
    report["failures"] = failures
    report["any_rank_failed"] = bool(flag.item())
    if failures:
        print(f"rank {dist.get_rank()}: mismatch: {failures}", file=sys.stderr)
    return report


if __name__ == "__main__":
    exit_process(main())  # past gloo's destructors, which can abort at exit
