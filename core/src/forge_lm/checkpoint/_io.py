"""Write checkpoints, keep those the retention rules name (:mod:`._retention`), and load the
newest usable one.

A checkpoint is complete when its ``trainer_state.json`` exists: it is written (atomically)
after every tensor file, and only then is ``checkpoints/latest`` switched to it (atomically),
so a crash at any moment leaves ``latest`` naming a complete checkpoint.

Loading trusts nothing it reads. It tries every ``step_<N>`` directory, newest first (so a
``latest`` edited to name an old checkpoint cannot make a run overwrite newer ones), and
passes over, with the reason, any that is a link or lies outside ``checkpoints/``, holds
anything but plain files, has a trainer state that fails its checks (:mod:`._state`) or
metadata that fails :func:`._safe.read_metadata`, or does not fit the model. A ``latest``
that names something else than a step directory of this run is reported and ignored. The
optimizer's saved state must have the live optimizer's groups, keys and kinds of values; only
what evolves in training (learning rates, step counts) is restored from it: its settings come
from the live optimizer, that is from this run's config. A ``checkpoints`` directory that is a
link is refused outright (loading, saving and pruning).
Metadata that names code to run stops loading altogether (:class:`UnsafeCheckpointError`).

A checkpoint belongs to its run: it records the run's id (``<run>/run_id``, written when the
run directory was made), and loading passes over one another run wrote (two runs whose
``checkpoints/`` is one folder, or a checkpoint copied in); saving never replaces or prunes
one. Before anything is written, every save checks that the run directory is still the one
the run started in (not removed or replaced: :class:`CheckpointPlaceError`, which nothing
retries) and that the weights are finite (:mod:`._finite`: :class:`NonFiniteWeights`; the run's
``nan_policy`` decides what follows). A step directory without its ``trainer_state.json`` is a
save that was cut short, not a checkpoint: when there is nothing else, loading moves it aside
(``step_<N>.incomplete``) and reports no checkpoint, so that the run starts from step 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

from forge_lm import events
from forge_lm.checkpoint._finite import count_nonfinite, device_of, first_nonfinite, sum_over_ranks
from forge_lm.checkpoint._retention import steps_to_keep
from forge_lm.checkpoint._safe import DamagedCheckpointError, SafeReader, TensorsOnlyPlanner, UnsafeCheckpointError
from forge_lm.checkpoint._staging import StagingBuffers
from forge_lm.checkpoint._state import (
    TRAINER_STATE,
    check_optimizer_state,
    read_trainer_state,
    restore_param_groups,
)
from forge_lm.checkpoint._tree import join, merge_rank_skeletons, restrict_to_rank, split, tensor_keys
from forge_lm.components import EvolvingGroupKeys
from forge_lm.distributed.reduce import any_rank, barrier, distributed, from_rank0, rank
from forge_lm.errors import ForgeError
from forge_lm.model.freezing import staged_as_saved

CHECKPOINTS = "checkpoints"
LATEST = "latest"
RUN_ID_FILE = "run_id"  # in the run directory: which run its checkpoints belong to
INCOMPLETE = ".incomplete"  # the suffix of a cut save's directory, moved aside
EVAL_METRICS = "eval_metrics.json"  # in a step directory: the evaluation's results at its step, for keep_best_n
MAX_METRICS_BYTES = 1024 * 1024
SAVE_IN_PROGRESS = "a save in progress"  # what a step directory without its trainer state is while its run trains
_STEP_DIR = re.compile(r"step_([0-9]{1,15})")  # ASCII digits only: str.isdigit() accepts other scripts'
_RUN_ID = re.compile(r"[0-9a-f]{32}")


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
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


class CheckpointManager:
    """Checkpoints of one run directory."""

    def __init__(
        self, run_dir: str | Path, keep_last_n: int = 0, async_save: bool = False, retention: Any = None
    ) -> None:
        """In a distributed run every rank constructs it (collectively) and calls save and load;
        every rank writes its own shards, and rank 0 alone writes the shared files. ``retention``
        is the ``[checkpoint]`` section whose rules beside ``keep_last_n`` say what else to keep
        (:mod:`._retention`); None keeps the newest ``keep_last_n`` only."""
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS
        self.run_id = read_run_id(self.run_dir)  # None: a run made before run ids, or no run
        self.keep_last_n = keep_last_n
        self.retention = retention
        self._metrics: dict[int, dict[str, float]] = {}  # each evaluation's results, by step, until saved
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1) if async_save else None
        self._pending: concurrent.futures.Future | None = None
        self._staging = StagingBuffers()  # host copies for background writes, kept between saves
        self._restored: Path | None = None  # the checkpoint the run was last restored from
        # A background save runs its collectives on a group of its own, so that they never
        # interleave with the training step's collectives on the default group.
        self._group = dist.new_group(backend="gloo") if distributed() and async_save else None

    # -- saving ---------------------------------------------------------------------------------

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
        problem = self._place_problem(self.root / name) if rank() == 0 else None
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

    def _place_problem(self, path: Path) -> str | None:
        """Why ``path`` is not a place to write this run's checkpoint, or None (rank 0 asks)."""
        if self.run_id is not None and read_run_id(self.run_dir) != self.run_id:
            what = "gone" if not os.path.lexists(self.run_dir / RUN_ID_FILE) else "another run's"
            return (
                f"the run directory '{self.run_dir}' was removed or replaced while the run trained (its "
                f"{RUN_ID_FILE} is {what}); a checkpoint written there would belong to no run"
            )
        owner = self._owner(path)
        if owner is not None and owner != self.run_id:
            return (
                f"'{path}' is another run's checkpoint (run id {owner}, this run's is {self.run_id}): two runs "
                f"share '{self.root}'. Give each run its own train.output_dir"
            )
        return None

    @staticmethod
    def _owner(path: Path) -> str | None:
        """The run id a complete checkpoint at ``path`` records, or None (none recorded, not a
        complete checkpoint, unreadable: nothing that stops replacing it)."""
        state_file = path / TRAINER_STATE
        try:
            if path.is_symlink() or state_file.is_symlink() or not state_file.is_file():
                return None
            owner = json.loads(state_file.read_bytes()).get("run_id")
        except (OSError, ValueError, RecursionError, AttributeError):
            return None
        return owner if isinstance(owner, str) else None

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
        path = self.root / f"step_{step}"
        main = rank() == 0
        # Rank 0 looks at the directory and decides for everyone: ranks must not branch apart
        # around the collective save.
        if path == self._restored:
            return  # the checkpoint this run resumed from, at the same step: it holds this state already
        try:
            if main:
                _remove(path)  # an incomplete or damaged leftover (the loader passed it over)
            barrier(self._group)  # no rank writes its shard before the leftover is gone
            with _single_process_quietly():
                dcp.save(tensors, checkpoint_id=str(path), no_dist=not distributed(), process_group=self._group)
            # dcp.save returns on rank 0 after every rank's shard and the metadata are written.
            if main:
                if metrics:  # before the trainer state, which marks the checkpoint complete
                    _write_atomically(path / EVAL_METRICS, json.dumps(metrics, indent=1) + "\n")
                _write_atomically(path / TRAINER_STATE, json.dumps(skeleton, indent=1) + "\n")
                _write_atomically(self.root / LATEST, path.name + "\n")
        except (OSError, CheckpointException, KeyboardInterrupt) as exc:  # DCP wraps a rank's error in its own
            if main:
                with contextlib.suppress(OSError):
                    _remove(path)
            previous = self.latest()
            interrupt = _interrupt_in(exc)
            if interrupt is not None:  # Ctrl-C while writing: nothing wrong with the disk or the files
                events.record("checkpoint_failed", checkpoint=path.name, reason="interrupted by Ctrl-C")
                raise KeyboardInterrupt(
                    f"while writing checkpoint {path.name}, which was removed; the previous checkpoint "
                    f"({previous.name if previous else 'none yet'}) is intact"
                ) from None
            problem = f"could not write checkpoint '{path}': {_describe(exc)}{_free_space(self.root)}"
            events.record("checkpoint_failed", checkpoint=path.name, reason=problem)
            raise CheckpointSaveError(
                f"{problem}. The previous checkpoint ({previous.name if previous else 'none yet'}) is intact; free "
                "disk space or fix the permissions of the run directory."
            ) from None
        if main:
            events.record(
                "checkpoint_saved",
                checkpoint=path.name,
                seconds=round(time.perf_counter() - started, 3),
                bytes=_size_of(path),
            )
            self._prune()

    def _prune(self) -> None:
        if not self.keep_last_n:
            return
        self._check_root()
        latest = self.latest()
        # Another run's checkpoints (a shared folder) are neither counted nor removed. A save still
        # being written has no trainer state yet: complete() does not list it.
        ours = {step_of(p): p for p in self.complete() if self._owner(p) in (None, self.run_id)}
        rules = self.retention
        best_n = rules.keep_best_n if rules is not None else 0
        keep = steps_to_keep(
            ours,
            keep_last_n=self.keep_last_n,
            keep_every_n_steps=rules.keep_every_n_steps if rules is not None else 0,
            ranges=rules.keep if rules is not None else (),
            keep_best_n=best_n,
            best_mode=rules.keep_best_mode if rules is not None else "min",
            metric=_saved_metric(ours, rules.keep_best_metric) if best_n else None,
            protected=[step_of(latest)] if latest is not None else [],
        )
        for step, old in ours.items():
            if step not in keep:
                shutil.rmtree(old, ignore_errors=True)  # complete() lists plain directories only

    def _check_root(self) -> None:
        """Refuse a ``checkpoints`` directory that is a link: saving, pruning and loading through
        it would write, delete and read in some other place than this run."""
        if self.root.is_symlink():
            raise ForgeError(
                f"'{self.root}' is a link (to '{os.readlink(self.root)}'); a run's checkpoints directory must be a "
                "plain directory inside it. Replace the link with the directory it points to (or a copy of it)."
            )

    # -- finding --------------------------------------------------------------------------------

    def latest(self) -> Path | None:
        """The checkpoint ``checkpoints/latest`` names, if it names a step directory of this run."""
        return self._latest()[0]

    def _latest(self) -> tuple[Path | None, str | None]:
        """(what ``latest`` names, or None; why it was ignored, or None)."""
        pointer = self.root / LATEST
        if not pointer.exists() and not pointer.is_symlink():
            return None, None
        if pointer.is_symlink() or not pointer.is_file() or pointer.stat().st_size > 64:
            return None, f"{LATEST}: not a small plain file; ignored"
        try:
            name = pointer.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None, f"{LATEST}: unreadable; ignored"
        if not _STEP_DIR.fullmatch(name):
            return None, f"{LATEST}: names {name!r}, not a step_<N> directory of {self.root}; ignored"
        return self.root / name, None

    def _steps(self) -> list[Path]:
        """Every entry named ``step_<N>``, newest first (whether usable or not)."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if step_of(p) is not None), key=lambda p: -step_of(p))

    def complete(self) -> list[Path]:
        """Complete checkpoints (plain directories with a trainer state), oldest first."""
        return [
            p for p in reversed(self._steps()) if p.is_dir() and not p.is_symlink() and (p / TRAINER_STATE).is_file()
        ]

    def candidates(self) -> list[Path]:
        """Where to resume from, best first: every step directory, newest first. ``latest`` is
        written for people and tools; loading does not depend on it (see the module docstring)."""
        return self._steps()

    # -- loading --------------------------------------------------------------------------------

    def load(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        restore: Callable[[dict[str, Any]], None] | None = None,
        only: Path | None = None,
    ) -> dict[str, Any] | None:
        """Restore the newest usable checkpoint into ``model`` and ``optimizer``; return its
        trainer state (with ``step``, ``path``, ``passed_over``: why newer ones were not
        used, and ``settings_from_config``: the optimizer settings whose saved value differed
        from the live optimizer's, which won), or None when there is none. ``restore(state)``
        restores the rest of the run (scheduler, data position, plugin states); if it raises a ForgeError, ValueError,
        TypeError or KeyError, the checkpoint is passed over like a damaged one.

        ``only``: load this step directory or none (``forge generate run/checkpoints/step_N``).

        In a distributed run every rank calls it; rank 0 names the candidates, and a checkpoint
        that fails on any rank is passed over on all of them."""
        self._check_root()
        named, ignored = self._latest()
        if ignored and rank() == 0:
            print(f"forge: warning: {self.root / LATEST}: {ignored.removeprefix(LATEST + ': ')}", file=sys.stderr)
        passed_over = []
        candidates = [only] if only is not None else self.candidates()
        cut = [p for p in candidates if _cut_short(p)]
        candidates, cut, writer = from_rank0((candidates, cut, self.writer_elsewhere() if cut else None))
        for path in candidates:
            try:
                state = self._load(path, model, optimizer, restore)
            except UnsafeCheckpointError as exc:
                raise UnsafeCheckpointError(
                    f"refusing to load checkpoint '{path}': {exc}. Only load checkpoints you trust; remove this one "
                    f"(or move it out of {self.root}) to resume from an older one."
                ) from None
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - damage shows in many ways; an older one may be fine
                in_progress = writer is not None and path in cut
                passed_over.append(f"{path.name}: {_being_written(writer) if in_progress else _describe(exc)}")
                continue
            state["passed_over"] = passed_over
            self._restored = path
            if named is not None and named != path and rank() == 0 and step_of(named) < step_of(path):
                print(
                    f"forge: warning: checkpoint {path.name} is newer than the one {CHECKPOINTS}/{LATEST} names "
                    f"({named.name}); using {path.name} (a save finished but {LATEST} was not switched, or "
                    f"{LATEST} was edited)",
                    file=sys.stderr,
                )
            return state
        if passed_over and (only is not None or len(cut) < len(passed_over)):
            raise ForgeError("no usable checkpoint in " + str(self.root) + ":\n  " + "\n  ".join(passed_over))
        if cut and writer is not None:  # the run's first save, still being written: not cut, not ours to move
            raise ForgeError(
                f"no checkpoint in {self.root} yet: {cut[0].name} is {_being_written(writer)}. Try again once that "
                "save has ended."
            )
        if cut and rank() == 0:  # saves cut short, and nothing else: not checkpoints, moved out of the way
            for path in cut:
                self._move_aside(path)
        barrier()
        return None

    def _move_aside(self, path: Path) -> None:
        aside = path.with_name(path.name + INCOMPLETE)
        with contextlib.suppress(OSError):
            _remove(aside)  # an earlier cut save of the same step
        try:
            path.rename(aside)
        except OSError as exc:
            print(f"forge: warning: could not move '{path}' aside: {_describe(exc)}", file=sys.stderr)
            return
        print(
            f"forge: warning: {path.name} is not a checkpoint: its save was cut short ({TRAINER_STATE} is missing); "
            f"moved it aside to '{aside}'",
            file=sys.stderr,
        )

    def survey(self) -> list[tuple[Path, str | None]]:
        """Every step directory, newest first, with why it would be passed over (None when it
        passes every check that needs no model: place, trainer state, metadata). Reads the
        same way loading does; loads no tensor. A payload is reported, not raised."""
        found: list[tuple[Path, str | None]] = []
        candidates = self.candidates()
        writer = self.writer_elsewhere() if any(_cut_short(p) for p in candidates) else None
        for path in candidates:
            try:
                self._check_owner(read_trainer_state(path, self._check_place(path)))
                SafeReader(str(path)).read_metadata()
            except UnsafeCheckpointError as exc:
                found.append((path, f"UNSAFE: {exc}"))
            except (ForgeError, OSError) as exc:
                found.append((path, _being_written(writer) if writer and _cut_short(path) else _describe(exc)))
            else:
                found.append((path, None))
        return found

    def writer_elsewhere(self) -> str | None:
        """Who else writes this run's checkpoints now (``pid 12 on host n1, running since ...``):
        another process training in the run directory, which holds its lock; None when none
        does (a step directory without its trainer state is then a save cut short)."""
        from forge_lm.train.run_lock import describe, other_holder  # here: forge_lm.train imports this module

        holder = other_holder(self.root.parent)
        return None if holder is None else describe(holder)

    def _check_owner(self, saved: dict[str, Any]) -> None:
        """A checkpoint another run wrote is not this run's to resume (one recording no run id,
        written before run ids, is anyone's)."""
        owner = saved.get("run_id")
        if owner is not None and self.run_id is not None and owner != self.run_id:
            raise DamagedCheckpointError(
                f"written by another run (run id {owner}; this run's is {self.run_id}): two runs share "
                f"'{self.root}', or it was copied in. Move it out of this run"
            )

    def _check_place(self, path: Path) -> int:
        """The step of ``path``, if it is a plain directory of plain files inside ``checkpoints/``."""
        step = step_of(path)
        if step is None or path.is_symlink() or not path.is_dir():
            raise DamagedCheckpointError("a link or not a directory; checkpoints are plain directories")
        if path.resolve().parent != self.root.resolve():
            raise DamagedCheckpointError(f"resolves outside {self.root}")
        odd = [entry.name for entry in path.iterdir() if entry.is_symlink() or not entry.is_file()]
        if odd:
            raise DamagedCheckpointError(f"holds {odd[0]!r}, which is a link or not a plain file")
        return step

    def _prepare(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any, Any]:
        """What to read from ``path`` into this rank's model and optimizer; raises if it cannot fit."""
        saved = read_trainer_state(path, self._check_place(path))
        self._check_owner(saved)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        skeleton = restrict_to_rank(saved, model_state, optimizer_state)
        replaced = self._check_optimizer(skeleton, optimizer, optimizer_state)
        reader = SafeReader(str(path))
        stored = reader.read_metadata().state_dict_metadata
        # The model's tensors are loaded in place; the optimizer's into its current state's
        # tensors, which carry their sharding (DCP reshards from however the checkpoint was
        # saved); anything else (plugin tensors) into new full tensors, whose sizes the
        # metadata reader has checked against the bytes stored.
        wanted, _ = split({"model": model_state}, "state")
        current, _ = split({"optimizer": optimizer_state}, "state")
        for key in tensor_keys(skeleton):
            if key not in wanted and key in current and key in stored:
                wanted[key] = current[key]
        for key in tensor_keys(skeleton):
            if key not in wanted:
                if key not in stored:
                    raise ForgeError(f"the checkpoint lacks the tensor '{key}' its state names")
                meta = stored[key]
                wanted[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        missing = sorted(set(wanted) - set(stored))
        if missing:
            raise ForgeError(f"it does not fit this model: it has no {', '.join(missing[:3])}")
        for key, tensor in wanted.items():  # a DTensor's shape is the whole tensor's: DCP reshards
            if tuple(stored[key].size) != tuple(tensor.shape):
                raise ForgeError(
                    f"it does not fit this model: '{key}' is {tuple(stored[key].size)} there, "
                    f"{tuple(tensor.shape)} here"
                )
        return wanted, skeleton, reader, replaced

    @staticmethod
    def _check_optimizer(skeleton: dict[str, Any], optimizer: torch.optim.Optimizer, live_state: Any) -> list[str]:
        """Check the saved optimizer state against the live optimizer's and put in ``skeleton`` the
        parameter groups to load (:func:`._state.restore_param_groups`): settings come from the
        live optimizer, built from this run's config. Returns the settings whose saved value differed."""
        if not (isinstance(live_state, dict) and "param_groups" in live_state):
            return []
        _, live = split(live_state, "state.optimizer")
        saved = skeleton["optimizer"]
        check_optimizer_state(saved.get("state", {}), live.get("state"))
        groups, replaced = restore_param_groups(
            saved.get("param_groups"),
            live["param_groups"],
            optimizer.evolving_group_keys if isinstance(optimizer, EvolvingGroupKeys) else (),
        )
        skeleton["optimizer"] = {**saved, "param_groups": groups}
        return replaced

    def _load(
        self,
        path: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        restore: Callable[[dict[str, Any]], None] | None,
    ) -> dict[str, Any]:
        problem, prepared = None, None
        try:
            prepared = self._prepare(path, model, optimizer)
        except UnsafeCheckpointError:
            raise
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported after the ranks agree
            problem = exc
        if any_rank(problem is not None):  # every rank passes over it, or none: no rank waits alone
            raise problem or ForgeError("unusable on another rank")
        wanted, skeleton, reader, replaced = prepared
        with _single_process_quietly():
            dcp.load(wanted, storage_reader=reader, planner=TensorsOnlyPlanner(), no_dist=not distributed())
        full = join(skeleton, wanted)
        saved_state = full["optimizer"].get("state", {}) if isinstance(full["optimizer"], dict) else {}
        with staged_as_saved(model, set(saved_state)):  # staged unfreezing: forge_lm.model.freezing
            set_state_dict(model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optimizer"])
        _check_finite(model)
        restore_rng(full["rng"])
        state = {"step": full["step"], **full["trainer"], "path": str(path), "settings_from_config": replaced}
        if restore is not None:
            try:
                restore(state)
            except (ForgeError, ValueError, TypeError, KeyError) as exc:
                problem = exc
            if any_rank(problem is not None):
                raise problem or ForgeError("its state did not restore on another rank")
        return state


def _check_finite(model: torch.nn.Module) -> None:
    """A loaded checkpoint whose weights are not finite (written before saves checked them) is
    passed over on every rank alike, like a damaged one."""
    state = get_model_state_dict(model)
    (nonfinite,) = sum_over_ranks([count_nonfinite(state, device_of(model))])
    if nonfinite:
        culprit = first_nonfinite(state)
        where = f"'{culprit}' holds" if culprit is not None else "another rank's weights hold"
        raise DamagedCheckpointError(f"its weights are not finite: {where} NaN or Inf")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _saved_metric(checkpoints: dict[int, Path], key: str) -> dict[int, float]:
    """Each checkpoint's saved value of ``key``; one without (no file, unreadable, not a finite
    number: the file is as untrusted as the rest of the checkpoint) is left out."""
    values = {}
    for step, path in checkpoints.items():
        file = path / EVAL_METRICS
        try:
            if file.is_symlink() or not file.is_file() or file.stat().st_size > MAX_METRICS_BYTES:
                continue
            saved = json.loads(file.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            continue
        if isinstance(saved, dict) and _is_number(saved.get(key)):
            values[step] = float(saved[key])
    return values


def _cut_short(path: Path) -> bool:
    """A step directory whose save never finished: a plain directory without a trainer state."""
    return path.is_dir() and not path.is_symlink() and not os.path.lexists(path / TRAINER_STATE)


def _gather_to_rank0(skeleton: dict[str, Any]) -> dict[str, Any] | None:
    """The skeleton of the whole model on rank 0, which alone writes it; None on the others, which
    have no use for the other ranks' skeletons (gathering them everywhere would move world-size
    times the data for nothing)."""
    main = rank() == 0
    skeletons: list[Any] | None = [None] * dist.get_world_size() if main else None
    dist.gather_object(skeleton, skeletons, dst=0)
    return merge_rank_skeletons(skeletons) if main else None


def _being_written(writer: str | None) -> str:
    return f"{SAVE_IN_PROGRESS}, by the run training in this directory ({writer})"


def _interrupt_in(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (``KeyboardInterrupt``) behind a failed write, or None. DCP catches every
    ``BaseException`` of a rank's write and hands it back wrapped in its own
    :class:`CheckpointException`: unwrapped, a Ctrl-C would read as a damaged file."""
    if isinstance(exc, CheckpointException):
        inner = [error[0] if isinstance(error, tuple) else error for error in exc.failures.values()]
        return next((error for error in inner if isinstance(error, KeyboardInterrupt)), None)
    return exc if isinstance(exc, KeyboardInterrupt) else None


def _describe(exc: BaseException) -> str:
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


def _free_space(directory: Path) -> str:
    """`` (12.3 GB free on its disk)``: what a failed write most often lacks, whatever the error
    said (torch's file writer reports a full disk as a position mismatch)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return ""
    return f" ({free / 1e9:.3g} GB free on its disk)"


def _size_of(directory: Path) -> int:
    """Bytes of the files a checkpoint directory holds (0 where it cannot be read)."""
    try:
        return sum(entry.stat().st_size for entry in directory.iterdir() if entry.is_file())
    except OSError:
        return 0


def _remove(path: Path) -> None:
    """Remove a step directory without following a link planted in its place."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def rng_state() -> dict[str, Any]:
    """Every random generator the run uses, as plain data: Python's, the CPU's and this rank's
    own GPU's (only that one: a run may resume where another number of GPUs is visible)."""
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device()).tolist()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda_device" in state and torch.cuda.is_available():
        device = torch.cuda.current_device()
        torch.cuda.set_rng_state(torch.tensor(state["cuda_device"], dtype=torch.uint8), device)


def _write_atomically(path: Path, text: str) -> None:
    scratch = path.with_name(path.name + ".tmp")
    with scratch.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(scratch, path)  # readers see the old file or the new one, never half of one


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns on every call that it assumes one process when none is initialised; that is
    the intent here, and the warning would repeat at every checkpoint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def latest_checkpoint(run_dir: Path) -> Path | None:
    return CheckpointManager(run_dir).latest()
