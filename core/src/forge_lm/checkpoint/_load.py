"""Loading the newest usable checkpoint, trusting nothing read.

Every step directory is tried, newest first, and one is passed over, with the reason, when it
is not a plain directory of plain files where the run keeps its checkpoints, has a trainer state
that fails its checks (:mod:`._state`) or metadata that fails :func:`._safe.read_metadata`, was
written by another run, does not fit the model, or holds weights that are not finite. A
``latest`` that names something else than a step directory of this run is reported and ignored.
The optimizer's saved state must have the live optimizer's groups, keys and kinds of values; only
what evolves in training (learning rates, step counts) is restored from it: its settings come
from the live optimizer, that is from this run's config. Metadata that names code to run stops
loading altogether (:class:`UnsafeCheckpointError`). Of the trainer state's per-rank entries
(:class:`._tree.PerRank`) each rank asks the reader for its own part only.

A step directory without its ``trainer_state.json`` is a save that was cut short, not a
checkpoint: when there is nothing else, loading moves it aside (``step_<N>.incomplete``) and
reports no checkpoint, so that the run starts from step 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from forge_lm.checkpoint._errors import being_written, describe
from forge_lm.checkpoint._find import FindingCheckpoints
from forge_lm.checkpoint._layout import CHECKPOINTS, INCOMPLETE, LATEST
from forge_lm.checkpoint._rng import restore_rng
from forge_lm.checkpoint._safe import DamagedCheckpointError, TensorsOnlyPlanner, UnsafeCheckpointError
from forge_lm.checkpoint._state import TRAINER_STATE, check_optimizer_state, read_trainer_state, restore_param_groups
from forge_lm.checkpoint._tree import join, own_rank_parts, restrict_to_rank, split, tensor_keys
from forge_lm.checkpoint._validate import check_finite_loaded, check_owner, check_place
from forge_lm.checkpoint._write import _single_process_quietly
from forge_lm.components import EvolvingGroupKeys
from forge_lm.distributed.reduce import any_rank, barrier, distributed, from_rank0, rank
from forge_lm.errors import ForgeError
from forge_lm.model.freezing import staged_as_saved
from forge_lm.notices import warn


class LoadingCheckpoints(FindingCheckpoints):
    """The loading half of :class:`forge_lm.checkpoint.CheckpointManager`."""

    _restored: Any

    def load(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        restore: Callable[[dict[str, Any]], None] | None = None,
        only: Any = None,
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
            warn(f"{self.root}/{LATEST}: {ignored.removeprefix(LATEST + ': ')}")
        passed_over = []
        names = [self.store.name_of(only)] if only is not None else self._step_names()
        cut = [name for name in names if name is not None and self._cut_short(name)]
        names, cut, writer = from_rank0((names, cut, self.writer_elsewhere() if cut else None))
        for name in names:
            try:
                if name is None:
                    raise DamagedCheckpointError(f"resolves outside {self.root}")
                state = self._load(name, model, optimizer, restore)
            except UnsafeCheckpointError as exc:
                raise UnsafeCheckpointError(
                    f"refusing to load checkpoint '{self.store.location(name)}': {exc}. Only load checkpoints you "
                    f"trust; remove this one (or move it out of {self.root}) to resume from an older one."
                ) from None
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - damage shows in many ways; an older one may be fine
                in_progress = writer is not None and name in cut
                label = name if name is not None else getattr(only, "name", str(only))
                passed_over.append(f"{label}: {being_written(writer) if in_progress else describe(exc)}")
                continue
            state["passed_over"] = passed_over
            path = self.store.location(name)
            self._restored = path
            if named is not None and named != path and rank() == 0 and int(named.name[5:]) < int(name[5:]):
                warn(
                    f"checkpoint {name} is newer than the one {CHECKPOINTS}/{LATEST} names "
                    f"({named.name}); using {name} (a save finished but {LATEST} was not switched, or "
                    f"{LATEST} was edited)"
                )
            return state
        if passed_over and (only is not None or len(cut) < len(passed_over)):
            raise ForgeError("no usable checkpoint in " + str(self.root) + ":\n  " + "\n  ".join(passed_over))
        if cut and writer is not None:  # the run's first save, still being written: not cut, not ours to move
            raise ForgeError(
                f"no checkpoint in {self.root} yet: {cut[0]} is {being_written(writer)}. Try again once that "
                "save has ended."
            )
        if cut and rank() == 0:  # saves cut short, and nothing else: not checkpoints, moved out of the way
            for name in cut:
                self._move_aside(name)
        barrier()
        return None

    def _move_aside(self, name: str) -> None:
        aside = name + INCOMPLETE
        with contextlib.suppress(*self.store.failures):
            self.store.remove(aside)  # an earlier cut save of the same step
        try:
            self.store.rename(name, aside)
        except self.store.failures as exc:
            warn(f"could not move '{self.store.location(name)}' aside: {describe(exc)}")
            return
        warn(
            f"{name} is not a checkpoint: its save was cut short ({TRAINER_STATE} is missing); "
            f"moved it aside to '{self.store.location(aside)}'"
        )

    def _prepare(self, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
        """What to read from step ``name`` into this rank's model and optimizer; raises if it cannot fit."""
        files = self.store.files(name)
        saved = read_trainer_state(files, check_place(self.store, name))
        check_owner(saved, self.run_id, self.root)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        skeleton = restrict_to_rank(saved, model_state, optimizer_state)
        # Another rank's own state (PowerSGD's errors) is neither asked of the reader nor held here.
        skeleton["trainer"] = own_rank_parts(skeleton["trainer"], rank())
        replaced = _check_optimizer(skeleton, optimizer, optimizer_state)
        reader = self.store.reader(name)
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

    def _load(
        self,
        name: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        restore: Callable[[dict[str, Any]], None] | None,
    ) -> dict[str, Any]:
        problem, prepared = None, None
        try:
            prepared = self._prepare(name, model, optimizer)
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
        check_finite_loaded(model)
        restore_rng(full["rng"])
        path = self.store.location(name)
        state = {"step": full["step"], **full["trainer"], "path": str(path), "settings_from_config": replaced}
        if restore is not None:
            try:
                restore(state)
            except (ForgeError, ValueError, TypeError, KeyError) as exc:
                problem = exc
            if any_rank(problem is not None):
                raise problem or ForgeError("its state did not restore on another rank")
        return state


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
