"""Run under torchrun: one training step of the loop's own code on 2 ranks against the
single-process step on the same global batch (computed in each rank, from the same weights),
for each of several layouts in turn, in one launch.

Usage: data_parallel_worker.py OUT_JSON CASES_JSON, CASES_JSON a JSON object of
{case name: [--section.key=value, ...]}. Each case builds its own parts (the first joins the
process group, the others find it joined), model, data and optimizer, and shows its own
warnings (the warnings registry is reset for each case, as a fresh process starts with none).
Writes from rank 0 {case: {"loss", "reference_loss", "grad_norm", "reference_grad_norm",
"max_grad_error", ..., "ok", "stderr"}}: "ok" the case's own check, "stderr" what rank 0
printed to stderr during the case. Exits 0 once every case ran; 1 if one did not finish.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from forge_lm.config import load_config
from forge_lm.distributed.launch import exit_process
from forge_lm.distributed.reduce import mean_over_data_parallel
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.train.parts import build_parts
from forge_lm.train.step import compute_gradients, gradient_sync

BATCH, SEQ, VOCAB, ACCUM = 4, 16, 257, 2


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class _Tee(io.TextIOBase):
    """Writes to a case's own record and on to the launch's stderr."""

    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def main() -> int:
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    results = {}
    for name, overrides in cases.items():
        printed = io.StringIO()
        # catch_warnings() marks the filters changed, which empties every module's registry of
        # warnings already shown: a warning this case raises is shown, as in a process of its own.
        with warnings.catch_warnings(), contextlib.redirect_stderr(_Tee(printed, sys.stderr)):
            result = run_case(overrides)
            sys.stderr.flush()
        results[name] = {**result, "stderr": printed.getvalue()}
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(results, handle)
    dist.barrier()  # no rank tears its groups down while another still uses them
    dist.destroy_process_group()
    return 0


def run_case(overrides: list[str]) -> dict:
    """One layout's step against the single-process step: the numbers, and ``ok``."""
    # Installed plugins too (forge-optim-muon's optimizer is compared below).
    manager = PluginManager(PluginSettings(allow=("muon",)))
    base = [
        *TINY_MODEL,
        f"--model.vocab_size={VOCAB}",
        f"--train.seq_len={SEQ}",
        f"--train.grad_accum_steps={ACCUM}",
        "--train.grad_clip=0.05",  # small enough to clip: the clipped gradients are compared
        "--eval.interval=0",
        "--data.name=synthetic",
        '--metrics.backends=["jsonl"]',
    ]
    config = load_config(None, [*base, *overrides], manager.registry)
    parts = build_parts(config, manager)  # joins the process group
    rank, dp_rank, dp_size = dist.get_rank(), *_dp(parts)

    reference = build_model(config.model, VOCAB, manager.registry)
    reference.load_state_dict({name: full(value) for name, value in parts.model.state_dict().items()})

    generator = torch.Generator().manual_seed(7)
    micro = [torch.randint(0, VOCAB, (BATCH * dp_size, SEQ + 1), generator=generator) for _ in range(ACCUM)]
    # The data sampler interleaves: data-parallel rank r reads rows r, r + dp_size, ...
    mine = [{"input_ids": m[dp_rank::dp_size, :-1], "labels": m[dp_rank::dp_size, 1:]} for m in micro]

    # Accumulation without redundant syncs: a micro-batch that is not the step's last leaves the
    # sharded gradients alone (FSDP2 keeps them unsharded and local until the last one).
    def backward() -> None:
        logits = parts.model(mine[0]["input_ids"])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), mine[0]["labels"].flatten()).backward()

    with gradient_sync(parts.model, enabled=False):
        backward()
    unsynced = all(p.grad is None for p in parts.model.parameters())
    backward()  # a synced backward reduces (and so releases) what was accumulated; zero_grad follows
    between: set[str] = set()  # the gradients' state before each micro-batch after the first

    def grads_state() -> str:
        grads = [p.grad for p in parts.model.parameters()]
        if all(g is None for g in grads):
            return "none"
        shards = all(
            g is not None and g.to_local().shape == p.to_local().shape
            for g, p in zip(grads, parts.model.parameters(), strict=True)
        )
        return "sharded" if shards else "other"

    def watching(batches):
        for index, batch in enumerate(batches):
            if index:
                between.add(grads_state())
            yield batch

    loss, grad_norm, _ = compute_gradients(parts, watching(mine), config)  # starts with zero_grad
    loss = mean_over_data_parallel(loss, parts.mesh, parts.dims).item()  # the step returns this rank's loss
    grad_norm = grad_norm.item()

    reference_loss = 0.0
    for m in micro:
        logits = reference(m[:, :-1])
        step_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), m[:, 1:].flatten())
        (step_loss / ACCUM).backward()
        reference_loss += step_loss.item() / ACCUM
    reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), config.train.grad_clip).item()

    expected = dict(reference.named_parameters())
    error = max((full(p.grad) - expected[name].grad).abs().max().item() for name, p in parts.model.named_parameters())

    # One optimizer step on the sharded parameters against the same optimizer in one process.
    reference_optimizer = config.optimizer.build(reference)
    before = {name: p.detach().clone() for name, p in reference.named_parameters()}
    parts.optimizer.step()
    reference_optimizer.step()
    update_error = max(
        (full(p.detach()) - expected[name].detach()).abs().max().item() for name, p in parts.model.named_parameters()
    )
    update_scale = max((expected[name].detach() - before[name]).abs().max().item() for name in before)
    bf16 = parts.dtype == torch.bfloat16
    policy = parts.model._get_fsdp_state()._mp_policy
    result = {
        "bf16": bf16,
        "fsdp_param_dtype": str(policy.param_dtype),
        "fsdp_reduce_dtype": str(policy.reduce_dtype),
        "master_dtypes": sorted({str(p.dtype) for p in parts.model.parameters()}),
        "unsynced_micro_batch": unsynced,
        # Between micro-batches of the step: each rank holds only its shard of every gradient
        # (reduced after each micro-batch), or none yet when the reduction is deferred.
        "grads_between_micro_batches": sorted(between),
        "loss": loss,
        "reference_loss": reference_loss,
        "grad_norm": grad_norm,
        "reference_grad_norm": reference_norm,
        "max_grad_error": error,
        "optimizer": type(parts.optimizer).__name__,
        "max_update_error": update_error,
        "update_scale": update_scale,
        "clipped": reference_norm > config.train.grad_clip,
        "sharded": all(isinstance(p, DTensor) for p in parts.model.parameters()),
    }
    # bf16 computes in another precision than the fp32 reference: a loose check of the same step.
    tolerance = 2e-2 if bf16 else 1e-5
    ok = (
        unsynced
        and abs(loss - reference_loss) < tolerance * max(1.0, reference_loss)
        and abs(grad_norm - reference_norm) < tolerance * reference_norm
        and error < (tolerance if bf16 else 1e-6)
        # Relative to the step's largest update: Adam's first step divides gradients near its eps by
        # themselves and Newton-Schulz amplifies rounding, so 1e-10 gradient noise shows at ~1e-3.
        # (Not compared under bf16: Adam's first step turns bf16 rounding of tiny gradients into
        # full-size updates of the other sign.)
        and (bf16 or update_error < 1e-2 * update_scale)
    )
    print(f"rank {rank}: {result}", flush=True)
    return {**result, "ok": bool(ok)}


def _dp(parts) -> tuple[int, int]:
    dp = parts.mesh["dp"]
    return dp.get_local_rank(), dp.size()


if __name__ == "__main__":
    exit_process(main())  # past gloo's destructors, which can abort at exit
