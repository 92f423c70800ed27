"""One optimizer step of forge-optim-muon against torch.optim.Muon and torch.optim.AdamW.

The parameters are the hidden weight matrices of the default model (``ModelSection()``: 4
layers, 256 wide, SwiGLU hidden 704): the 28 matrices Muon updates (16 of 256 x 256, 8 of
704 x 256, 4 of 256 x 704). Each contender steps its own copy of them with the same
gradients; the contenders alternate round by round (after warm-up rounds) so that drifting
machine load hits them alike; medians are reported, with the ratio to torch.optim.Muon.

Contenders: torch.optim.Muon (its Newton-Schulz is always bf16, one matrix at a time); forge's
``muon`` with ``ns_dtype = "bfloat16"`` (the same numbers, batched) and ``"float32"`` (one of
them is what ``"auto"`` picks: bfloat16 on CUDA and on CPUs with bf16 matrix instructions,
float32 on other CPUs; the notes say which); torch.optim.Muon's algorithm with a float32 Newton-Schulz, one
matrix at a time (written here: torch's is fixed to bf16), which is what batching alone buys
at float32; and torch.optim.AdamW (foreach), the optimizer Muon replaces.

Numerics, from the same start and gradients: ``max_abs_diff_vs_torch`` is the largest
difference of the first step's update from torch.optim.Muon's (0 = the same numbers);
``rel_error_vs_exact`` is the relative Frobenius distance of the orthogonalised updates from
the same Newton-Schulz iteration computed in float64 (the error each one's precision costs).

Run:  .venv/bin/python benchmarks/bench_muon.py [--rounds 5] [--device cuda]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
from _record import save

from forge_lm.config import ModelSection
from forge_lm.hardware import cpu_multiplies_bf16
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager
from forge_optim_muon.factory import assign_parameters
from forge_optim_muon.optimizer import QUINTIC, Muon, newton_schulz, resolve_ns_dtype

LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.95, 0.1


class PerMatrixFloat32Muon(torch.optim.Optimizer):
    """torch.optim.Muon's step (Nesterov, original scale), one matrix at a time, with its Newton-Schulz
    operations in float32 instead of bf16: the per-matrix baseline at float32 numerics."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": LR})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        a, b, c = QUINTIC
        for p in self.param_groups[0]["params"]:
            buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            buf.lerp_(p.grad, 1 - MOMENTUM)
            x = p.grad.lerp(buf, MOMENTUM)
            tall = x.size(0) > x.size(1)
            x = x.T if tall else x
            x = x / x.norm().clamp(min=1e-7)
            for _ in range(5):
                gram = x @ x.T
                x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
            p.mul_(1 - LR * WEIGHT_DECAY)
            p.add_(x.T if tall else x, alpha=-LR * math.sqrt(max(1, p.size(0) / p.size(1))))


CONTENDERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "torch.optim.Muon (bf16 Newton-Schulz, one matrix at a time)": lambda ps: torch.optim.Muon(
        ps, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY
    ),
    "forge muon, ns_dtype=bfloat16 (batched)": lambda ps: Muon(
        ps, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, ns_dtype="bfloat16"
    ),
    "forge muon, ns_dtype=float32 (batched)": lambda ps: Muon(
        ps, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, ns_dtype="float32"
    ),
    "torch.optim.Muon's algorithm in float32, one matrix at a time": PerMatrixFloat32Muon,
    "torch.optim.AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=WEIGHT_DECAY),
}
BASELINE = next(iter(CONTENDERS))


def default_model_matrices(device: torch.device) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(ModelSection(), 257, PluginManager().registry)
    return [a.param.detach().to(device) for a in assign_parameters(model) if a.side == "muon"]


def exact_orthogonalisation(update: torch.Tensor) -> torch.Tensor:
    tall = update.shape[0] > update.shape[1]
    x = update.double().T if tall else update.double()
    out = newton_schulz(x[None])[0]
    return out.T if tall else out


