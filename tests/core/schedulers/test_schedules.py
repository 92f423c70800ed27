"""Each built-in schedule's whole curve equals its formula, written out here (100 steps, warmup 10)."""

from __future__ import annotations

import math

import pytest

from forge_lm.config import structure_options
from forge_lm.errors import ConfigError

T, W = 100, 10
WARMUP = [(s + 1) / W for s in range(W)]  # the documented warmup: step s of W runs at (s + 1) / W
AFTER = range(W, T)


def assert_curve(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected) == T
    wrong = [
        (s, a, e)
        for s, (a, e) in enumerate(zip(actual, expected, strict=True))
        if not math.isclose(a, e, rel_tol=1e-12, abs_tol=1e-15)
    ]
    assert not wrong, f"(step, actual, expected): {wrong[:5]}"


@pytest.mark.parametrize("name", ["constant", "none"])
def test_constant_and_none_warm_up_then_hold_the_peak(name, rates):
    assert_curve(rates(name, T, warmup_steps=W), WARMUP + [1.0] * (T - W))


def test_cosine_decays_along_half_a_cosine_to_min_lr_ratio(rates):
    expected = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - W) / (T - W))) for s in AFTER]
    assert_curve(rates("cosine", T, warmup_steps=W, min_lr_ratio=0.1), WARMUP + expected)


@pytest.mark.parametrize("min_lr_ratio", [0.0, 0.2])
def test_linear_decays_in_a_straight_line_to_min_lr_ratio(min_lr_ratio, rates):
    expected = [1 - (1 - min_lr_ratio) * (s - W) / (T - W) for s in AFTER]
    assert_curve(rates("linear", T, warmup_steps=W, min_lr_ratio=min_lr_ratio), WARMUP + expected)


def test_linear_decays_to_zero_by_default(rates):
    curve = rates("linear", T, warmup_steps=W)
    assert curve[W] == 1.0
    assert math.isclose(curve[-1], 1 / (T - W))  # one decay step from zero: the last step still trains


@pytest.mark.parametrize(
    ("cooldown", "shape"),
    [
        ("sqrt", lambda p: 1 - math.sqrt(p)),
        ("linear", lambda p: 1 - p),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ],
)
def test_wsd_holds_the_peak_then_cools_down_over_the_last_decay_fraction(cooldown, shape, rates):
    # decay_fraction 0.2 of 100 steps: steps 80..99 cool down, from the peak towards 0.05.
    stable = [1.0] * (80 - W)
    cooling = [0.05 + 0.95 * shape((s - 80) / 20) for s in range(80, T)]
    curve = rates("wsd", T, warmup_steps=W, decay_fraction=0.2, cooldown=cooldown, min_lr_ratio=0.05)
    assert_curve(curve, WARMUP + stable + cooling)


def test_wsd_defaults_to_a_sqrt_cooldown_over_the_last_fifth_to_zero(rates):
    expected = [1.0] * (80 - W) + [1 - math.sqrt((s - 80) / 20) for s in range(80, T)]
    assert_curve(rates("wsd", T, warmup_steps=W), WARMUP + expected)


def test_wsd_never_cools_down_during_warmup(rates):
    # decay_fraction 1 asks for a cooldown over the whole run; it starts when warmup ends.
    expected = [1 - (s - W) / (T - W) for s in AFTER]
    assert_curve(rates("wsd", T, warmup_steps=W, decay_fraction=1.0, cooldown="linear"), WARMUP + expected)


def rex(p: float) -> float:
    return (1 - p) / (0.5 + 0.5 * (1 - p))


def test_rex_follows_its_formula_over_the_progress_after_warmup(rates):
    expected = [rex((s - W) / (T - W)) for s in AFTER]
    assert_curve(rates("rex", T, warmup_steps=W), WARMUP + expected)


def test_rex_is_two_thirds_of_the_peak_halfway_through_its_decay(rates):
    assert math.isclose(rates("rex", T, warmup_steps=W)[W + (T - W) // 2], 2 / 3)


def test_rex_is_floored_at_min_lr_ratio(rates):
    expected = [max(0.3, rex((s - W) / (T - W))) for s in AFTER]
    curve = rates("rex", T, warmup_steps=W, min_lr_ratio=0.3)
    assert_curve(curve, WARMUP + expected)
    assert curve[-1] == 0.3


@pytest.mark.parametrize("name", ["constant", "none", "cosine", "linear", "wsd", "rex"])
def test_without_warmup_the_first_step_runs_at_the_peak(name, rates):
    assert rates(name, T, warmup_steps=0)[0] == 1.0


@pytest.mark.parametrize("name", ["cosine", "linear", "wsd", "rex"])
def test_a_decaying_schedule_refuses_a_run_without_steps(name, rates):
    with pytest.raises(ConfigError, match=r"needs total_steps >= 1 \(the run's length\), got 0"):
        rates(name, 0)


def test_wsd_rejects_an_unknown_cooldown(builtins):
    component = builtins.registry.resolve("schedulers", "wsd")
    with pytest.raises(ConfigError) as caught:
        structure_options(builtins.registry, component, {"cooldown": "exp"}, "scheduler")
    assert str(caught.value) == "[scheduler] cooldown: must be one of 'sqrt', 'linear', 'cosine', got 'exp'."
