"""The training path: devices and precision, the run directory, the loop, evaluation.

``train(config, manager)`` is ``forge train``; ``start_run(config, manager)`` opens a
:class:`Run` that the caller steps, saves, restores and evaluates itself (:mod:`forge_lm.train.run`).
"""

from forge_lm.train.loop import TrainResult, train
from forge_lm.train.run import Run, StepOutcome, start_run

__all__ = ["Run", "StepOutcome", "TrainResult", "start_run", "train"]
