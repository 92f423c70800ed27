"""A regression check on speed: Forge's training step must not fall below 0.95x a hand-written
PyTorch loop on the same model, batch and precision.

A comparison inside one process, as ``benchmarks/bench_train.py`` makes it (its own sides,
alternating blocks of steps, medians), never an absolute time: on a busy machine both sides
slow down alike. Two ratios are checked: Forge as it runs by default (its fp32 linear layers on
oneDNN where torch has it, eager attention on short sequences), and Forge on the plain loop's
own kernels (``cpu_linear_kernel = "aten"``, ``attention_backend = "sdpa"``), which isolates
the framework's overhead.
"""

from __future__ import annotations

import importlib
import statistics
import sys
from pathlib import Path

import pytest

from forge_lm.model.linear import kernel as linear_kernel
from forge_lm.plugins import PluginSettings

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

FLOOR = 0.95
ROUNDS, STEPS = 5, 2


@pytest.fixture(scope="module")
def ratios(tmp_path_factory):
    # Building a side sets the process-wide linear kernel (as forge train does): put it back after.
    with linear_kernel("auto"):
        return _measure(tmp_path_factory)


def _measure(tmp_path_factory) -> dict[str, float]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        bench_train = importlib.import_module("bench_train")
        record = importlib.import_module("_record")
    finally:
        sys.path.remove(str(BENCHMARKS))
    workdir = tmp_path_factory.mktemp("ratio")
    settings = PluginSettings(autoload=False)
    base = ["--train.device=cpu", "--train.precision=fp32"]
    forge = bench_train.ForgeSide(base, workdir / "default", settings)
    aten = bench_train.ForgeSide([*base, *bench_train.PLAIN_KERNELS], workdir / "aten", settings)
    plain = bench_train.PlainSide(forge, forge.fresh_batches(8))
    with bench_train.quiet():
        samples = record.alternate(
            {"forge": lambda: forge.run(STEPS), "aten": lambda: aten.run(STEPS), "plain": lambda: plain.run(STEPS)},
            ROUNDS,
            warmup=1,
            rotate=True,
        )
    for side in (forge, aten):
        side.close()
    # The median of per-round ratios: a round's sides ran back to back, under the same load.
    return {
        name: statistics.median(mine / base for mine, base in zip(samples[name], samples["plain"], strict=True))
        for name in ("forge", "aten")
    }


def test_forge_step_is_at_least_095x_the_plain_loop(ratios):
    assert ratios["forge"] >= FLOOR, ratios


def test_forge_overhead_on_the_plain_loops_kernels_is_at_most_5_percent(ratios):
    assert ratios["aten"] >= FLOOR, ratios
