"""One run's checkpoints: :class:`CheckpointManager`, which finds (:mod:`._find`), writes
(:mod:`._write`) and loads (:mod:`._load`) them wherever its store keeps them (:mod:`._store`)."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import torch.distributed as dist

from forge_lm.checkpoint._layout import read_run_id
from forge_lm.checkpoint._load import LoadingCheckpoints
from forge_lm.checkpoint._staging import StagingBuffers
from forge_lm.checkpoint._store import open_store
from forge_lm.checkpoint._write import SavingCheckpoints
from forge_lm.distributed.reduce import distributed


class CheckpointManager(SavingCheckpoints, LoadingCheckpoints):
    """Checkpoints of one run directory."""

    def __init__(
        self,
        run_dir: str | Path,
        keep_last_n: int = 0,
        async_save: bool = False,
        retention: Any = None,
        location: str | None = None,
    ) -> None:
        """In a distributed run every rank constructs it (collectively) and calls save and load;
        every rank writes its own shards, and rank 0 alone writes the shared files. ``retention``
        is the ``[checkpoint]`` section whose rules beside ``keep_last_n`` say what else to keep
        (:mod:`._retention`); None keeps the newest ``keep_last_n`` only. ``location``: where the
        checkpoints are kept (``[checkpoint] dir``); None: ``<run_dir>/checkpoints``."""
        self.run_dir = Path(run_dir)
        self.store = open_store(self.run_dir, location)
        self.root = self.store.root
        self.run_id = read_run_id(self.run_dir)  # None: a run made before run ids, or no run
        self.keep_last_n = keep_last_n
        self.retention = retention
        self._metrics: dict[int, dict[str, float]] = {}  # each evaluation's results, by step, until saved
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1) if async_save else None
        self._pending: concurrent.futures.Future | None = None
        self._staging = StagingBuffers()  # host copies for background writes, kept between saves
        self._restored: Any = None  # the checkpoint the run was last restored from
        # A background save runs its collectives on a group of its own, so that they never
        # interleave with the training step's collectives on the default group.
        self._group = dist.new_group(backend="gloo") if distributed() and async_save else None


def latest_checkpoint(run_dir: Path, location: str | None = None) -> Any:
    return CheckpointManager(run_dir, location=location).latest()
