"""GPU training throughput and MFU: a ~1B dense model and an MoE model on one GPU, Forge against a plain loop.

The models (``[model]`` overrides of the default config; data ``python_stdlib``, byte tokens,
in a 32768-id vocabulary so the embedding and head are of a realistic size):

- dense: dim 2048, 16 layers, 16 heads, SwiGLU hidden 5504, vocab 32768 (tied): about 0.88 B
  parameters; seq 2048, batch 8 (16384 tokens per step), bf16 autocast, AdamW.
- MoE (needs the forge-moe plugin; skipped with a message when it is not installed): the same
  with ``[model.ffn] name = "moe"``, 8 experts, top-2, ``expert_multiplier = 0.5``, so a token
  passes through as many feed-forward parameters as in the dense model (about 2.5 B in all).

For each model, Forge's training step (built and stepped as in ``bench_train.py``: the
registry's components, ``_train_step``, optimizer and scheduler steps, hooks, metrics) and a
plain PyTorch loop over a copy of the same model (``torch.optim.AdamW``, ``F.cross_entropy``,
same batches as plain tensors, same precision; for MoE the routers' auxiliary losses are only
collected by Forge) alternate block by block after warm-up; for the dense model a third row
runs the plain loop without the per-document attention mask (plain causal attention, which
lets SDPA use its flash kernel), the mask's cost. Medians of tokens/s are reported,
with the ratio and MFU against Forge's table peak of the GPU (``forge_lm.metrics.mfu``) and
against the ``torch.mm`` bf16 rate measured here. ``--compile`` adds ``train.compile = true``
rows (minutes of compilation).

Needs CUDA: without it the script refuses (exit 2) and records nothing. ``--smoke-cpu`` runs
the same code with tiny models on the CPU to check the script itself; it never records.

Run:  .venv/bin/python benchmarks/bench_gpu.py [--rounds 5 --steps 10] [--no-moe] [--compile]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _record import alternate, median, save
from bench_train import ForgeSide, PlainSide

from forge_lm.errors import ConfigError
from forge_lm.metrics.mfu import gpu_peak_flops
from forge_lm.model.flops import active_parameter_count
from forge_lm.plugins import PluginSettings

DENSE = [
    "--model.dim=2048",
    "--model.n_layers=16",
    "--model.n_heads=16",
    "--model.max_seq_len=2048",
    "--model.vocab_size=32768",
    "--train.seq_len=2048",
    "--train.batch_size=8",
    "--train.precision=bf16",
]
MOE = ["--model.ffn.name=moe", "--model.ffn.n_experts=8", "--model.ffn.top_k=2", "--model.ffn.expert_multiplier=0.5"]
SMOKE = [  # --smoke-cpu: the same code path, tiny
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=2",
    "--model.max_seq_len=64",
    "--model.vocab_size=512",
    "--train.seq_len=64",
    "--train.batch_size=2",
    "--train.precision=fp32",
]


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int, iterations: int) -> float:
    """FLOP/s of ``torch.mm`` of two ``size`` x ``size`` matrices, best of 3 timings of ``iterations``."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    best = float("inf")
    for _ in range(3):
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(iterations):
            torch.mm(a, b)
        _synchronize(device)
        best = min(best, (time.perf_counter() - start) / iterations)
    return 2 * size**3 / best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_model(
    label: str,
    overrides: list[str],
    args: argparse.Namespace,
    settings: PluginSettings,
    workdir: Path,
    causal_row: bool = False,
) -> list[dict[str, Any]]:
    """Forge and the plain loop (and Forge compiled with --compile, the plain loop without the
    document mask with ``causal_row``) on one model, alternating."""
    device = torch.device("cpu" if args.smoke_cpu else "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = [f"--train.device={device.type}", *overrides]
    forge = ForgeSide(base, workdir / label, settings, "default")
    batches = forge.fresh_batches(8)
    plain = PlainSide(forge, batches)
    variants = {"forge": lambda: forge.run(args.steps), "plain": lambda: plain.run(args.steps)}
    if causal_row:  # what the per-document attention mask costs (another semantics: attends across documents)
        causal = PlainSide(forge, batches, document_mask=False)
        variants["plain causal only"] = lambda: causal.run(args.steps)
    compiled = None
    if args.compile:
        compiled = ForgeSide([*base, "--train.compile=true"], workdir / f"{label}-compile", settings, "default")
        compiled.initial_model = None
        variants["forge compile"] = lambda: compiled.run(args.steps)
    forge.initial_model = None  # the plain loop has its copy
    total = sum(p.numel() for p in forge.model.parameters())
    active = active_parameter_count(forge.model)
    print(
        f"{label}: {total / 1e6:.2f} M parameters ({active / 1e6:.2f} M active per token), "
        f"{forge.tokens_per_step} tokens per step, {forge.step_flops / 1e9:.2f} GFLOP per token",
        flush=True,
    )
    started = time.perf_counter()

    def progress(index: int) -> None:
        elapsed = time.perf_counter() - started
        print(f"  round {index + 1}/{args.warmup + args.rounds} done, {elapsed:.0f} s", flush=True)

    samples = alternate(variants, args.rounds, args.warmup, progress)
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    forge.close()
    if compiled is not None:
        compiled.close()
    medians = {name: median(values) for name, values in samples.items()}
    rows = []
    for name, value in medians.items():
        rows.append(
            {
                "model": label,
                "loop": name,
                "tokens_per_s": value,
                "x_plain": value / medians["plain"],
                "mfu_table_peak": forge.step_flops * value / forge.peak,
                "mfu_measured_peak": forge.step_flops * value / args.measured_peak,
                "params_b": total / 1e9,
                "active_params_b": active / 1e9,
                "tokens_per_step": forge.tokens_per_step,
                "peak_memory_gib": memory,
            }
        )
        print(
            f"  {name:18s} {value:10.0f} tok/s  x{value / medians['plain']:.3f} of plain  "
            f"MFU {100 * rows[-1]['mfu_table_peak']:.1f}% of table peak, "
            f"{100 * rows[-1]['mfu_measured_peak']:.1f}% of measured",
            flush=True,
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per block")
    parser.add_argument("--no-moe", action="store_true", help="only the dense model")
    parser.add_argument("--compile", action="store_true", help="add train.compile = true rows")
    parser.add_argument("--smoke-cpu", action="store_true", help="tiny models on the CPU: checks the script, no record")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write results/gpu.json")
    args = parser.parse_args()
    if not args.smoke_cpu and not torch.cuda.is_available():
        print(
            "bench_gpu.py: CUDA is not available (torch "
            f"{torch.__version__}); this benchmark needs one NVIDIA GPU and records nothing without it. "
            "Run it on a GPU machine, or use --smoke-cpu to check the script on the CPU.",
            file=sys.stderr,
        )
        return 2
    if args.smoke_cpu:
        args.rounds, args.warmup, args.steps = min(args.rounds, 2), 0, 2
    device = torch.device("cpu" if args.smoke_cpu else "cuda")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        print(f"GPU: {name}; measuring torch.mm bf16 ...", flush=True)
        peaks = {size: matmul_peak(device, torch.bfloat16, size, 20) for size in (4096, 8192)}
    else:
        name = "CPU (smoke run)"
        peaks = {size: matmul_peak(device, torch.float32, size, 2) for size in (256, 512)}
    args.measured_peak = max(peaks.values())
    for size, value in peaks.items():
        print(f"  {size:5d}: {value / 1e12:8.2f} TFLOP/s", flush=True)

    settings = PluginSettings.from_env()
    dense = SMOKE if args.smoke_cpu else DENSE
    peak_note = ""
    if device.type == "cuda":
        try:
            gpu_peak_flops(name, "bf16")
        except ConfigError:  # not in Forge's table: MFU against the measured rate instead
            dense = [*dense, f"--metrics.peak_flops={args.measured_peak}"]
            peak_note = f" {name} is not in Forge's table of peaks: `mfu_table_peak` uses the measured rate."
    models = {"dense (smoke)" if args.smoke_cpu else "dense ~0.9B": dense}
    notes_moe = ""
    if args.no_moe:
        notes_moe = " MoE left out (--no-moe)."
    elif importlib.util.find_spec("forge_moe") is None:
        notes_moe = " MoE skipped: the forge-moe plugin is not installed (pip install forge-moe)."
        print("skipping the MoE model: the forge-moe plugin is not installed (pip install forge-moe)", flush=True)
    else:
        models["MoE (smoke)" if args.smoke_cpu else "MoE 8 experts top-2"] = [*dense, *MOE]

    workdir = Path(tempfile.mkdtemp(prefix="forge-bench-gpu-"))
    try:
        rows = []
        for label, overrides in models.items():
            rows += run_model(label, overrides, args, settings, workdir, causal_row=label.startswith("dense"))
            gc.collect()  # the model's sides are gone with run_model's frame: free their memory
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    if args.smoke_cpu or args.no_save:
        print("not recorded (" + ("--smoke-cpu" if args.smoke_cpu else "--no-save") + ")")
        return 0
    notes = (
        f"One {name}. Overrides of the default config: dense `{' '.join(DENSE)}`; MoE adds `{' '.join(MOE)}`. "
        f"Medians of {args.rounds} alternating rounds after {args.warmup} warm-up round(s) of {args.steps} steps "
        "each. `x_plain`: tokens/s over the plain loop's on the same model. MFU: 6 N_active + 12 L d T FLOPs per "
        "token (`forge_lm.model.flops`) times tokens/s, over the GPU's dense bf16 peak in Forge's table "
        f"(`mfu_table_peak`) or over the best measured torch.mm bf16 rate, {args.measured_peak / 1e12:.0f} TFLOP/s "
        "(`mfu_measured_peak`)." + peak_note + notes_moe
    )
    forge_dense = next(r for r in rows if r["loop"] == "forge" and r["model"].startswith("dense"))
    headline = [
        {
            "measure": "Forge / plain loop, tokens/s, ~0.9B dense, bf16, one GPU",
            "value": forge_dense["x_plain"],
            "meaning": "1.0 = Forge costs nothing over a hand-written loop",
        },
        {
            "measure": "MFU of Forge, ~0.9B dense, bf16 (of the GPU's table peak)",
            "value": forge_dense["mfu_table_peak"],
            "meaning": name,
        },
    ]
    command = ("python benchmarks/bench_gpu.py " + " ".join(sys.argv[1:])).strip()
    path = save(
        "gpu",
        command,
        rows,
        notes,
        tables={"torch.mm bf16": [{"size": s, "tflop_per_s": v / 1e12} for s, v in peaks.items()]},
        headline=headline,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    # Two models with AdamW state take most of the GPU's memory in turn: let freed blocks be reused.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())
