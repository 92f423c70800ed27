"""benchmarks/bench_overhead.py: the loop's parts are timed where the loop calls them, every
step, nested parts inside their parent, and the loop is left as it was afterwards."""

from __future__ import annotations

import pytest

from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train import run, step
from forge_lm.train.guards import SchedulerGuard


def test_each_part_is_timed_once_a_step_inside_the_step_and_the_loop_is_restored(bench, tmp_path):
    overhead = bench("bench_overhead")
    before = (run.compute_gradients, step.clip_grads, run.Run.step, SchedulerGuard.check_rates)
    collect_was_own = "collect_metrics" in vars(PluginManager)

    periods, parts = overhead.forge_steps(8, tmp_path / "run", PluginSettings(autoload=False))

    assert len(periods) == 6  # steps 2 to 7 of 8: the first and the last are left out
    assert set(parts) == {part for part, *_ in overhead.PARTS}
    gradients = parts["forward, loss, backward and clipping (compute_gradients)"]
    for index, period in enumerate(periods):
        inner = [values[index] for part, values in parts.items() if part.startswith("  ")]
        top = [values[index] for part, values in parts.items() if not part.startswith("  ")]
        assert all(value > 0 for value in inner + top), index  # every part ran in every step
        assert sum(inner) < gradients[index]  # the loader and the clipping run inside compute_gradients
        assert sum(top) < period  # the parts fit in the step they were timed in
    assert (run.compute_gradients, step.clip_grads, run.Run.step, SchedulerGuard.check_rates) == before
    assert ("collect_metrics" in vars(PluginManager)) is collect_was_own


def test_a_part_that_is_not_called_where_the_loop_looks_is_caught(bench, tmp_path, monkeypatch):
    """If the loop stopped calling a part through the wrapped name (a rename), its time would be
    zero: the check above would fail; here a part is made unreachable to show it."""
    overhead = bench("bench_overhead")
    monkeypatch.setattr(overhead, "PARTS", [*overhead.PARTS, ("never called", PluginManager, "manifest_hash", False)])

    _, parts = overhead.forge_steps(6, tmp_path / "run", PluginSettings(autoload=False))

    assert parts["never called"] == pytest.approx([0.0] * 4)


def test_paired_steps_alternate_inside_the_loop_and_the_row_is_their_median_difference(bench, tmp_path):
    overhead = bench("bench_overhead")
    before = run.Run.step

    forge, plain = overhead.paired_steps(list(overhead.MICRO), 8, tmp_path, PluginSettings(autoload=False))

    assert len(forge) == len(plain) == 6  # 8 steps: the first and the last left out
    assert all(value > 0 for value in forge + plain)
    assert run.Run.step is before
    row = overhead.paired_row("micro", [5.0, 4.0, 9.0], [3.0, 3.5, 2.0])  # differences 2, 0.5, 7
    assert row["overhead_ms"] == pytest.approx(2000.0)
    assert row["overhead_share"] == pytest.approx(2.0 / 3.0)
    low, high = row["overhead_ms_95"]
    assert 500.0 <= low <= 2000.0 <= high <= 7000.0
    assert row["mean_overhead_ms"] == pytest.approx(9500.0 / 3)  # the slow pair counts in full
    assert row["mean_overhead_share"] == pytest.approx((9.5 / 3) / (8.5 / 3))
    low, high = row["mean_overhead_ms_95"]
    assert 500.0 <= low <= 9500.0 / 3 <= high <= 7000.0
