"""benchmarks/check_train_ratio.py, the throughput regression check that ``make bench`` runs
(issues 33 and 35 moved it out of the default suite, where shared machines' noise made it a
flaky gate): its verdict logic, and that make bench runs it."""

from __future__ import annotations

import pytest


def test_a_measurement_below_the_floor_is_repeated_and_pooled(bench):
    check = bench("check_train_ratio")
    measurements = iter(
        [{"forge": [0.90, 0.91, 0.92], "aten": [1.0] * 3}, {"forge": [1.0, 1.01, 1.02], "aten": [1.0] * 3}]
    )
    # The median over all six rounds, not the better of the two measurements.
    assert check.measure(lambda: next(measurements)) == {"forge": pytest.approx((0.92 + 1.0) / 2), "aten": 1.0}


def test_a_measurement_above_the_floor_is_taken_once(bench):
    check = bench("check_train_ratio")
    measurements = iter([{"forge": [0.96, 0.97, 0.98], "aten": [1.0] * 3}])
    assert check.measure(lambda: next(measurements)) == {"forge": 0.97, "aten": 1.0}


def test_make_bench_runs_the_check(bench):
    scripts = [script for script, _, _ in bench("run_all").BENCHMARKS]
    assert "check_train_ratio.py" in scripts
