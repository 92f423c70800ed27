"""The names a run's checkpoints go by, and the run id each one records.

Layout under the run directory::

    checkpoints/step_<N>/            one checkpoint (see :mod:`forge_lm.checkpoint`)
    checkpoints/step_<N>.incomplete  a save cut short, moved aside by loading
    checkpoints/latest               names the newest complete checkpoint
    run_id                           the run's id, which each checkpoint records
"""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
LATEST = "latest"
RUN_ID_FILE = "run_id"  # in the run directory: which run its checkpoints belong to
INCOMPLETE = ".incomplete"  # the suffix of a cut save's directory, moved aside
EVAL_METRICS = "eval_metrics.json"  # in a step directory: the evaluation's results at its step, for keep_best_n
MAX_METRICS_BYTES = 1024 * 1024
SAVE_IN_PROGRESS = "a save in progress"  # what a step directory without its trainer state is while its run trains
STEP_DIR = re.compile(r"step_([0-9]{1,15})")  # ASCII digits only: str.isdigit() accepts other scripts'
_RUN_ID = re.compile(r"[0-9a-f]{32}")


def read_run_id(run_dir: Path) -> str | None:
    """The id in ``<run_dir>/run_id``, or None when there is none (a directory made before run
    ids, a reader's) or it is not one (a link, not a plain file, not 32 hex digits)."""
    path = Path(run_dir) / RUN_ID_FILE
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 64:
            return None
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if _RUN_ID.fullmatch(text) else None


def step_of(path: Path) -> int | None:
    """The step a checkpoint directory is named for, or None if the name is not ``step_<N>``."""
    match = STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None
