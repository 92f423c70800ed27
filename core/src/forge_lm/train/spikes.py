"""Loss spikes: a step far above the recent ones is not taken (``[resilience] spike_policy``).

The detector keeps a running window of the last ``spike_window`` accepted values of the judged
metric (the step's loss, or its gradient norm before clipping). Once the window is full, a step
whose value is above ``mean + spike_sigmas * std`` of the window (the population standard
deviation, numpy's default) is a spike: it does not enter the window, and the policy acts.
Steps 1 to ``spike_warmup_steps`` are neither judged nor put in the window: early in a run the
loss falls too fast for its recent past to say what is normal.

- ``skip``: the optimizer and the scheduler do not step, the gradients are dropped, and the
  step's micro-batches are not trained on (the data goes on after them). The step number does
  not advance and ``tokens_seen`` does not count them, as for a skipped non-finite step (and as
  Megatron's scheduler, which steps only on a successful update): the run still makes
  ``max_steps`` optimizer updates, each at its scheduled learning rate.
- ``rollback``: the run goes back to the newest checkpoint (step C) and on from there with the
  batches after the spike's: every micro-batch read since that checkpoint, the spike step's
  included (loader batches ``b_C + 1`` to ``b_S``, recorded in the event), is not trained on.
  The window is the checkpoint's again; the count of spikes is not. Without a checkpoint yet,
  the step is skipped instead.

``max_spike_steps`` spikes in a row (with no step taken between them) stop the run (exit 3): a
loss that stays up is a new level, not a spike, and needs a person.

Every rank takes the same decision without a collective of its own: the judged loss is the mean
that the step's agreement all-reduced (:func:`forge_lm.distributed.reduce.agree_on_step`) and the
gradient norm is the global one every rank computes from one all-reduce, so each rank judges the
same bits against the same window (the window is the same on every rank: same values, same
checkpoint).

Each spike is a ``loss_spike`` event (the step, the value, the window's mean, std and threshold,
the action); the run's count of spikes is logged as the ``spikes`` metric and kept, with the
window, in the checkpoint's trainer state, so that a resumed run judges as the straight run would.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from forge_lm import events
from forge_lm.notices import warn
from forge_lm.train.resilience import NonFiniteLoss

_STATE_KEYS = {"values", "spikes", "in_a_row"}


class SpikesPersist(NonFiniteLoss):
    """``max_spike_steps`` spikes in a row: the run stops (exit 3), its newest checkpoint intact."""


@attrs.frozen
class Spike:
    """A step judged a spike: ``step`` is the step it would have been (context.step + 1)."""

    step: int
    metric: str
    value: float
    mean: float
    std: float
    threshold: float


def window_statistics(values: Iterable[float], sigmas: float) -> tuple[float, float, float]:
    """``(mean, population std, mean + sigmas * std)`` of ``values`` (fsum: the same to the last
    bit whatever the order of additions inside a sum would have been)."""
    values = list(values)
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((value - mean) ** 2 for value in values) / len(values))
    return mean, std, mean + sigmas * std


class SpikeDetector:
    """The running window and counts of one run; ``options``: its ``[resilience]`` section."""

    def __init__(self, options: Any) -> None:
        self.options = options
        self.metric: str = options.spike_metric
        self.values: deque[float] = deque(maxlen=options.spike_window)
        self.spikes = 0  # spikes in the run so far
        self.in_a_row = 0  # spikes since the last step taken

    @classmethod
    def for_run(cls, config: Any) -> SpikeDetector | None:
        """The run's detector, or None when ``spike_policy = "off"``."""
        return None if config.resilience.spike_policy == "off" else cls(config.resilience)

    def check(self, step: int, loss: torch.Tensor | float, grad_norm: torch.Tensor | float) -> Spike | None:
        """Judge step ``step`` (finite, agreed by the ranks): a :class:`Spike`, or None after
        putting its value in the window (a step past the warm-up). Reads one number from the
        device: the step's one wait for it was the agreement, so this costs no extra wait."""
        chosen = loss if self.metric == "loss" else grad_norm
        value = float(chosen.item()) if isinstance(chosen, torch.Tensor) else float(chosen)
        if step <= self.options.spike_warmup_steps:
            self.in_a_row = 0
            return None
        if len(self.values) == self.values.maxlen:
            mean, std, threshold = window_statistics(self.values, self.options.spike_sigmas)
            if value > threshold:
                return Spike(step, self.metric, value, mean, std, threshold)
        self.values.append(value)
        self.in_a_row = 0
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "spikes": self.spikes, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: Any) -> None:
        """A checkpoint's state (checked: it comes from a file); a window saved longer than this
        run's keeps its newest values."""
        state = self.checked_state(state)
        self.values = deque((float(value) for value in state["values"]), maxlen=self.options.spike_window)
        self.spikes, self.in_a_row = state["spikes"], state["in_a_row"]

    @staticmethod
    def checked_state(state: Any) -> dict[str, Any]:
        """``state`` if it is a detector's state; else ValueError naming what is wrong (the
        checkpoint is then passed over like a damaged one)."""
        if not isinstance(state, dict) or set(state) != _STATE_KEYS:
            raise ValueError(f"its loss-spike state is not {{{', '.join(sorted(_STATE_KEYS))}}}")
        values = state["values"]
        if not isinstance(values, list) or not all(_is_finite_number(value) for value in values):
            raise ValueError("its loss-spike window is not a list of finite numbers")
        for key in ("spikes", "in_a_row"):
            count = state[key]
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"its loss-spike {key} {count!r} is not a count")
        return state


