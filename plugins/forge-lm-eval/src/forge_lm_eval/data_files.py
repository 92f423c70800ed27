"""A task file's data files, found beside the task file.

lm-eval passes a task's ``dataset_kwargs.data_files`` to ``datasets.load_dataset`` as written,
so a relative path is relative to the working directory: a task that works from the checkout
fails from anywhere else. Here a relative data file path that exists beside the task file (as
lm-eval's own ``include:`` is read beside it) is made absolute first; any other path is left to
lm-eval's rule. :func:`find_data_files_beside_tasks` installs this once, like the template
sandbox (:mod:`forge_lm_eval.safety`), before any task is loaded.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

from lm_eval.api.task import ConfigurableTask

INLINE = "inline"  # lm-eval's config_source of a task not read from a file


def beside(data_files: Any, task_dir: Path) -> Any:
    """``data_files`` (a path, a list of them, or a mapping of splits to either) with each relative
    path that names something in ``task_dir`` made absolute there."""
    if isinstance(data_files, str):
        if "://" in data_files or Path(data_files).is_absolute():
            return data_files
        candidate = task_dir / data_files
        # A pattern (data/*.jsonl) counts when it matches there; the directory's own name is no pattern.
        found = candidate.exists() or glob.glob(glob.escape(str(task_dir)) + "/" + data_files)
        return str(candidate) if found else data_files
    if isinstance(data_files, list | tuple):
        return [beside(item, task_dir) for item in data_files]
    if isinstance(data_files, dict):
        return {split: beside(files, task_dir) for split, files in data_files.items()}
    return data_files


def find_data_files_beside_tasks() -> None:
    """Make lm-eval's ConfigurableTask look for a task file's relative data files beside it."""
    original = ConfigurableTask.download
    if getattr(original, "_forge_beside_tasks", False):
        return

    def download(self: Any, dataset_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        source = (getattr(self.config, "metadata", None) or {}).get("config_source")
        if isinstance(dataset_kwargs, dict) and "data_files" in dataset_kwargs and source and source != INLINE:
            dataset_kwargs = {
                **dataset_kwargs,
                "data_files": beside(dataset_kwargs["data_files"], Path(source).resolve().parent),
            }
        return original(self, dataset_kwargs, **kwargs)

    download._forge_beside_tasks = True  # type: ignore[attr-defined]
    ConfigurableTask.download = download
