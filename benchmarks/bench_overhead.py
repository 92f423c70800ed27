"""Forge's fixed cost per training step, part by part: what the loop does that a plain loop does not.

``forge_lm.train.train()`` (the loop as ``forge train`` runs it: guards, hooks, the host sync,
the watchdog's beat, metrics every step to the console and jsonl backends) trains a micro model
(``bench_train.MICRO``: one block of width 16, 16 tokens a step) whose forward and backward cost
next to nothing, so a step's time is the loop's own work. A timer is put around each part the
loop calls once a step (the functions are wrapped where the loop looks them up; each wrapper
adds well under a microsecond), and each part's median time per step is recorded, with the
whole step's (one ``Run.step`` start to the next) and its remainder: the loop body's own lines.

Baseline: the plain loop of ``bench_train.py`` on the same model and batches (``torch.optim.AdamW``
fused as Forge's, ``F.cross_entropy``, ``clip_grad_norm_``, batches pre-stacked), its median
step time measured in the same process, alternating runs with Forge's. Forge's fixed cost is
the difference; as a share of a real model's step it is the framework's overhead there (the
default model's step takes about 400 ms on the 2-core machines, the tiny model's about 80 ms).

A second measure takes what a micro model leaves out (work per sample in the loader, per
parameter in the clipping): Forge's whole loop against the plain loop on the tiny model and the
default one (``bench_train.TINY``, and no overrides), both on the plain loop's kernels
(``bench_train.PLAIN_KERNELS``), with their steps paired. A plugin's ``forge_lm_step_end`` runs
one step of the plain loop, timed, inside each of ``train()``'s steps, so the two alternate
step by step and a machine that slows down for a while slows both. Forge's own step is its
period less the plain step inside it, and the overhead is the median over the steps of Forge's
step less the plain step next to it: as a share of the plain step, the framework's overhead at
that size (the issue 35 target is at most 1%).

Run:  .venv/bin/python benchmarks/bench_overhead.py [--steps 300 --rounds 5] [--pairs 120] [--no-save]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import itertools
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _record import median, save
from bench_train import MICRO, PLAIN_KERNELS, TINY, ForgeSide, PlainSide, quiet

import forge_lm
from forge_lm.config import load_config
from forge_lm.metrics.memory import MemoryMetrics
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train import loop, run, step
from forge_lm.train.guards import SchedulerGuard
from forge_lm.train.watchdog import HangWatchdog

# (part, module or class, attribute, shared with the plain loop): what the loop calls once per step.
PARTS: list[tuple[str, Any, str, bool]] = [
    ("forward, loss, backward and clipping (compute_gradients)", run, "compute_gradients", True),
    ("  the next batch from the loader (its checks included)", None, "next batch", False),
    ("  gradient norm and clipping (clip_grads)", step, "clip_grads", True),
    ("the host sync: loss and finiteness agreed (agree_on_step)", run, "agree_on_step", True),
    ("the optimizer's step (AdamW, fused)", None, "optimizer.step", True),
    ("the scheduler's step (the plain loop has no schedule)", None, "scheduler.step", False),
    ("staged unfreezing check (follow_schedule)", run, "follow_schedule", False),
    ("learning-rate guard (check_rates)", SchedulerGuard, "check_rates", False),
    ("the watchdog's progress mark (HangWatchdog.beat)", HangWatchdog, "beat", False),
    ("step_end hooks and plugin metrics (collect_metrics)", PluginManager, "collect_metrics", False),
    ("memory metrics (MemoryMetrics.read)", MemoryMetrics, "read", False),
    ("metrics backends: console and jsonl (Run.log)", run.Run, "log", False),
]


class Timers:
    """Seconds spent in each wrapped part, per step (a step starts at each ``Run.step`` call)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.starts: list[float] = []

    def add(self, part: str, seconds: float) -> None:
        if self.steps:
            self.steps[-1][part] += seconds

    def begin_step(self) -> None:
        self.starts.append(time.perf_counter())
        self.steps.append(defaultdict(float))


def _part_named(name: str) -> str:
    return next(part for part, _, attribute, _ in PARTS if attribute == name)


