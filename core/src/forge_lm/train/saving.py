"""What a run does when a checkpoint cannot be written (disk full, no permission).

The checkpoint manager has already removed the partial step directory and left the previous
checkpoint and ``latest`` alone. The policy here decides whether training goes on:

- a periodic save that fails is a warning, and the next interval tries again;
- after ``checkpoint.max_failed_saves`` failures in a row the run stops with exit code 5;
- the final save, and the save after a preemption signal, are not retried (there is no next
  interval): their failure stops the run with exit code 5 at once.

In a distributed run the ranks agree on whether a save failed, so that all of them go on or
stop together.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from forge_lm.checkpoint import CheckpointSaveError
from forge_lm.distributed.reduce import any_rank
from forge_lm.errors import ForgeError

SAVE_FAILED_EXIT_CODE = 5


class CheckpointSaveFailed(ForgeError):
    """Checkpoints could not be written and the policy stopped the run; the previous one is intact."""

    exit_code = SAVE_FAILED_EXIT_CODE


class SavePolicy:
    def __init__(self, max_failed_saves: int) -> None:
        self.max_failed_saves = max_failed_saves
        self.failed_in_a_row = 0

    def attempt(self, save: Callable[[], None], *, last_chance: bool, why: str = "") -> None:
        """Run ``save``; on a failed write apply the policy. ``last_chance``: no later save
        will follow (the final step, a preemption), so a failure stops the run."""
        error: CheckpointSaveError | None = None
        try:
            save()
        except CheckpointSaveError as exc:
            error = exc
        if not any_rank(error is not None):
            self.failed_in_a_row = 0
            return
        self.failed_in_a_row += 1
        problem = str(error) if error is not None else "a checkpoint could not be written on another rank."
        if last_chance or self.failed_in_a_row >= self.max_failed_saves:
            reason = (
                f"this was the {why or 'last'} save, which cannot be retried"
                if last_chance
                else f"{self.failed_in_a_row} saves in a row failed (checkpoint.max_failed_saves = "
                f"{self.max_failed_saves})"
            )
            raise CheckpointSaveFailed(f"{problem} Stopping: {reason}. Then run the same command to resume.")
        print(
            f"forge: warning: {problem} Training goes on and the next checkpoint interval tries again "
            f"({self.failed_in_a_row} of {self.max_failed_saves} failures in a row allowed).",
            file=sys.stderr,
            flush=True,
        )
