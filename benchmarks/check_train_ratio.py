"""The throughput regression check of ``make bench``: Forge's training step must not fall below
0.95x a hand-written PyTorch loop on the same model, batch and precision.

A comparison inside one process, as ``bench_train.py`` makes it (its own sides, alternating
blocks of steps, per-round ratios, medians), never an absolute time: the baseline is the plain
loop of the same run, so it is always this host's. Two ratios are checked: Forge as it runs by
default (``cpu_linear_kernel = "auto"``: oneDNN where it measured faster here, eager attention
on short sequences), and Forge on the plain loop's own kernels (``cpu_linear_kernel = "aten"``,
``attention_backend = "sdpa"``), which isolates the framework's overhead.

When a first measurement falls below the floor, the sides run as many rounds again and the
verdict is the median over all the rounds: a real regression stays below the floor with twice
the samples, while one burst of load on a shared machine does not fail the check on its own.
It was a test of the default suite until a 10% noise band on shared 2-core machines made it a
flaky gate there; here it runs with the other benchmarks, on an idle machine, and writes
``results/train_ratio_check.json`` with the host's CPU and load like every benchmark.

Run:  .venv/bin/python benchmarks/check_train_ratio.py [--rounds 5] [--steps 2]
Exit 0 when both ratios hold the floor, 1 otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

FLOOR = 0.95


def measure(per_round_ratios: Callable[[], dict[str, list[float]]]) -> dict[str, float]:
    """The median per-round ratio of each side, measured again and pooled when one falls below
    the floor."""
    per_round = per_round_ratios()
    if min(statistics.median(ratios) for ratios in per_round.values()) < FLOOR:
        for name, more in per_round_ratios().items():
            per_round[name] += more
    return {name: statistics.median(ratios) for name, ratios in per_round.items()}


def per_round_ratios(workdir: Path, rounds: int, steps: int) -> dict[str, list[float]]:
    """Forge's and Forge-on-aten's tokens/s over the plain loop's, one ratio per round (a round's
    sides ran back to back, under the same load)."""
    import bench_train
    from _record import alternate

    from forge_lm.model.linear import kernel as linear_kernel
    from forge_lm.plugins import PluginSettings

    settings = PluginSettings(autoload=False)
    base = ["--train.device=cpu", "--train.precision=fp32"]
    with linear_kernel("auto"):  # building a side sets the process-wide kernel, as forge train does
        forge = bench_train.ForgeSide(base, workdir / "default", settings)
        aten = bench_train.ForgeSide([*base, *bench_train.PLAIN_KERNELS], workdir / "aten", settings)
        plain = bench_train.PlainSide(forge, forge.fresh_batches(8))
        with bench_train.quiet():
            samples = alternate(
                {"forge": lambda: forge.run(steps), "aten": lambda: aten.run(steps), "plain": lambda: plain.run(steps)},
                rounds,
                warmup=1,
                rotate=True,
            )
        for side in (forge, aten):
            side.close()
    return {
        name: [mine / base for mine, base in zip(samples[name], samples["plain"], strict=True)]
        for name in ("forge", "aten")
    }


def main() -> int:
    from _record import save

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per side in each round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="forge-ratio-") as workdir:
        ratios = measure(lambda: per_round_ratios(Path(workdir), args.rounds, args.steps))
    meaning = {
        "forge": "Forge's step (default kernels) / the plain loop's",
        "aten": "Forge's step on the plain loop's kernels / the plain loop's: framework overhead",
    }
    rows = [
        {"side": name, "ratio": round(value, 3), "floor": FLOOR, "meaning": meaning[name]}
        for name, value in ratios.items()
    ]
    save(
        "train_ratio_check",
        f"benchmarks/check_train_ratio.py --rounds {args.rounds} --steps {args.steps}",
        rows,
        "A regression check: each ratio is a median of per-round ratios against the plain loop of the same run.",
    )
    failed = [name for name, value in ratios.items() if value < FLOOR]
    for name, value in ratios.items():
        print(f"{meaning[name]}: {value:.3f}x (floor {FLOOR}x){'  BELOW THE FLOOR' if name in failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
