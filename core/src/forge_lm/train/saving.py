"""What a run does when a checkpoint cannot be written (disk full, no permission).

The checkpoint manager has already removed the partial step directory and left the previous
checkpoint and ``latest`` alone. The policy here decides whether training goes on:

- a periodic save that fails is a warning, and the next interval tries again;
- after ``checkpoint.max_failed_saves`` failures in a row the run stops with exit code 5;
- the final save, and the save after a preemption signal, are not retried (there is no next
  interval): their failure stops the run with exit code 5 at once;
- a save that no retry can help (the run directory was removed or replaced while the run
  trained, another run's checkpoint is in the way: :class:`CheckpointPlaceError`) stops the run
  with exit code 5 at once, writing nothing.

Weights that are not finite are never saved (:class:`NonFiniteWeights`: the step's loss was
finite, but its update made the weights NaN or Inf). That is a non-finite step found late, and
``resilience.nan_policy`` decides as for one: ``rollback`` restores the newest checkpoint (all
of them have finite weights) and goes on past the data read since; ``stop``, and ``skip``
(which cannot undo an update already applied), stop the run with exit code 3, as does a
rollback with no checkpoint to go back to, or ``resilience.max_bad_steps`` such saves in a row.
A ``checkpoint_failed`` event records it, with the ``action`` taken.

In a distributed run the ranks agree on whether a save failed, so that all of them go on or
stop together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from forge_lm import events
from forge_lm.checkpoint import CheckpointSaveError, NonFiniteWeights
from forge_lm.distributed.reduce import any_rank
from forge_lm.errors import ForgeError
from forge_lm.notices import warn
from forge_lm.train.resilience import NonFiniteLoss

SAVE_FAILED_EXIT_CODE = 5


class CheckpointSaveFailed(ForgeError):
    """Checkpoints could not be written and the policy stopped the run; the previous one is intact."""

    exit_code = SAVE_FAILED_EXIT_CODE


class SavePolicy:
    def __init__(
        self, max_failed_saves: int, resilience: Any = None, roll_back: Callable[[], int | None] | None = None
    ) -> None:
        """``resilience``: the run's ``[resilience]`` section (its ``nan_policy`` and
        ``max_bad_steps``; None: stop); ``roll_back()`` restores the newest checkpoint and returns
        its step, or None when there is none."""
        self.max_failed_saves = max_failed_saves
        self.failed_in_a_row = 0
        self.nan_policy = getattr(resilience, "nan_policy", "stop")
        self.max_bad_steps = getattr(resilience, "max_bad_steps", 1)
        self.roll_back = roll_back
        self.nonfinite_in_a_row = 0

    def attempt(self, save: Callable[[], None], *, last_chance: bool, why: str = "") -> None:
        """Run ``save``; on a failed write apply the policy. ``last_chance``: no later save
        will follow (the final step, a preemption), so a failure stops the run."""
        error: CheckpointSaveError | None = None
        try:
            save()
        except CheckpointSaveError as exc:
            error = exc
        except NonFiniteWeights as exc:  # raised on every rank alike (the save's own agreement)
            self._weights_not_finite(exc)
            return
        if not any_rank(error is not None):
            self.failed_in_a_row = self.nonfinite_in_a_row = 0
            return
        self.failed_in_a_row += 1
        problem = str(error) if error is not None else "a checkpoint could not be written on another rank."
        retry = error.retry if error is not None else True  # CheckpointPlaceError: raised on every rank alike
        if last_chance or not retry or self.failed_in_a_row >= self.max_failed_saves:
            reason = (
                "no retry can help"
                if not retry
                else f"this was the {why or 'last'} save, which cannot be retried"
                if last_chance
                else f"{self.failed_in_a_row} saves in a row failed (checkpoint.max_failed_saves = "
                f"{self.max_failed_saves})"
            )
            then = " Then run the same command to resume." if retry else ""
            raise CheckpointSaveFailed(f"{problem} Stopping: {reason}.{then}")
        warn(
            f"{problem} Training goes on and the next checkpoint interval tries again "
            f"({self.failed_in_a_row} of {self.max_failed_saves} failures in a row allowed)."
        )

    def _weights_not_finite(self, error: NonFiniteWeights) -> None:
        """Apply ``nan_policy`` to a save refused because the weights are not finite."""
        self.nonfinite_in_a_row += 1
        what = f"{error} (the step's loss was finite: its update made them so)"
        if self.nan_policy == "rollback" and self.nonfinite_in_a_row < self.max_bad_steps:
            step = self.roll_back() if self.roll_back is not None else None
            action = "rollback" if step is not None else "stop"
            events.record("checkpoint_failed", checkpoint=error.checkpoint, reason=error.reason, action=action)
            if step is None:
                raise NonFiniteLoss(
                    f"{what}; resilience.nan_policy = 'rollback' but there is no checkpoint to roll back to. Lower "
                    "the learning rate or check the optimizer, then start the run again."
                )
            warn(f"{what}; rolled back to step {step} (the newest checkpoint) and going on past the data read since")
            return
        events.record("checkpoint_failed", checkpoint=error.checkpoint, reason=error.reason, action="stop")
        if self.nan_policy == "rollback":
            reason = f"{self.nonfinite_in_a_row} such saves in a row (resilience.max_bad_steps = {self.max_bad_steps})"
        elif self.nan_policy == "skip":
            reason = "resilience.nan_policy = 'skip', which cannot undo an update already applied"
        else:
            reason = f"resilience.nan_policy = '{self.nan_policy}'"
        raise NonFiniteLoss(
            f"{what}; stopping because of {reason}. The newest checkpoint is intact; lower the learning rate or "
            "check the optimizer, then run the same command to resume (resilience.nan_policy = 'rollback' goes "
            "back to it by itself)."
        )
