"""Checkpoint saving: how long the training loop is blocked by a synchronous save versus an async one.

The state is the default run's after a few training steps (the default model, AdamW's moments,
the scheduler, the data position, RNG states and plugin states), saved by the training loop's
own ``forge_lm.train.run_state.save_run`` through ``CheckpointManager`` into a temporary run
directory: once with
``checkpoint.async_save = false`` (the baseline: the loop waits for every file) and once with
``true`` (the loop waits only for a copy of the tensors; a background thread writes them).
After each async save the loop's next training step runs while the write goes on, then the
write is waited for; the time that step takes, against a step with no write in flight, shows
what the background write costs the loop on this machine. The variants alternate round by
round after warm-up rounds; medians are reported.

Run:  .venv/bin/python benchmarks/bench_checkpoint.py [--rounds 7] [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from _record import alternate, median, save
from bench_train import ForgeSide

from forge_lm.checkpoint import CheckpointManager
from forge_lm.plugins import PluginSettings
from forge_lm.train.run_state import StateShapes, save_run


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds, no warm-up")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write results/checkpoint.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.warmup = 2, 0
    if args.threads:
        torch.set_num_threads(args.threads)

    workdir = Path(tempfile.mkdtemp(prefix="forge-bench-checkpoint-", dir=args.dir))
    try:
        side = ForgeSide(["--train.device=cpu", "--train.precision=fp32"], workdir / "run", PluginSettings.from_env())
        side.run(2)  # AdamW's moments exist after a step: the state a checkpoint really holds
        managers = {
            "sync": CheckpointManager(workdir / "sync", keep_last_n=2, async_save=False),
            "async": CheckpointManager(workdir / "async", keep_last_n=2, async_save=True),
        }
        loader, manager, context = side.loader, side.manager, side.context
        shapes = StateShapes(context.scheduler, loader)  # as the run holds them: every save is checked against them
        saves = {"sync": 0, "async": 0}
        extra: dict[str, list[float]] = {"async write done": [], "step during async write": []}

        def checkpoint(kind: str) -> None:
            saves[kind] += 1
            context.step = saves[kind]  # a new step_<N> each time (a save of the newest one is skipped)
            save_run(managers[kind], context, loader, manager, shapes)

        def sync_save() -> float:
            begin = time.perf_counter()
            checkpoint("sync")
            return time.perf_counter() - begin

        def async_save() -> float:
            done: list[float] = []
            begin = time.perf_counter()
            checkpoint("async")
            blocked = time.perf_counter() - begin
            # When the background write ends (the manager's pending future; the loop never asks).
            managers["async"]._pending.add_done_callback(lambda _: done.append(time.perf_counter()))
            step_start = time.perf_counter()
            side.run(1)  # the loop goes on while the write runs
            extra["step during async write"].append(time.perf_counter() - step_start)
            managers["async"].wait()
            extra["async write done"].append(done[0] - begin)
            return blocked

        def plain_step() -> float:
            begin = time.perf_counter()
            side.run(1)
            return time.perf_counter() - begin

        variants = {"sync save": sync_save, "async save": async_save, "step, no write in flight": plain_step}
        started = time.perf_counter()

        def progress(index: int) -> None:
            elapsed = time.perf_counter() - started
            print(f"  round {index + 1}/{args.warmup + args.rounds} done, {elapsed:.0f} s", flush=True)

        samples = alternate(variants, args.rounds, args.warmup, progress)
        for name, values in extra.items():
            samples[name] = values[args.warmup :]
        # What an async save costs the loop in all, round by round: the time it blocks plus what
        # the write running beside it adds to the next step.
        samples["async net cost"] = [
            blocked + during - alone
            for blocked, during, alone in zip(
                samples["async save"], samples["step during async write"], samples["step, no write in flight"],
                strict=True,
            )
        ]  # fmt: skip
        size = directory_bytes(managers["sync"].latest())
        for checkpoints in managers.values():
            checkpoints.close()
        side.close()
        parameters = sum(p.numel() for p in side.model.parameters())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    medians = {name: median(values) for name, values in samples.items()}
    sync = medians["sync save"]
    step = medians["step, no write in flight"]
    described = [  # (row, what is measured, its samples)
        ("sync save", "loop blocked: the whole write", "sync save"),
        ("async save", "loop blocked: copying the tensors, then the write is handed off", "async save"),
        ("async save", "save called until the background write is done", "async write done"),
        ("training step", "no write in flight", "step, no write in flight"),
        ("training step", "right after an async save, while it writes", "step during async write"),
        ("async save", "net cost to the loop: blocked + the next step's slowdown", "async net cost"),
    ]
    rows = []
    for what, detail, key in described:
        value = medians[key]
        rows.append(
            {
                "what": what,
                "measured": detail,
                "median_ms": value * 1000,
                "min_ms": min(samples[key]) * 1000,
                "x_sync_save": value / sync,
                "x_training_step": value / step,
            }
        )
        print(f"{what:14s} {detail:66s} {value * 1000:9.1f} ms  x{value / sync:.3f} of sync")
    notes = (
        f"The default model ({parameters / 1e6:.2f} M parameters) with AdamW state: {size / 1e6:.1f} MB per "
        f"checkpoint (DCP files plus trainer_state.json), written under {args.dir or tempfile.gettempdir()} by "
        "`forge_lm.train.run_state.save_run` as the loop calls it. Medians of "
        f"{args.rounds} alternating rounds after {args.warmup} warm-up round(s). `x_sync_save`: over the sync "
        "save's blocking time (the baseline); `x_training_step`: over one training step with no write in flight. "
        "The net cost is per round: the async save's blocking time plus the step during its write minus the "
        "step without one; the background write competes with the step for the CPU (and the GIL)."
    )
    headline = [
        {
            "measure": "loop blocked by an async checkpoint save / by a sync save (default model + AdamW)",
            "value": medians["async save"] / sync,
            "meaning": "below 1: async saving gives the loop back sooner",
        },
        {
            "measure": "async save's net cost to the loop (blocked + next step's slowdown) / sync save",
            "value": medians["async net cost"] / sync,
            "meaning": "below 1: async saving pays off on this machine",
        },
    ]
    if not args.no_save:
        command = ("python benchmarks/bench_checkpoint.py " + " ".join(sys.argv[1:])).strip()
        path = save("checkpoint", command, rows, notes, headline=headline)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