def _timed(timers: Timers, part: str, function: Callable[..., Any]) -> Callable[..., Any]:
    # wraps: the wrapped function's attributes come along (torch's schedulers mark the optimizer's
    # step they wrapped, and warn when it looks replaced).
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            timers.add(part, time.perf_counter() - start)

    return wrapper


class _TimedIterator:
    """The loader's iterator, its ``next`` timed (the loop reads one batch per micro-batch)."""

    def __init__(self, inner: Iterator[Any], timers: Timers) -> None:
        self.inner, self.timers = inner, timers

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            return next(self.inner)
        finally:
            self.timers.add("  the next batch from the loader (its checks included)", time.perf_counter() - start)


@contextlib.contextmanager
def instrumented(timers: Timers) -> Iterator[None]:
    """Every part of :data:`PARTS` timed, ``Run.step`` marking each step's start; undone after."""
    saved: list[tuple[Any, str, Any]] = []
    inherited = object()  # the attribute came from a base class: undone by deleting the patch

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, vars(owner).get(name, inherited)))
        setattr(owner, name, value)

    for part, owner, name, _ in PARTS:
        if owner is not None:
            patch(owner, name, _timed(timers, part, getattr(owner, name)))
    original_step, original_batches = run.Run.step, run.Run._train_batches

    def step_marked(self: run.Run, *args: Any, **kwargs: Any) -> Any:
        if not timers.steps:  # the run's own optimizer and scheduler, timed from its first step on
            optimizer, scheduler = self.parts.optimizer, self.parts.scheduler
            # The optimizer's step is an instance attribute already (torch's schedulers wrap it there), and
            # its state_dict holds no attributes; the scheduler's state_dict holds its every attribute, so
            # its class is patched instead (and restored after).
            optimizer.step = _timed(timers, _part_named("optimizer.step"), optimizer.step)
            patch(type(scheduler), "step", _timed(timers, _part_named("scheduler.step"), type(scheduler).step))
        timers.begin_step()
        return original_step(self, *args, **kwargs)

    def batches_timed(self: run.Run) -> Iterator[Any]:
        inner = original_batches(self)
        return inner if isinstance(inner, _TimedIterator) else _TimedIterator(inner, timers)

    patch(run.Run, "step", step_marked)
    patch(run.Run, "_train_batches", batches_timed)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is inherited:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def forge_steps(steps: int, workdir: Path, settings: PluginSettings) -> tuple[list[float], dict[str, list[float]]]:
    """One fresh ``train()`` of ``steps`` steps: each step's period (start to the next start;
    the first and last dropped) and each part's seconds in those steps."""
    manager = PluginManager(settings)
    overrides = [*MICRO, f"--train.output_dir={workdir}", f"--train.max_steps={steps}", "--eval.interval=0"]
    config = load_config(None, ["--train.precision=fp32", *overrides], manager.registry)
    manager.configure(config)
    timers = Timers()
    with instrumented(timers), contextlib.redirect_stdout(io.StringIO()):
        loop.train(config, manager)
    periods = [later - earlier for earlier, later in zip(timers.starts, timers.starts[1:], strict=False)]
    measured = range(1, len(periods))  # step 1 logs the starting loss and warms up; the last ends the run
    parts = {part: [timers.steps[i].get(part, 0.0) for i in measured] for part, *_ in PARTS}
    return [periods[i] for i in measured], parts


