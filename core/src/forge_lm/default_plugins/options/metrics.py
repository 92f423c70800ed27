"""Options of the built-in metrics backends (:mod:`forge_lm.default_plugins.metrics`).

Named by import path at registration, so that listing plugins imports none of them.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

import attrs

from forge_lm.validators import FieldError, positive


def _inside_the_run_directory(instance: Any, attribute: Any, value: str) -> None:
    # Backends write only inside the run directory (the conformance kit checks it), so a
    # folder option may not be absolute nor climb out with '..'.
    path = PurePath(value)
    if not value or path.is_absolute() or ".." in path.parts:
        raise FieldError(
            attribute.name, f"must be a folder inside the run directory, like 'tensorboard', got {value!r}"
        )


def _smoothing_weight(instance: Any, attribute: Any, value: float) -> None:
    # 1 would never move the average off its start (and its debiasing would divide by 0).
    if not 0.0 <= value < 1.0:
        raise FieldError(attribute.name, f"must be at least 0 and below 1 (0 turns it off), got {value!r}")


@attrs.define
class ConsoleOptions:
    digits: int = attrs.field(default=4, validator=positive)  # significant digits per value
    # Weight of the moving average shown beside the loss (loss_avg), updated at each logged
    # step: avg = smoothing * avg + (1 - smoothing) * loss, debiased; 0 shows no average.
    smoothing: float = attrs.field(default=0.9, validator=_smoothing_weight)


def _a_file_of_the_run_directory(instance: Any, attribute: Any, value: str) -> None:
    path = PurePath(value)
    if not value or path.is_absolute() or len(path.parts) != 1 or value in (".", ".."):
        raise FieldError(
            attribute.name, f"must be a file name inside the run directory, like 'metrics.jsonl', got {value!r}"
        )


@attrs.define
class JsonlOptions:
    filename: str = attrs.field(default="metrics.jsonl", validator=_a_file_of_the_run_directory)


@attrs.define
class TensorboardOptions:
    subdir: str = attrs.field(default="tensorboard", validator=_inside_the_run_directory)  # event files go here
