"""One optimizer step of forge-optim-muon against torch.optim.Muon and torch.optim.AdamW.

The parameters are the hidden weight matrices of the default model (``ModelSection()``: 4
layers, 256 wide, SwiGLU hidden 704): the 28 matrices Muon updates (16 of 256 x 256, 8 of
704 x 256, 4 of 256 x 704). Each contender steps its own copy of them with the same
gradients; the contenders alternate round by round (after warm-up rounds) so that drifting
machine load hits them alike; medians are reported, with the ratio to torch.optim.Muon.

Numerics, from the same start and gradients: ``max_abs_diff_vs_torch`` is the largest
difference of the first step's update from torch.optim.Muon's (0 = the same numbers);
``rel_error_vs_exact`` is the relative Frobenius distance of the orthogonalised updates from
the same Newton-Schulz iteration computed in float64 (the error each one's precision costs).

Run:  .venv/bin/python benchmarks/bench_muon.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _record import save

from forge_lm.config import ModelSection
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager
from forge_optim_muon.optimizer import Muon, newton_schulz
from forge_optim_muon.roles import assign_parameters

LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.95, 0.1

CONTENDERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "torch.optim.Muon (bf16 Newton-Schulz, one matrix at a time)": lambda ps: torch.optim.Muon(
        ps, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY
    ),
    "forge muon, ns_dtype=bfloat16 (batched)": lambda ps: Muon(
        ps, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, ns_dtype="bfloat16"
    ),
    "forge muon, ns_dtype=float32 (batched; auto on CPU)": lambda ps: Muon(
        ps, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, ns_dtype="float32"
    ),
    "torch.optim.AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=WEIGHT_DECAY),
}
BASELINE = next(iter(CONTENDERS))


def default_model_matrices() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(ModelSection(), 257, PluginManager().registry)
    return [a.param.detach().clone() for a in assign_parameters(model) if a.side == "muon"]


def exact_orthogonalisation(update: torch.Tensor) -> torch.Tensor:
    tall = update.shape[0] > update.shape[1]
    x = update.double().T if tall else update.double()
    out = newton_schulz(x[None])[0]
    return out.T if tall else out


def numerics(matrices: list[torch.Tensor], grads: list[torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Per contender: (max |update - torch's update|, relative error of the orthogonalised update)."""
    updates = {}
    for name, make in CONTENDERS.items():
        params = [torch.nn.Parameter(m.clone()) for m in matrices]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        make(params).step()
        updates[name] = [p.detach() - m for p, m in zip(params, matrices, strict=True)]
    result = {}
    for name, deltas in updates.items():
        diff = max((d - b).abs().max().item() for d, b in zip(deltas, updates[BASELINE], strict=True))
        if "AdamW" in name:
            result[name] = (float("nan"), float("nan"))
            continue
        errors = []
        for delta, m, g in zip(deltas, matrices, grads, strict=True):
            # Undo the decay and the scale: what is left is the orthogonalised first update.
            rows, cols = m.shape
            scale = LR * max(1.0, rows / cols) ** 0.5
            ortho = -(delta + m * (LR * WEIGHT_DECAY)).double() / scale
            exact = exact_orthogonalisation((1 - MOMENTUM) * g + MOMENTUM * (1 - MOMENTUM) * g)
            errors.append((torch.linalg.norm(ortho - exact) / torch.linalg.norm(exact)).item())
        result[name] = (diff, max(errors))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()

    matrices = default_model_matrices()
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(m.shape, generator=generator) * 1e-3 for m in matrices]
    checks = numerics(matrices, grads)

    optimizers = {}
    for name, make in CONTENDERS.items():
        params = [torch.nn.Parameter(m.clone()) for m in matrices]
        optimizers[name] = (params, make(params))
    samples: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for round_index in range(args.warmup + args.rounds):
        for name, (params, optimizer) in optimizers.items():
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            start = time.perf_counter()
            optimizer.step()
            elapsed = time.perf_counter() - start
            if round_index >= args.warmup:
                samples[name].append(elapsed)

    baseline = statistics.median(samples[BASELINE])
    rows = []
    for name, values in samples.items():
        median = statistics.median(values)
        diff, error = checks[name]
        rows.append(
            {
                "optimizer step": name,
                "median_s": median,
                "min_s": min(values),
                "x_torch_muon": median / baseline,
                "speedup_vs_torch_muon": baseline / median,
                "max_abs_diff_vs_torch": diff,
                "rel_error_vs_exact": error,
            }
        )
        print(f"{name:56s} median {median * 1000:9.1f} ms  {baseline / median:6.2f}x faster  diff {diff:.2e}")
    shapes = sorted({tuple(m.shape) for m in matrices})
    save(
        "muon",
        f"python benchmarks/bench_muon.py --rounds {args.rounds}",
        rows,
        notes=(
            f"One step over the default model's {len(matrices)} hidden matrices {shapes} "
            f"({sum(m.numel() for m in matrices):,} parameters); medians of {args.rounds} alternating rounds after "
            f"{args.warmup} warm-up round(s). torch {torch.__version__}, {torch.get_num_threads()} threads."
        ),
    )


if __name__ == "__main__":
    main()
