"""Writing checkpoints, and keeping those the retention rules name (:mod:`._retention`).

A checkpoint is complete when its ``trainer_state.json`` exists: it is written (atomically: one
object of an object store, a file renamed into place on a disk) after every tensor file and the
evaluation metrics, and only then is ``latest`` switched to it, so a crash at any moment leaves
``latest`` naming a complete checkpoint and no half-written step is ever taken as the newest.

Before anything is written, every save checks that the run directory is still the one the run
started in (not removed or replaced: :class:`CheckpointPlaceError`, which nothing retries), that
no other run's checkpoint is in the way, and that the weights are finite (:mod:`._finite`:
:class:`NonFiniteWeights`; the run's ``nan_policy`` decides what follows). A write that fails
is retried as many times as the store allows (an object store: a few, after a pause; a disk:
none), its partial step removed each time; then it is a :class:`CheckpointSaveError`, which the
run's save policy handles.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from forge_lm import events
from forge_lm.checkpoint._errors import (
    CheckpointPlaceError,
    CheckpointSaveError,
    NonFiniteWeights,
    describe,
    interrupt_in,
)
from forge_lm.checkpoint._find import FindingCheckpoints
from forge_lm.checkpoint._finite import count_nonfinite, device_of, first_nonfinite, sum_over_ranks
from forge_lm.checkpoint._layout import EVAL_METRICS, LATEST, MAX_METRICS_BYTES
from forge_lm.checkpoint._retention import steps_to_keep
from forge_lm.checkpoint._rng import rng_state
from forge_lm.checkpoint._staging import StagingBuffers
from forge_lm.checkpoint._state import TRAINER_STATE
from forge_lm.checkpoint._tree import merge_rank_skeletons, split
from forge_lm.checkpoint._validate import owner_of, place_problem
from forge_lm.distributed.reduce import any_rank, barrier, distributed, rank
from forge_lm.errors import ForgeError
from forge_lm.notices import warn


class SavingCheckpoints(FindingCheckpoints):
    """The saving half of :class:`forge_lm.checkpoint.CheckpointManager`."""

    keep_last_n: int
    retention: Any
    _metrics: dict[int, dict[str, float]]
    _executor: concurrent.futures.ThreadPoolExecutor | None
    _pending: concurrent.futures.Future | None
    _staging: StagingBuffers
    _restored: Any
    _group: Any

    def note_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """The evaluation results at ``step``: saved beside checkpoint ``step`` (if one is written
        at that step), where keep_best_n ranks them."""
        self._metrics = {step: {k: float(v) for k, v in metrics.items() if _is_number(v)}}

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Checkpoint ``step``: model, optimizer, and ``state`` (plain data and tensors).

        With async saving, the state is copied now into host buffers kept from one save to the
        next (pinned for GPU tensors: :mod:`._staging`) and written in the background; the next
        save (or :meth:`wait`) waits for it first.
        """
        self.wait()
        self._check_root()
        started = time.perf_counter()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        self._check_before_writing(step, model, model_state)
        tensors, skeleton = split({"model": model_state, "optimizer": optimizer_state, "trainer": state}, "state")
        skeleton["rng"] = rng_state()
        skeleton["step"] = step
        json.dumps(skeleton)  # fails now, before anything is written, if something is not plain data
        if distributed():  # pipeline stages hold different parameters: rank 0's file describes them all
            skeleton = _gather_to_rank0(skeleton)
        if skeleton is not None and self.run_id is not None:
            skeleton["run_id"] = self.run_id
        metrics = self._metrics.get(step)
        if self._executor is None:
            self._write(step, tensors, skeleton, started, metrics)
            return
        # The previous background write has finished (wait() above): its buffers can be refilled.
        snapshot = self._staging.stage(tensors)
        self._pending = self._executor.submit(self._write, step, snapshot, skeleton, started, metrics)

    def _check_before_writing(self, step: int, model: torch.nn.Module, model_state: dict[str, Any]) -> None:
        """Raise, on every rank alike and before anything is written, if checkpoint ``step`` must
        not be written: its place is not the run's (rank 0 looks), or the weights are not finite
        (each rank counts its own shards on the device). One all-reduce decides both."""
        name = f"step_{step}"
        problem = place_problem(self.store, self.run_dir, self.run_id, name) if rank() == 0 else None
        device = device_of(model)
        misplaced, nonfinite = sum_over_ranks(
            [torch.tensor(float(problem is not None), device=device), count_nonfinite(model_state, device)]
        )
        if misplaced:
            problem = problem or "its place is not the run's (seen by rank 0)"
            events.record("checkpoint_failed", checkpoint=name, reason=problem)
            raise CheckpointPlaceError(f"not writing checkpoint {name}: {problem}. Nothing was written there.")
        if nonfinite:
            culprit = first_nonfinite(model_state)
            where = f"'{culprit}' holds" if culprit is not None else "another rank's weights hold"
            reason = f"the weights are not finite: {where} NaN or Inf"
            raise NonFiniteWeights(f"not writing checkpoint {name}: {reason}", name, reason)

    def wait(self) -> None:
        """Block until a background save has finished (re-raising its error, if any)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
        self._staging = StagingBuffers()  # the run's last save is written: its host copies can go

    def _write(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        skeleton: dict[str, Any] | None,
        started: float,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Write ``tensors`` (every rank its own) and, on rank 0, ``skeleton`` (None on the others)."""
        name = f"step_{step}"
        path = self.store.location(name)
        main = rank() == 0
        # Rank 0 looks at the directory and decides for everyone: ranks must not branch apart
        # around the collective save.
        if path == self._restored:
            return  # the checkpoint this run resumed from, at the same step: it holds this state already
        attempt = 1
        while True:
            error: BaseException | None = None
            try:
                self._write_step(name, tensors, skeleton, metrics)
            except (*self.store.failures, CheckpointException, KeyboardInterrupt) as exc:  # DCP wraps a rank's error
                error = exc
            # A store that retries needs every rank to agree (a file rank 0 alone writes may fail
            # on rank 0 alone); without retries the run's save policy agrees afterwards, as before.
            retries = self.store.attempts > 1 and distributed()
            if not (any_rank(error is not None, self._group) if retries else error is not None):
                break
            if main:
                with contextlib.suppress(*self.store.failures):
                    self.store.remove(name)
            interrupt = interrupt_in(error) if error is not None else None
            if interrupt is None and attempt < self.store.attempts:
                if main:
                    why = describe(error) if error is not None else "it failed on another rank"
                    warn(
                        f"writing checkpoint '{path}' failed ({why}); trying again "
                        f"({attempt + 1} of {self.store.attempts})"
                    )
                time.sleep(self.store.retry_wait(attempt))
                attempt += 1
                continue
            self._raise_failed(path, error or ForgeError("it failed on another rank"), interrupt, attempt)
        if main:
            events.record(
                "checkpoint_saved",
                checkpoint=name,
                seconds=round(time.perf_counter() - started, 3),
                bytes=self.store.bytes_of(name),
            )
            self._prune()

    def _write_step(
        self,
        name: str,
        tensors: dict[str, torch.Tensor],
        skeleton: dict[str, Any] | None,
        metrics: dict[str, float] | None,
    ) -> None:
        """One attempt at writing step ``name``: tensors, then (rank 0) metrics, the trainer state
        that marks it complete, and ``latest``."""
        main = rank() == 0
        if main:
            self.store.remove(name)  # an incomplete or damaged leftover (the loader passed it over)
        barrier(self._group)  # no rank writes its shard before the leftover is gone
        with _single_process_quietly():
            self.store.save(tensors, name, no_dist=not distributed(), process_group=self._group)
        # dcp.save returns on rank 0 after every rank's shard and the metadata are written.
        if main:
            files = self.store.files(name)
            if metrics:  # before the trainer state, which marks the checkpoint complete
                files.write_text(EVAL_METRICS, json.dumps(metrics, indent=1) + "\n")
            files.write_text(TRAINER_STATE, json.dumps(skeleton, indent=1) + "\n")
            self.store.top.write_text(LATEST, name + "\n")

    def _raise_failed(self, path: Any, exc: BaseException, interrupt: KeyboardInterrupt | None, attempts: int) -> None:
        previous = self.latest()
        if interrupt is not None:  # Ctrl-C while writing: nothing wrong with the disk or the files
            events.record("checkpoint_failed", checkpoint=path.name, reason="interrupted by Ctrl-C")
            raise KeyboardInterrupt(
                f"while writing checkpoint {path.name}, which was removed; the previous checkpoint "
                f"({previous.name if previous else 'none yet'}) is intact"
            ) from None
        tries = f" ({attempts} attempts)" if attempts > 1 else ""
        problem = f"could not write checkpoint '{path}'{tries}: {describe(exc)}{self.store.free_space()}"
        events.record("checkpoint_failed", checkpoint=path.name, reason=problem)
        raise CheckpointSaveError(
            f"{problem}. The previous checkpoint ({previous.name if previous else 'none yet'}) is intact; "
            f"{self.store.fix_for_failed_write}."
        ) from None

    def _prune(self) -> None:
        if not self.keep_last_n:
            return
        self._check_root()
        latest = self.latest()
        # Another run's checkpoints (a shared folder) are neither counted nor removed. A save still
        # being written has no trainer state yet: it is not complete, so not listed.
        ours = {
            int(name[5:]): name for name in self._complete_names() if owner_of(self.store, name) in (None, self.run_id)
        }
        rules = self.retention
        best_n = rules.keep_best_n if rules is not None else 0
        keep = steps_to_keep(
            ours,
            keep_last_n=self.keep_last_n,
            keep_every_n_steps=rules.keep_every_n_steps if rules is not None else 0,
            ranges=rules.keep if rules is not None else (),
            keep_best_n=best_n,
            best_mode=rules.keep_best_mode if rules is not None else "min",
            metric=self._saved_metric(ours, rules.keep_best_metric) if best_n else None,
            protected=[int(latest.name[5:])] if latest is not None else [],
        )
        for step, name in ours.items():
            if step not in keep:
                with contextlib.suppress(*self.store.failures):
                    self.store.remove(name)  # complete checkpoints are plain directories

    def _saved_metric(self, checkpoints: dict[int, str], key: str) -> dict[int, float]:
        """Each checkpoint's saved value of ``key``; one without (no file, unreadable, not a finite
        number: the file is as untrusted as the rest of the checkpoint) is left out."""
        values = {}
        for step, name in checkpoints.items():
            files = self.store.files(name)
            try:
                if files.kind(EVAL_METRICS) != "file" or files.size(EVAL_METRICS) > MAX_METRICS_BYTES:
                    continue
                saved = json.loads(files.read(EVAL_METRICS, MAX_METRICS_BYTES).decode("utf-8"))
            except (*self.store.failures, ForgeError, UnicodeDecodeError, ValueError, RecursionError):
                continue
            if isinstance(saved, dict) and _is_number(saved.get(key)):
                values[step] = float(saved[key])
        return values


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _gather_to_rank0(skeleton: dict[str, Any]) -> dict[str, Any] | None:
    """The skeleton of the whole model on rank 0, which alone writes it; None on the others, which
    have no use for the other ranks' skeletons (gathering them everywhere would move world-size
    times the data for nothing)."""
    main = rank() == 0
    skeletons: list[Any] | None = [None] * dist.get_world_size() if main else None
    dist.gather_object(skeleton, skeletons, dst=0)
    return merge_rank_skeletons(skeletons) if main else None


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns on every call that it assumes one process when none is initialised; that is
    the intent here, and the warning would repeat at every checkpoint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
