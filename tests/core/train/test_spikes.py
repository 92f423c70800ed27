"""The loss-spike detector (forge_lm.train.spikes) against the formula, computed with numpy."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

from forge_lm.config import ResilienceSection
from forge_lm.train.spikes import SpikeDetector, window_statistics


def detector(**options) -> SpikeDetector:
    return SpikeDetector(ResilienceSection(spike_policy="skip", **options))


def reference_verdicts(values: list[float], window: int, sigmas: float, warmup: int) -> list[bool]:
    """The rule written out with numpy: past the warm-up, with a full window of the last accepted
    values, a value above mean + sigmas * std (population) is a spike and is not accepted."""
    accepted: list[float] = []
    verdicts = []
    for step, value in enumerate(values, start=1):
        recent = np.array(accepted[-window:])
        spike = step > warmup and len(recent) == window and value > recent.mean() + sigmas * recent.std()
        verdicts.append(bool(spike))
        if step > warmup and not spike:
            accepted.append(value)
    return verdicts


def test_window_statistics_are_numpys_mean_and_population_std():
    values = np.random.default_rng(0).normal(3.0, 0.2, size=50)
    mean, std, threshold = window_statistics(values.tolist(), 6.0)
    assert mean == pytest.approx(values.mean(), rel=1e-14)
    assert std == pytest.approx(values.std(), rel=1e-12)  # ddof = 0
    assert threshold == pytest.approx(values.mean() + 6.0 * values.std(), rel=1e-13)


@pytest.mark.parametrize(("window", "sigmas", "warmup"), [(5, 3.0, 0), (8, 2.0, 4), (20, 6.0, 10)])
def test_verdicts_follow_the_rule_on_a_noisy_falling_loss_with_spikes(window, sigmas, warmup):
    rng = np.random.default_rng(window)
    values = (4.0 * np.exp(-np.arange(200) / 60) + 2.0 + rng.normal(0, 0.05, 200)).tolist()
    for at in (30, 31, 90, 150):  # two in a row, then single ones
        values[at] += 3.0
    spikes = detector(spike_window=window, spike_sigmas=sigmas, spike_warmup_steps=warmup)
    verdicts = [spikes.check(step, value, 0.0) is not None for step, value in enumerate(values, start=1)]
    expected = reference_verdicts(values, window, sigmas, warmup)
    assert verdicts == expected
    assert all(expected[at] for at in (30, 31, 90, 150))  # the injected spikes are among them


def test_nothing_is_judged_in_the_warm_up_nor_before_the_window_is_full():
    spikes = detector(spike_window=3, spike_sigmas=1.0, spike_warmup_steps=2)
    assert spikes.check(1, 100.0, 0.0) is None  # warm-up: not judged, not in the window
    assert spikes.check(2, 1.0, 0.0) is None
    assert list(spikes.values) == []
    for step in (3, 4, 5):
        assert spikes.check(step, 1.0 + step / 100, 0.0) is None  # filling the window
    found = spikes.check(6, 2.0, 0.0)
    mean, std, threshold = window_statistics([1.03, 1.04, 1.05], 1.0)
    assert found is not None
    assert (found.step, found.metric, found.value, found.mean, found.std, found.threshold) == (
        6,
        "loss",
        2.0,
        mean,
        std,
        threshold,
    )
    assert list(spikes.values) == [1.03, 1.04, 1.05]  # the spike did not enter the window


def test_grad_norm_is_judged_when_chosen_and_tensors_are_read():
    spikes = detector(spike_window=2, spike_sigmas=1.0, spike_warmup_steps=0, spike_metric="grad_norm")
    for step, norm in enumerate((1.0, 1.2), start=1):
        assert spikes.check(step, torch.tensor(50.0), torch.tensor(norm, dtype=torch.float64)) is None
    found = spikes.check(3, torch.tensor(0.0), torch.tensor(9.0))
    assert found is not None
    assert (found.metric, found.value) == ("grad_norm", 9.0)


def test_the_state_round_trips_and_a_tampered_one_is_refused():
    spikes = detector(spike_window=3, spike_warmup_steps=0)
    for step, value in enumerate((1.0, 2.0, 3.0, 4.0), start=1):
        spikes.check(step, value, 0.0)
    spikes.spikes, spikes.in_a_row = 2, 1
    state = spikes.state_dict()
    assert state == {"values": [2.0, 3.0, 4.0], "spikes": 2, "in_a_row": 1}
    smaller = detector(spike_window=2)
    smaller.load_state_dict(state)  # a run resumed with a shorter window keeps the newest values
    assert (list(smaller.values), smaller.spikes, smaller.in_a_row) == ([3.0, 4.0], 2, 1)
    for bad in (
        [],
        {"values": [1.0], "spikes": 0},
        {"values": [float("nan")], "spikes": 0, "in_a_row": 0},
        {"values": "1.0", "spikes": 0, "in_a_row": 0},
        {"values": [True], "spikes": 0, "in_a_row": 0},
        {"values": [], "spikes": -1, "in_a_row": 0},
        {"values": [], "spikes": 0, "in_a_row": 1.5},
    ):
        with pytest.raises(ValueError, match="loss-spike"):
            SpikeDetector.checked_state(bad)


def test_no_detector_when_the_policy_is_off():
    assert SpikeDetector.for_run(_Config(ResilienceSection())) is None
    assert SpikeDetector.for_run(_Config(ResilienceSection(spike_policy="rollback"))) is not None


@attrs.frozen
class _Config:
    resilience: ResilienceSection