def _is_finite_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def handle_spike(
    detector: SpikeDetector,
    spike: Spike,
    context: Any,
    train_batches: Any,
    manager: Any,
    roll_back: Any,
    micro_batches: int,
) -> None:
    """Act on ``spike`` as the policy says (the module docstring); the optimizer did not step.
    ``roll_back()``: the loop's rollback to the newest checkpoint (the step restored, or None;
    it records which batches it skips); ``micro_batches``: those the spike step read."""
    options = detector.options
    context.optimizer.zero_grad(set_to_none=True)
    detector.spikes += 1
    detector.in_a_row += 1
    what = (
        f"loss spike at step {spike.step}: {spike.metric} {spike.value:.6g} above {spike.threshold:.6g} (mean "
        f"{spike.mean:.6g} + {options.spike_sigmas:g} x std {spike.std:.6g} of the last {len(detector.values)} steps)"
    )
    fields = {
        "at_step": spike.step,
        "metric": spike.metric,
        "value": spike.value,
        "mean": spike.mean,
        "std": spike.std,
        "threshold": spike.threshold,
        "spikes_in_a_row": detector.in_a_row,
    }
    if detector.in_a_row >= options.max_spike_steps:
        events.record("loss_spike", action="stop", **fields)
        raise SpikesPersist(
            f"{what}; stopping after {detector.in_a_row} spikes in a row (resilience.max_spike_steps = "
            f"{options.max_spike_steps}): the loss stays up. The newest checkpoint is intact; lower the learning "
            "rate or check the data, then run the same command to resume."
        )
    # The spike's forward and backward ran but no step_end follows: per-step state that components
    # accumulated from it (a router's load counts) is discarded before going on.
    manager.call("forge_lm_step_skipped", context=context, step=context.step)
    read = train_batches.batches  # loader batches handed out so far, the spike step's included
    if options.spike_policy == "rollback":
        events.record("loss_spike", action="rollback", **fields)
        spikes, in_a_row = detector.spikes, detector.in_a_row
        restored = roll_back()  # the window comes back as the checkpoint had it; the counts go on
        detector.spikes, detector.in_a_row = spikes, in_a_row
        if restored is not None:
            warn(f"{what}; rolled back to step {restored}, skipping the batches read since (up to batch {read})")
            return
        warn(f"{what}; no checkpoint to roll back to yet: skipped the step instead")
    else:
        events.record("loss_spike", action="skip", skipped_batches=[read - micro_batches + 1, read], **fields)
        warn(f"{what}; skipped the step and its batches {read - micro_batches + 1} to {read}")