class _PlainStepEachStep:
    """A plugin whose ``step_end`` runs one step of ``plain``, timed: inside ``train()`` the
    plain loop's steps and Forge's alternate one by one."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self, plain: PlainSide) -> None:
        self.plain, self.seconds = plain, []

    @forge_lm.hookimpl
    def forge_lm_step_end(self, step: int) -> None:
        start = time.perf_counter()
        self.plain.run(1)
        self.seconds.append(time.perf_counter() - start)


@contextlib.contextmanager
def _step_starts(starts: list[float]) -> Iterator[None]:
    """The time each ``Run.step`` call starts, appended to ``starts``; undone after."""
    original = run.Run.step

    def step_marked(self: run.Run, *args: Any, **kwargs: Any) -> Any:
        starts.append(time.perf_counter())
        return original(self, *args, **kwargs)

    run.Run.step = step_marked
    try:
        yield
    finally:
        run.Run.step = original


def paired_steps(
    overrides: list[str], steps: int, workdir: Path, settings: PluginSettings
) -> tuple[list[float], list[float]]:
    """Forge's step (``train()``, on the plain loop's kernels) and the plain loop's step next to
    it, in seconds, for ``steps - 2`` steps (the first, which warms up and logs the starting loss,
    and the last, which ends the run, are left out); see the module docstring."""
    both = ["--train.precision=fp32", *overrides, *PLAIN_KERNELS]
    source = ForgeSide(both, workdir / "plain-source", settings)
    plain = PlainSide(source, source.fresh_batches(32), "fused")
    plain.run(3)  # warm-up
    manager = PluginManager(settings)
    stepper = _PlainStepEachStep(plain)
    manager.add_plugin(stepper, "plain-loop-steps")
    run_options = [f"--train.output_dir={workdir / 'run'}", f"--train.max_steps={steps}", "--eval.interval=0"]
    config = load_config(None, [*both, *run_options, "--checkpoint.interval=0"], manager.registry)
    manager.configure(config)
    starts: list[float] = []
    with _step_starts(starts), quiet():
        loop.train(config, manager)
    periods = [later - earlier for earlier, later in itertools.pairwise(starts)]
    plain_steps = stepper.seconds[: len(periods)]
    forge = [period - inner for period, inner in zip(periods, plain_steps, strict=True)]
    return forge[1:], plain_steps[1:]


def bootstrap_interval(
    values: list[float], statistic: Callable[[list[float]], float] = median, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A 95% bootstrap interval of ``statistic`` (the median, the mean) of ``values``: how far the
    noise of single steps leaves it uncertain (on these VMs a step moves by several percent on
    its own)."""
    generator = random.Random(seed)
    estimates = sorted(statistic(generator.choices(values, k=len(values))) for _ in range(resamples))
    return estimates[int(0.025 * resamples)], estimates[int(0.975 * resamples) - 1]


