"""The training path: devices and precision, the run directory, the loop, evaluation."""

from forge_lm.train.loop import TrainResult, train

__all__ = ["TrainResult", "train"]