def numerics(matrices: list[torch.Tensor], grads: list[torch.Tensor]) -> dict[str, tuple[float | str, float | str]]:
    """Per contender: (max |update - torch's update|, relative error of the orthogonalised update)."""
    updates = {}
    for name, make in CONTENDERS.items():
        params = [torch.nn.Parameter(m.clone()) for m in matrices]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        make(params).step()
        updates[name] = [p.detach() - m for p, m in zip(params, matrices, strict=True)]
    result: dict[str, tuple[float | str, float | str]] = {}
    for name, deltas in updates.items():
        if "AdamW" in name:
            result[name] = ("", "")  # a different algorithm: nothing to compare
            continue
        diff = max((d - b).abs().max().item() for d, b in zip(deltas, updates[BASELINE], strict=True))
        errors = []
        for delta, m, g in zip(deltas, matrices, grads, strict=True):
            # Undo the decay and the scale: what is left is the orthogonalised first update.
            scale = LR * max(1.0, m.shape[0] / m.shape[1]) ** 0.5
            ortho = -(delta + m * (LR * WEIGHT_DECAY)).double() / scale
            exact = exact_orthogonalisation((1 - MOMENTUM) * g + MOMENTUM * (1 - MOMENTUM) * g)
            errors.append((torch.linalg.norm(ortho - exact) / torch.linalg.norm(exact)).item())
        result[name] = (diff, max(errors))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    matrices = default_model_matrices(device)
    generator = torch.Generator().manual_seed(1)
    grads = [(torch.randn(m.shape, generator=generator) * 1e-3).to(device) for m in matrices]
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
            sync()
            start = time.perf_counter()
            optimizer.step()
            sync()
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
                "speedup_vs_torch_muon": baseline / median,
                "max_abs_diff_vs_torch": diff,
                "rel_error_vs_exact": error,
            }
        )
        print(f"{name:64s} median {median * 1000:9.1f} ms  {baseline / median:7.2f}x  diff {diff}")
    by_name = {row["optimizer step"]: row for row in rows}
    bf16, fp32, loop32 = (by_name[name] for name in list(CONTENDERS)[1:4])
    headline = [
        {
            "measure": f"Muon step vs torch.optim.Muon, identical bf16 numbers ({device.type})",
            "value": bf16["speedup_vs_torch_muon"],
            "meaning": f"x faster; largest update difference {bf16['max_abs_diff_vs_torch']:g}",
        },
        {
            "measure": f"Muon step vs torch.optim.Muon, float32 Newton-Schulz ({device.type})",
            "value": fp32["speedup_vs_torch_muon"],
            "meaning": (
                f"x faster; error vs exact {fp32['rel_error_vs_exact']:.1e} (torch's bf16: "
                f"{by_name[BASELINE]['rel_error_vs_exact']:.1e})"
            ),
        },
        {
            "measure": f"batched vs one matrix at a time, both float32 ({device.type})",
            "value": loop32["median_s"] / fp32["median_s"],
            "meaning": "x: what batching alone buys (launches saved; GPUs feel it, a compute-bound CPU does not)",
        },
    ]
    auto = resolve_ns_dtype("auto", device)
    auto_row = bf16 if auto == torch.bfloat16 else fp32
    units = "" if device.type != "cpu" else f" (bf16 matrix instructions: {'yes' if cpu_multiplies_bf16() else 'no'})"
    auto_sentence = f'`ns_dtype = "auto"` picks {str(auto).removeprefix("torch.")} here{units}.'
    headline.append(
        {
            "measure": f"Muon's default (ns_dtype auto: {str(auto).removeprefix('torch.')}) vs torch.optim.Muon "
            f"({device.type})",
            "value": auto_row["speedup_vs_torch_muon"],
            "meaning": 'x faster, as `[optimizer] name = "muon"` runs without options',
        }
    )
    shapes = sorted({tuple(m.shape) for m in matrices})
    save(
        "muon",
        f"python benchmarks/bench_muon.py --rounds {args.rounds} --device {device.type}",
        rows,
        headline=headline,
        notes=(
            f"One step over the default model's {len(matrices)} hidden matrices {shapes} "
            f"({sum(m.numel() for m in matrices):,} parameters) on {device.type}; medians of {args.rounds} alternating "
            f"rounds after {args.warmup} warm-up round(s). {auto_sentence} On a CPU without bf16 matmul units the "
            "bf16 matmuls are emulated and are the whole cost of a bf16 step, so batching cannot speed up the bf16 "
            "rows there, and float32 (auto's choice there) is both faster and more accurate."
        ),
    )


if __name__ == "__main__":
    main()