def paired_row(label: str, forge: list[float], plain: list[float]) -> dict[str, Any]:
    """The median per-step difference of ``forge`` and ``plain`` (paired), in ms and as a share
    of the plain step, with its 95% interval; and the mean difference with its own, which also
    counts the occasional slow step (a garbage collection, a late page) that a median leaves out."""
    differences = [mine - theirs for mine, theirs in zip(forge, plain, strict=True)]
    plain_step = median(plain)
    low, high = bootstrap_interval(differences)
    mean_low, mean_high = bootstrap_interval(differences, statistics.fmean)
    mean = statistics.fmean(differences)
    return {
        "model": label,
        "pairs": len(differences),
        "forge_step_ms": median(forge) * 1e3,
        "plain_step_ms": plain_step * 1e3,
        "overhead_ms": median(differences) * 1e3,
        "overhead_ms_95": [low * 1e3, high * 1e3],
        "overhead_share": median(differences) / plain_step,
        "overhead_share_95": [low / plain_step, high / plain_step],
        "mean_overhead_ms": mean * 1e3,
        "mean_overhead_ms_95": [mean_low * 1e3, mean_high * 1e3],
        "mean_overhead_share": mean / statistics.fmean(plain),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per round (one fresh run of Forge's loop)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, Forge and the plain loop alternating")
    parser.add_argument(
        "--pairs",
        type=int,
        default=120,
        help="paired steps of the tiny model (a quarter as many of the default one); 0: none",
    )
    parser.add_argument("--no-save", action="store_true", help="print only; do not write results/overhead.json")
    args = parser.parse_args()
    settings = PluginSettings.from_env()
    work = Path(tempfile.mkdtemp(prefix="forge-bench-overhead-"))
    micro = ForgeSide(["--train.precision=fp32", *MICRO], work / "plain-source", settings)
    plain = PlainSide(micro, micro.fresh_batches(64), "fused")
    plain.run(20)  # warm-up

    forge_periods: list[float] = []
    forge_parts: dict[str, list[float]] = defaultdict(list)
    plain_steps: list[float] = []
    for index in range(args.rounds):
        periods, parts = forge_steps(args.steps, work / f"run-{index}", settings)
        forge_periods += periods
        for part, values in parts.items():
            forge_parts[part] += values
        for _ in range(len(periods)):  # as many plain steps, timed one by one
            start = time.perf_counter()
            plain.run(1)
            plain_steps.append(time.perf_counter() - start)
        print(f"  round {index + 1}/{args.rounds} done", flush=True)

    paired = []
    if args.pairs:
        for label, overrides, pairs in (("tiny", TINY, args.pairs), ("default", [], max(3, args.pairs // 4))):
            forge, plain_paired = paired_steps(overrides, pairs + 2, work / f"paired-{label}", settings)
            paired.append(paired_row(label, forge, plain_paired))
            row = paired[-1]
            print(f"  paired steps, {label} model: overhead {row['overhead_ms']:.3f} ms ({row['overhead_share']:.2%} "
                  f"of the plain step; 95% {row['overhead_share_95'][0]:.2%} to {row['overhead_share_95'][1]:.2%}); "
                  f"mean {row['mean_overhead_ms']:.3f} ms ({row['mean_overhead_share']:.2%})", flush=True)  # fmt: skip

    forge_step, plain_step = median(forge_periods), median(plain_steps)
    rows = []
    for part, _, _, shared in PARTS:
        rows.append(
            {
                "part": part,
                "us_per_step": statistics.median(forge_parts[part]) * 1e6,
                "in_the_plain_loop_too": shared,
            }
        )
    top_level = sum(r["us_per_step"] for r in rows if not r["part"].startswith("  "))
    rows.append({"part": "the loop body's own lines (the rest)", "us_per_step": forge_step * 1e6 - top_level,
                 "in_the_plain_loop_too": False})  # fmt: skip
    rows.append(
        {"part": "Forge's whole step (train())", "us_per_step": forge_step * 1e6, "in_the_plain_loop_too": None}
    )
    rows.append({"part": "the plain loop's whole step", "us_per_step": plain_step * 1e6, "in_the_plain_loop_too": None})
    for row in rows:
        print(f"  {row['part']:62s} {row['us_per_step']:9.1f} us")
    fixed_ms = (forge_step - plain_step) * 1e3
    notes = (
        f"The micro model ({' '.join(MICRO)}) trained by forge_lm.train.train() for {args.steps} steps per round, "
        f"{args.rounds} rounds, alternating with as many steps of the plain loop on the same model. Each part's "
        "median over the steps (steps 2 to the last but one of each run); an indented part is inside the one above "
        "it. `in_the_plain_loop_too`: the plain loop does the same work (its own clip_grad_norm_, a loss.item() "
        "for the sync), so only the other parts are Forge's own. The whole step is the median time from one "
        "Run.step call to the next; the rest is what the listed parts leave of it."
    )
    headline = [
        {
            "measure": "Forge's loop (train(), micro model, logging every step): fixed cost per step over the plain "
            "loop's (ms)",
            "value": fixed_ms,
            "meaning": f"Forge's step {forge_step * 1e3:.2f} ms against the plain loop's {plain_step * 1e3:.2f} ms; "
            "the parts in the table",
        }
    ]
    for row in paired:
        share = "target at most 0.01 (issue 35)"
        headline.append(
            {
                "measure": f"Forge's loop (train()) on the plain loop's kernels, {row['model']} model, steps paired "
                "with the plain loop's: overhead as a share of the plain step",
                "value": row["overhead_share"],
                "meaning": f"{share}; median of {row['pairs']} per-step differences, {row['overhead_ms']:.2f} ms "
                f"against a plain step of {row['plain_step_ms']:.1f} ms (95% interval "
                f"{row['overhead_share_95'][0]:.2%} to {row['overhead_share_95'][1]:.2%}); the mean difference "
                f"{row['mean_overhead_ms']:.2f} ms ({row['mean_overhead_share']:.2%}; 95% "
                f"{row['mean_overhead_ms_95'][0]:.2f} to {row['mean_overhead_ms_95'][1]:.2f} ms)",
            }
        )
    tables = {"paired steps": paired} if paired else None
    command = "python benchmarks/bench_overhead.py " + " ".join(sys.argv[1:])
    if not args.no_save:
        print(f"wrote {save('overhead', command.strip(), rows, notes, headline=headline, tables=tables)}")


if __name__ == "__main__":
    main()
