"""Dynamic loss scaling for ``[train] precision = "fp16"``.

float16 holds numbers up to 65504 and loses gradients below about 6e-8 to zero. The loss is
multiplied by ``scale`` before the backward, so that small gradients stay representable; the
gradients are divided by it again right after (before clipping, the logged ``grad_norm`` and
the optimizer, which all see true gradients). A scale too large overflows: some gradient is
Inf or NaN. Then the step is skipped (no optimizer or scheduler step) and the scale multiplied
by ``backoff_factor``; after ``growth_interval`` steps in a row without overflow it is
multiplied by ``growth_factor``. Those are ``torch.amp.GradScaler``'s rules and names.

Why not ``GradScaler`` itself: its overflow check is per process (per device), and its
unscale walks the gradients one device at a time, where Forge's gradients are DTensors on
several meshes. Forge already agrees on each step's finiteness across every rank in one
all-reduce (``forge_lm.distributed.reduce.agree_on_step``: the gradient norm is global, and a
non-finite one on any rank makes the step bad on all), so an overflow on one rank skips the
step on every rank, whatever the layout; this module keeps only the scale's arithmetic.

The floor: the scale never goes below ``FLOOR`` (1.0). At 1.0 the loss is not scaled any
more, so a non-finite gradient there is not a scaling problem; it counts as a bad step for
``[resilience] nan_policy`` like any other (and so does a non-finite loss at any scale: the
loss is computed before scaling). The scale's state (``scale``, ``growth_tracker``) is in the
checkpoint's trainer state, as JSON numbers, which read back bitwise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from forge_lm import events
from forge_lm.distributed.grads import scale_grads

FLOOR = 1.0


@attrs.define
class LossScaler:
    """The scale and its growth count; ``options`` is the config's ``[train.loss_scale]``."""

    options: Any
    scale: float = attrs.field(default=None)
    growth_tracker: int = 0  # steps in a row without overflow since the scale last changed

    def __attrs_post_init__(self) -> None:
        if self.scale is None:
            self.scale = float(self.options.init_scale)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What to backpropagate: ``loss`` times the scale."""
        return loss * self.scale

    def unscale(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Divide the gradients by the scale (before clipping and the norm)."""
        scale_grads(parameters, 1.0 / self.scale)

    @property
    def at_floor(self) -> bool:
        return self.scale <= FLOOR

    def stepped(self) -> None:
        """A step without overflow: count it, and grow the scale after ``growth_interval`` of them."""
        self.growth_tracker += 1
        if self.growth_tracker >= self.options.growth_interval:
            grown = self.scale * self.options.growth_factor
            if math.isfinite(grown):  # as GradScaler: an infinite scale is never taken
                self.scale = grown
            self.growth_tracker = 0

    def overflowed(self, loss: float, grad_norm: float) -> bool:
        """A step with a finite loss but non-finite gradients. Skipped without counting as bad
        (True: back off the scale, record an ``overflow`` event) unless the scale is at its floor
        (False: the caller applies ``nan_policy``)."""
        if not math.isfinite(loss) or self.at_floor:
            self.growth_tracker = 0
            return False
        before = self.scale
        self.scale = max(self.scale * self.options.backoff_factor, FLOOR)
        self.growth_tracker = 0
        events.record("overflow", loss=loss, grad_norm=grad_norm, scale=before, new_scale=self.scale)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: Any) -> None:
        """Restore a checkpoint's state; a value that is not a scale (an edited file) raises ValueError."""
        state = self.checked_state(state)
        self.scale, self.growth_tracker = float(state["scale"]), state["growth_tracker"]

    @staticmethod
    def checked_state(state: Any) -> dict[str, Any]:
        """``state`` if it is a scaler's state; else ValueError naming what is wrong."""
        if not isinstance(state, dict) or set(state) != {"scale", "growth_tracker"}:
            raise ValueError(f"its loss scaler state is not {{scale, growth_tracker}}: {state!r}")
        scale, tracker = state["scale"], state["growth_tracker"]
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) or scale < FLOOR:
            raise ValueError(f"its loss scale {scale!r} is not a finite number >= {FLOOR}")
        if isinstance(tracker, bool) or not isinstance(tracker, int) or tracker < 0:
            raise ValueError(f"its loss scaler growth_tracker {tracker!r} is not a count")
        return state


def build_loss_scaler(config: Any) -> LossScaler | None:
    """The run's scaler: one for ``precision = "fp16"``, else None (bf16 and fp32 need none)."""
    return LossScaler(config.train.loss_scale) if config.train.precision == "fp16" else None
