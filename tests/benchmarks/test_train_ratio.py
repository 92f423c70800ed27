"""A regression check on speed: Forge's training step must not fall below 0.95x a hand-written
PyTorch loop on the same model, batch and precision.

A comparison inside one process, as ``benchmarks/bench_train.py`` makes it (its own sides,
alternating blocks of steps, medians), never an absolute time: on a busy machine both sides
slow down alike. Two ratios are checked: Forge as it runs by default (its fp32 linear layers on
oneDNN where torch has it, eager attention on short sequences), and Forge on the plain loop's
own kernels (``cpu_linear_kernel = "aten"``, ``attention_backend = "sdpa"``), which isolates
the framework's overhead.

Each ratio is the median of per-round ratios. When a first measurement falls below the floor,
the sides run as many rounds again and the verdict is the median over all the rounds: a real
regression stays below the floor with twice the samples, while one unlucky burst of load on a
shared machine (a VM's neighbours) no longer fails the suite on its own.
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
    per_round = _per_round_ratios(tmp_path_factory)
    if min(statistics.median(ratios) for ratios in per_round.values()) < FLOOR:
        for name, more in _per_round_ratios(tmp_path_factory).items():
            per_round[name] += more
    return {name: statistics.median(ratios) for name, ratios in per_round.items()}


def _per_round_ratios(tmp_path_factory) -> dict[str, list[float]]:
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
    # Per-round ratios: a round's sides ran back to back, under the same load.
    return {
        name: [mine / base for mine, base in zip(samples[name], samples["plain"], strict=True)]
        for name in ("forge", "aten")
    }


def test_forge_step_is_at_least_095x_the_plain_loop(ratios):
    assert ratios["forge"] >= FLOOR, ratios


def test_forge_overhead_on_the_plain_loops_kernels_is_at_most_5_percent(ratios):
    assert ratios["aten"] >= FLOOR, ratios


def test_a_measurement_below_the_floor_is_repeated_and_pooled(monkeypatch):
    measurements = iter(
        [{"forge": [0.90, 0.91, 0.92], "aten": [1.0] * 3}, {"forge": [1.0, 1.01, 1.02], "aten": [1.0] * 3}]
    )
    monkeypatch.setattr(sys.modules[__name__], "_per_round_ratios", lambda _: next(measurements))
    # The median over all six rounds, not the better of the two measurements.
    assert _measure(None) == {"forge": pytest.approx((0.92 + 1.0) / 2), "aten": 1.0}


def test_a_measurement_above_the_floor_is_taken_once(monkeypatch):
    measurements = iter([{"forge": [0.96, 0.97, 0.98], "aten": [1.0] * 3}])
    monkeypatch.setattr(sys.modules[__name__], "_per_round_ratios", lambda _: next(measurements))
    assert _measure(None) == {"forge": 0.97, "aten": 1.0}
