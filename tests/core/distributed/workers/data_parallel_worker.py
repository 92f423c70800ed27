"""Run under torchrun: one training step of the loop's own code on 2 ranks against the
single-process step on the same global batch (computed in each rank, from the same weights).

Usage: data_parallel_worker.py OUT_JSON [--section.key=value ...]
Writes {"loss", "reference_loss", "grad_norm", "reference_grad_norm", "max_grad_error"} from
rank 0; exits 1 on a mismatch.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from forge_lm.config import load_config
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train.loop import _build, _train_step

BATCH, SEQ, VOCAB, ACCUM = 4, 16, 257, 2


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main() -> int:
    out, overrides = sys.argv[1], sys.argv[2:]
    manager = PluginManager(PluginSettings(autoload=False))
    base = [
        "--model.dim=32",
        "--model.n_layers=2",
        "--model.n_heads=4",
        "--model.n_kv_heads=2",
        f"--model.vocab_size={VOCAB}",
        f"--train.seq_len={SEQ}",
        f"--train.grad_accum_steps={ACCUM}",
        "--train.grad_clip=0.05",  # small enough to clip: the clipped gradients are compared
        "--eval.interval=0",
        "--data.name=synthetic",
        '--metrics.backends=["jsonl"]',
    ]
    config = load_config(None, [*base, *overrides], manager.registry)
    parts = _build(config, manager)  # joins the process group
    rank, dp_rank, dp_size = dist.get_rank(), *_dp(parts)

    reference = build_model(config.model, VOCAB, manager.registry)
    reference.load_state_dict({name: full(value) for name, value in parts.model.state_dict().items()})

    generator = torch.Generator().manual_seed(7)
    micro = [torch.randint(0, VOCAB, (BATCH * dp_size, SEQ + 1), generator=generator) for _ in range(ACCUM)]
    # The data sampler interleaves: data-parallel rank r reads rows r, r + dp_size, ...
    mine = [{"input_ids": m[dp_rank::dp_size, :-1], "labels": m[dp_rank::dp_size, 1:]} for m in micro]
    loss, grad_norm, _ = _train_step(parts, iter(mine), config)

    reference_loss = 0.0
    for m in micro:
        logits = reference(m[:, :-1])
        step_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), m[:, 1:].flatten())
        (step_loss / ACCUM).backward()
        reference_loss += step_loss.item() / ACCUM
    reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), config.train.grad_clip).item()

    expected = dict(reference.named_parameters())
    error = max((full(p.grad) - expected[name].grad).abs().max().item() for name, p in parts.model.named_parameters())
    result = {
        "loss": loss,
        "reference_loss": reference_loss,
        "grad_norm": grad_norm,
        "reference_grad_norm": reference_norm,
        "max_grad_error": error,
        "clipped": reference_norm > config.train.grad_clip,
        "sharded": all(isinstance(p, DTensor) for p in parts.model.parameters()),
    }
    ok = abs(loss - reference_loss) < 1e-5 and abs(grad_norm - reference_norm) < 1e-5 * reference_norm and error < 1e-6
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(result, handle)
    print(f"rank {rank}: {result}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


def _dp(parts) -> tuple[int, int]:
    dp = parts.mesh["dp"]
    return dp.get_local_rank(), dp.size()


if __name__ == "__main__":
    sys.exit(main())
