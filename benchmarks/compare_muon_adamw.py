"""Loss against step for Muon and AdamW, each at the best learning rate of a small sweep.

Short ``forge_lm.train.train`` runs of a small model on the default data (Python's standard
library, byte tokens), identical except for the optimizer: AdamW at three learning rates,
then Muon at three learning rates (its AdamW fallback, for the embedding and norms, at the
best AdamW rate). The best run of each is the one with the lowest held-out loss at the end.
Writes ``results/muon_vs_adamw.json`` (a table of every run, plus every loss curve) and
``results/muon_vs_adamw.png``; ``RESULTS.md`` is regenerated.

Losses do not depend on the machine's load (each run is seeded); wall times do, so they are
printed but not recorded. On 2 otherwise idle CPU cores a run takes about 30 seconds.

Run:  .venv/bin/python benchmarks/compare_muon_adamw.py [--steps 150]   (about 3 minutes on 2 idle CPU cores)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from _record import RESULTS, save

from forge_lm.config import load_config
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager
from forge_lm.train import train

MODEL = ["--model.dim=128", "--model.n_layers=4", "--model.n_heads=4", "--model.max_seq_len=128"]
ADAMW_LRS = [1e-3, 3e-3, 1e-2]
MUON_LRS = [0.02, 0.05, 0.1]


def run(optimizer: list[str], steps: int, manager: PluginManager, scratch: Path) -> dict[str, Any]:
    out = scratch / f"run{len(list(scratch.iterdir()))}"
    overrides = [
        *MODEL,
        f"--train.max_steps={steps}",
        "--train.batch_size=16",
        "--train.seq_len=128",
        f"--train.output_dir={out}",
        "--scheduler.name=cosine",
        f"--scheduler.warmup_steps={steps // 10}",
        f"--eval.interval={steps}",
        "--eval.steps=8",
        "--metrics.log_interval=1",
        '--metrics.backends=["jsonl"]',
        *optimizer,
    ]
    config = load_config(None, overrides, manager.registry)
    start = time.perf_counter()
    train(config, manager)
    seconds = time.perf_counter() - start
    records = read_metrics(out / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    eval_loss = [r["eval/loss"] for r in records if "eval/loss" in r][-1]
    return {"losses": losses, "eval_loss": eval_loss, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    manager = PluginManager()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for lr in ADAMW_LRS:
            result = run(["--optimizer.name=adamw", f"--optimizer.lr={lr}"], args.steps, manager, Path(scratch))
            runs.append({"optimizer": "adamw", "lr": lr, **result})
            print(f"adamw lr {lr:g}: eval loss {result['eval_loss']:.4f} ({result['seconds']:.0f} s)", flush=True)
        adamw_best = min((r for r in runs if r["optimizer"] == "adamw"), key=lambda r: r["eval_loss"])
        for lr in MUON_LRS:
            muon = ["--optimizer.name=muon", f"--optimizer.lr={lr}", f"--optimizer.adamw_lr={adamw_best['lr']}"]
            result = run(muon, args.steps, manager, Path(scratch))
            runs.append({"optimizer": "muon", "lr": lr, "adamw_lr": adamw_best["lr"], **result})
            print(f"muon lr {lr:g}: eval loss {result['eval_loss']:.4f} ({result['seconds']:.0f} s)", flush=True)
    best = {
        name: min((r for r in runs if r["optimizer"] == name), key=lambda r: r["eval_loss"])
        for name in ("adamw", "muon")
    }

    rows = [
        {
            "optimizer": r["optimizer"],
            "lr": r["lr"],
            "fallback_lr": r.get("adamw_lr", ""),
            "best": "yes" if r is best[r["optimizer"]] else "",
            "eval_loss": r["eval_loss"],
            "train_loss_last10": sum(r["losses"][-10:]) / 10,
        }
        for r in runs
    ]
    muon_best, adamw_best = best["muon"], best["adamw"]
    notes = (
        f"{args.steps} steps of a 4-layer, 128-wide model (batch 16 x 128 byte tokens, cosine schedule, "
        f"{args.steps // 10} warmup steps) on the python_stdlib data; eval loss over 8 held-out batches at the end. "
        f"Best Muon (lr {muon_best['lr']:g}) {muon_best['eval_loss']:.4f} vs best AdamW (lr {adamw_best['lr']:g}) "
        f"{adamw_best['eval_loss']:.4f}."
    )
    command = f"python benchmarks/compare_muon_adamw.py --steps {args.steps}"
    headline = [
        {
            "measure": f"held-out loss, best Muon vs best AdamW ({args.steps}-step sweeps)",
            "value": adamw_best["eval_loss"] - muon_best["eval_loss"],
            "meaning": f"lower with Muon ({muon_best['eval_loss']:.3f} vs {adamw_best['eval_loss']:.3f})",
        }
    ]
    path = save("muon_vs_adamw", command, rows, notes=notes, headline=headline)
    record = json.loads(path.read_text())
    record["curves"] = [{"optimizer": r["optimizer"], "lr": r["lr"], "loss": r["losses"]} for r in runs]
    path.write_text(json.dumps(record, indent=2) + "\n")
    plot(runs, best, RESULTS / "muon_vs_adamw.png", args.steps)
    print(notes)


def plot(runs: list[dict[str, Any]], best: dict[str, dict[str, Any]], path: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"adamw": "tab:blue", "muon": "tab:red"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        chosen = r is best[r["optimizer"]]
        smoothed = _smooth(r["losses"], 9)
        label = f"{r['optimizer']} lr {r['lr']:g}" + (f" (eval {r['eval_loss']:.3f})" if chosen else "")
        ax.plot(
            range(1, len(smoothed) + 1),
            smoothed,
            color=colors[r["optimizer"]],
            alpha=1.0 if chosen else 0.3,
            linewidth=2.0 if chosen else 1.0,
            label=label,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (moving average of 9 steps)")
    ax.set_title(f"Muon vs AdamW: 4x128 model, {steps} steps, python_stdlib bytes")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _smooth(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


if __name__ == "__main__":
    main()
