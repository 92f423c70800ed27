"""What goes wrong with a checkpoint save, and one line for any load or save failure."""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

from forge_lm.checkpoint._layout import SAVE_IN_PROGRESS
from forge_lm.errors import ForgeError


class CheckpointSaveError(ForgeError):
    """A checkpoint could not be written; its partial directory is gone, the previous one intact."""

    retry = True  # whether a later save may succeed (a full disk may be freed)


class CheckpointPlaceError(CheckpointSaveError):
    """The place of a checkpoint is not the run's any more: the run directory was removed or
    replaced, or another run's checkpoint is in the way. Nothing was written; no retry can help."""

    retry = False


class NonFiniteWeights(ForgeError):
    """The weights to save hold NaN or Inf (on some rank): nothing was written."""

    def __init__(self, message: str, checkpoint: str, reason: str) -> None:
        super().__init__(message)
        self.checkpoint, self.reason = checkpoint, reason


def describe(exc: BaseException) -> str:
    """One line for a load or save failure; DCP wraps each rank's error with its whole traceback."""
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, OSError) and inner.strerror:
            return inner.strerror
        return (
            f"{type(inner).__name__}: {inner}" if str(inner) else f"{type(inner).__name__} (damaged or truncated file)"
        )
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    if isinstance(exc, ForgeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def interrupt_in(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (``KeyboardInterrupt``) behind a failed write, or None. DCP catches every
    ``BaseException`` of a rank's write and hands it back wrapped in its own
    :class:`CheckpointException`: unwrapped, a Ctrl-C would read as a damaged file."""
    if isinstance(exc, CheckpointException):
        inner = [error[0] if isinstance(error, tuple) else error for error in exc.failures.values()]
        return next((error for error in inner if isinstance(error, KeyboardInterrupt)), None)
    return exc if isinstance(exc, KeyboardInterrupt) else None


def being_written(writer: str | None) -> str:
    return f"{SAVE_IN_PROGRESS}, by the run training in this directory ({writer})"
