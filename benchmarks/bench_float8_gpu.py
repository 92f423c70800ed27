"""float8 training throughput on one GPU: forge-float8 against bf16 on the same model and batches.

The model is ``bench_gpu.py``'s dense one (dim 2048, 16 layers, SwiGLU hidden 5504, vocab
32768, seq 2048, batch 8, bf16 autocast, AdamW; about 0.88 B parameters): every Linear layer
but the output head has sizes that are multiples of 16, so forge-float8 converts all 112 of
them. Each side is Forge's own training step (built and stepped as in ``bench_train.py``):

- ``bf16``: the model as ``forge train`` runs it with ``precision = "bf16"``;
- ``float8 <recipe>``: the same with ``[transforms.float8] enabled = true`` and that recipe.

Both sides are compiled (``[train] compile = true``) unless ``--no-compile``: torchao's float8
training counts on ``torch.compile`` to fuse the scaling and casting around each matmul, so an
eager float8 run says little about what float8 can do. The sides are built, measured and freed
in turn (``_gpu_common.measure_in_turn``: one model and its AdamW state resident at a time), each
running ``--warmup`` rounds (the first compiles) then ``--rounds`` timed rounds of ``--steps``
steps; medians of tokens/s are reported with the ratio to bf16, each side's peak memory
(``torch.cuda.max_memory_allocated`` from its build to its end) and its loss at its first step
(the same initial model and batches: a large gap would mean float8 went wrong). ``--output DIR``
writes ``DIR/float8_gpu.json`` and ``DIR/float8_gpu.md``, rewritten after every side.

Needs CUDA and a GPU with float8 matmuls (compute capability 8.9 or newer: H100, H200, L4,
L40S, RTX 4090, B200), and the forge-float8 plugin. Without CUDA the script says so and exits
with 2, recording nothing; ``--smoke`` runs the same code with a tiny model on the CPU (whose
``torch._scaled_mm`` forge-float8 uses there) to check the script; it never writes ``results/``.

Run:  .venv/bin/python benchmarks/bench_float8_gpu.py --output DIR [--rounds 5] [--recipes tensorwise rowwise]
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _gpu_common import SideResult, measure_in_turn, publish, refuse_without_cuda
from _record import make_record
from bench_gpu import DENSE
from bench_train import ForgeSide

from forge_lm.plugins import PluginSettings

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
SMOKE = [  # --smoke: the same code path, tiny; every Linear size a multiple of 16
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.max_seq_len=64",
    "--model.vocab_size=512",
    "--train.seq_len=64",
    "--train.batch_size=2",
    "--train.precision=bf16",
]
FLOAT8_CAPABILITY = (8, 9)  # Ada and Hopper onwards have float8 tensor cores


def float8_overrides(recipe: str) -> list[str]:
    return ["--transforms.float8.enabled=true", f"--transforms.float8.recipe={recipe}"]


def side_builders(overrides: dict[str, list[str]], settings: PluginSettings, workdir: Path) -> dict[str, Callable]:
    """Forge's training step for each side's overrides, as builders for ``measure_in_turn``."""

    def builder(label: str, side_overrides: list[str]) -> Callable[[], ForgeSide]:
        def build_side() -> ForgeSide:
            side = ForgeSide(side_overrides, workdir / label.replace(" ", "-"), settings)
            side.initial_model = None  # no plain loop here: drop the copy it keeps for one
            return side

        return build_side

    return {label: builder(label, side_overrides) for label, side_overrides in overrides.items()}


def rows_for(results: dict[str, SideResult], compiled: bool) -> list[dict[str, Any]]:
    bf16 = results.get("bf16")
    base = bf16.tokens_per_s if bf16 else None
    rows = []
    for label, result in results.items():
        rate = result.tokens_per_s
        row: dict[str, Any] = {
            "side": label,
            "tokens_per_s": rate,
            "x_bf16": rate / base if rate and base else None,
            "first_step_loss": result.first_step_loss,
            "peak_memory_gib": result.peak_memory_gib,
            "build_s": result.build_s,
            "compiled": compiled,
        }
        if result.error:
            row["error"] = result.error
        rows.append(row)
    return rows


def _write_partial(output: Path, record: dict[str, Any], compiled: bool, results: dict[str, SideResult]) -> None:
    publish({**record, "rows": rows_for(results, compiled)}, output, save_results=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="rounds before measuring (compilation happens here)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per round")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=["tensorwise"])
    parser.add_argument("--no-compile", action="store_true", help="eager mode for every side")
    parser.add_argument(
        "--output", type=Path, metavar="DIR", help="write float8_gpu.json and .md here (after every side)"
    )
    parser.add_argument(
        "--smoke", "--smoke-cpu", action="store_true", help="tiny model on the CPU: checks the script in seconds"
    )
    parser.add_argument(
        "--no-save", action="store_true", help="do not write results/float8_gpu.json (--output still is)"
    )
    args = parser.parse_args(argv)
    needs = "one NVIDIA GPU with float8 matmuls (H100, H200, L4, L40S, RTX 4090, B200)"
    if not args.smoke and (refused := refuse_without_cuda("bench_float8_gpu.py", needs)) is not None:
        return refused
    if importlib.util.find_spec("forge_float8") is None:
        print(
            "bench_float8_gpu.py: the forge-float8 plugin is not installed: pip install forge-float8 "
            "(in this repository: pip install -e plugins/forge-float8)",
            file=sys.stderr,
        )
        return 2
    if args.smoke:
        args.rounds, args.warmup, args.steps, args.no_compile = min(args.rounds, 2), 0, 2, True
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FLOAT8_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        print(
            f"bench_float8_gpu.py: {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no "
            "float8 matmuls; run this benchmark on a GPU of compute capability 8.9 or newer (H100, H200, L4, L40S, "
            "RTX 4090, B200).",
            file=sys.stderr,
        )
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run)"
    base = [f"--train.device={device.type}", *(SMOKE if args.smoke else DENSE)]
    if not args.no_compile:
        base.append("--train.compile=true")
    sides = {"bf16": base} | {f"float8 {recipe}": [*base, *float8_overrides(recipe)] for recipe in args.recipes}
    print(f"{name}: sides {', '.join(sides)}, {'eager' if args.no_compile else 'compiled'}", flush=True)

    command = ("python benchmarks/bench_float8_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    notes = (
        f"One {name}. Overrides of the default config: `{' '.join(base[1:])}`; the float8 sides add "
        "`[transforms.float8] enabled = true` and their recipe (forge-float8, torchao "
        f"{importlib.metadata.version('torchao')}). Each side built, measured and freed in turn: medians of "
        f"{args.rounds} rounds after {args.warmup} warm-up round(s) of {args.steps} steps. `x_bf16`: tokens/s "
        "over the bf16 side's. `peak_memory_gib`: torch.cuda.max_memory_allocated from the side's build to its "
        "end (null on a CPU)."
    )
    compiled = not args.no_compile
    # After every side, what is measured so far goes to --output: a session cut short keeps it.
    partial_record = make_record("float8_gpu", command, [], notes + " (partial)")
    write = functools.partial(_write_partial, args.output, partial_record, compiled)
    workdir = Path(tempfile.mkdtemp(prefix="forge-bench-float8-"))
    try:
        results = measure_in_turn(
            side_builders(sides, PluginSettings.from_env(), workdir),
            rounds=args.rounds,
            warmup=args.warmup,
            steps=args.steps,
            device=device,
            after_each=write if args.output is not None else None,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    rows = rows_for(results, compiled)
    for row in rows:
        rate = f"{row['tokens_per_s']:10.0f} tok/s" if row["tokens_per_s"] else "    failed"
        ratio = f"x{row['x_bf16']:.3f} of bf16" if row["x_bf16"] else ""
        print(f"  {row['side']:28s} {rate}  {ratio}", flush=True)
    first_float8 = rows[1]
    headline = None
    if first_float8["x_bf16"] is not None:
        headline = [
            {
                "measure": f"{first_float8['side']} / bf16, tokens/s, ~0.9B dense, one GPU"
                + ("" if args.no_compile else ", compiled"),
                "value": first_float8["x_bf16"],
                "meaning": f"above 1: float8 trains faster ({name})",
            }
        ]
    record = make_record("float8_gpu", command, rows, notes, headline=headline)
    save_results = not (args.smoke or args.no_save)
    for path in publish(record, args.output, save_results=save_results):
        print(f"wrote {path}")
    if not save_results:
        print("not recorded in results/ (" + ("--smoke" if args.smoke else "--no-save") + ")")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    # One side at a time takes most of the GPU's memory: let the next reuse freed blocks.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())
