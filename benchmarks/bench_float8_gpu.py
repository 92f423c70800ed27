"""float8 training throughput on one GPU: forge-float8 against bf16 on the same model and batches.

The model is ``bench_gpu.py``'s dense one (dim 2048, 16 layers, SwiGLU hidden 5504, vocab
32768, seq 2048, batch 8, bf16 autocast, AdamW; about 0.88 B parameters): every Linear layer
but the output head has sizes that are multiples of 16, so forge-float8 converts all 112 of
them. Each side is Forge's own training step (built and stepped as in ``bench_train.py``):

- ``bf16``: the model as ``forge train`` runs it with ``precision = "bf16"``;
- ``float8 <recipe>``: the same with ``[transforms.float8] enabled = true`` and that recipe.

Both sides are compiled (``[train] compile = true``) unless ``--no-compile``: torchao's float8
training counts on ``torch.compile`` to fuse the scaling and casting around each matmul, so an
eager float8 run says little about what float8 can do. The sides alternate block by block
after warm-up (the first rounds compile); medians of tokens/s are reported with the ratio to
bf16, and each side's loss at its first step (the same initial model and batches: a large gap
would mean float8 went wrong).

Needs CUDA and a GPU with float8 matmuls (compute capability 8.9 or newer: H100, H200, L4,
L40S, RTX 4090, B200), and the forge-float8 plugin. Without CUDA the script says so and exits
with 2, recording nothing; ``--smoke-cpu`` runs the same code with a tiny model on the CPU (whose
``torch._scaled_mm`` forge-float8 uses there) to check the script; it never records.

Run:  .venv/bin/python benchmarks/bench_float8_gpu.py [--rounds 5 --steps 10] [--recipes tensorwise rowwise]
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
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
from bench_gpu import DENSE
from bench_train import ForgeSide

from forge_lm.errors import ForgeError
from forge_lm.plugins import PluginSettings

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
SMOKE = [  # --smoke-cpu: the same code path, tiny; every Linear size a multiple of 16
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.max_seq_len=64",
    "--model.vocab_size=512",
    "--train.seq_len=64",
    "--train.batch_size=2",
    "--train.precision=bf16",
]


def float8_overrides(recipe: str) -> list[str]:
    return ["--transforms.float8.enabled=true", f"--transforms.float8.recipe={recipe}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="rounds before measuring (compilation happens here)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per block")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=["tensorwise"])
    parser.add_argument("--no-compile", action="store_true", help="eager mode for every side")
    parser.add_argument("--smoke-cpu", action="store_true", help="tiny model on the CPU: checks the script, no record")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write results/float8_gpu.json")
    args = parser.parse_args()
    if not args.smoke_cpu and not torch.cuda.is_available():
        print(
            f"bench_float8_gpu.py: skipped: CUDA is not available (torch {torch.__version__}); this benchmark needs "
            "one NVIDIA GPU with float8 matmuls (H100, H200, L4, L40S, RTX 4090, B200) and records nothing "
            "without it. Run it on such a machine, or use --smoke-cpu to check the script on the CPU.",
            file=sys.stderr,
        )
        return 2
    if importlib.util.find_spec("forge_float8") is None:
        print(
            "bench_float8_gpu.py: the forge-float8 plugin is not installed: pip install forge-float8 "
            "(in this repository: pip install -e plugins/forge-float8)",
            file=sys.stderr,
        )
        return 2
    if args.smoke_cpu:
        args.rounds, args.warmup, args.steps, args.no_compile = min(args.rounds, 2), 0, 2, True
    device = torch.device("cpu" if args.smoke_cpu else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run)"
    base = [f"--train.device={device.type}", *(SMOKE if args.smoke_cpu else DENSE)]
    if not args.no_compile:
        base.append("--train.compile=true")
    sides_wanted = {"bf16": []} | {f"float8 {recipe}": float8_overrides(recipe) for recipe in args.recipes}
    settings = PluginSettings.from_env()
    workdir = Path(tempfile.mkdtemp(prefix="forge-bench-float8-"))
    sides: dict[str, ForgeSide] = {}
    try:
        for label, extra in sides_wanted.items():
            try:
                side = ForgeSide([*base, *extra], workdir / label.replace(" ", "-"), settings, "default")
            except ForgeError as exc:  # e.g. a GPU without float8 matmuls: forge-float8 refuses it
                print(f"bench_float8_gpu.py: {label}: {exc}", file=sys.stderr)
                return 2
            side.initial_model = None  # no plain loop here: drop the copy it keeps for one
            sides[label] = side
        bf16 = sides["bf16"]
        total = sum(p.numel() for p in bf16.model.parameters())
        print(
            f"{name}: {total / 1e6:.2f} M parameters, {bf16.tokens_per_step} tokens per step, "
            f"{'eager' if args.no_compile else 'compiled'}",
            flush=True,
        )
        started = time.perf_counter()

        def progress(index: int) -> None:
            print(f"  round {index + 1}/{args.warmup + args.rounds} done, {time.perf_counter() - started:.0f} s")

        variants = {label: (lambda side=side: side.run(args.steps)) for label, side in sides.items()}
        samples = alternate(variants, args.rounds, args.warmup, progress, rotate=True)
        memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        rows: list[dict[str, Any]] = []
        medians = {label: median(values) for label, values in samples.items()}
        for label, value in medians.items():
            rows.append(
                {
                    "side": label,
                    "tokens_per_s": value,
                    "x_bf16": value / medians["bf16"],
                    "first_step_loss": sides[label].first[0],
                    "compiled": not args.no_compile,
                }
            )
            print(f"  {label:28s} {value:10.0f} tok/s  x{value / medians['bf16']:.3f} of bf16", flush=True)
        for side in sides.values():
            side.close()
    finally:
        sides.clear()
        gc.collect()
        shutil.rmtree(workdir, ignore_errors=True)

    if args.smoke_cpu or args.no_save:
        print("not recorded (" + ("--smoke-cpu" if args.smoke_cpu else "--no-save") + ")")
        return 0
    notes = (
        f"One {name}. Overrides of the default config: `{' '.join(base[1:])}`; the float8 sides add "
        "`[transforms.float8] enabled = true` and their recipe (forge-float8, torchao "
        f"{importlib.metadata.version('torchao')}). Medians of {args.rounds} alternating rounds (rotated) after "
        f"{args.warmup} warm-up round(s) of {args.steps} steps each. `x_bf16`: tokens/s over the bf16 side's. "
        f"Peak GPU memory of all sides together: {memory:.1f} GiB."
    )
    first_float8 = rows[1]
    headline = [
        {
            "measure": f"{first_float8['side']} / bf16, tokens/s, ~0.9B dense, one GPU"
            + ("" if args.no_compile else ", compiled"),
            "value": first_float8["x_bf16"],
            "meaning": f"above 1: float8 trains faster ({name})",
        }
    ]
    command = ("python benchmarks/bench_float8_gpu.py " + " ".join(sys.argv[1:])).strip()
    path = save("float8_gpu", command, rows, notes, headline=headline)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    # Several models with AdamW state share the GPU: let freed blocks be reused.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())
