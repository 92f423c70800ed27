"""Write checkpoints, keep the newest few, and load the newest usable one.

A checkpoint is complete when its ``trainer_state.json`` exists: it is written (atomically)
after every tensor file, and only then is ``checkpoints/latest`` switched to it (atomically),
so a crash at any moment leaves ``latest`` naming a complete checkpoint. Loading tries the
one ``latest`` names, then older ones, reporting why each unusable one was passed over.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from forge_lm.checkpoint._safe import SafeReader, TensorsOnlyPlanner, UnsafeCheckpointError
from forge_lm.checkpoint._tree import join, merge_rank_skeletons, restrict_to_rank, split, tensor_keys
from forge_lm.distributed.reduce import any_rank, barrier, distributed, from_rank0, rank
from forge_lm.errors import ForgeError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"


class CheckpointManager:
    """Checkpoints of one run directory."""

    def __init__(self, run_dir: str | Path, keep_last_n: int = 0, async_save: bool = False) -> None:
        """In a distributed run every rank constructs it (collectively) and calls save and load;
        every rank writes its own shards, and rank 0 alone writes the shared files."""
        self.root = Path(run_dir) / CHECKPOINTS
        self.keep_last_n = keep_last_n
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1) if async_save else None
        self._pending: concurrent.futures.Future | None = None
        # A background save runs its collectives on a group of its own, so that they never
        # interleave with the training step's collectives on the default group.
        self._group = dist.new_group(backend="gloo") if distributed() and async_save else None

    # -- saving ---------------------------------------------------------------------------------

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Checkpoint ``step``: model, optimizer, and ``state`` (plain data and tensors).

        With async saving, the state is copied now and written in the background; the next
        save (or :meth:`wait`) waits for it first.
        """
        self.wait()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        tensors, skeleton = split({"model": model_state, "optimizer": optimizer_state, "trainer": state}, "state")
        skeleton["rng"] = rng_state()
        skeleton["step"] = step
        json.dumps(skeleton)  # fails now, before anything is written, if something is not plain data
        if distributed():  # pipeline stages hold different parameters: describe them all
            skeletons: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(skeletons, skeleton)
            skeleton = merge_rank_skeletons(skeletons)
        if self._executor is None:
            self._write(step, tensors, skeleton)
            return
        snapshot = {key: value.detach().to("cpu", copy=True) for key, value in tensors.items()}
        self._pending = self._executor.submit(self._write, step, snapshot, skeleton)

    def wait(self) -> None:
        """Block until a background save has finished (re-raising its error, if any)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()

    def _write(self, step: int, tensors: dict[str, torch.Tensor], skeleton: dict[str, Any]) -> None:
        path = self.root / f"step_{step}"
        main = rank() == 0
        # Rank 0 looks at the directory and decides for everyone: ranks must not branch apart
        # around the collective save.
        if from_rank0(self.latest() == path if main else None, self._group):
            return  # already the newest complete checkpoint (e.g. saved again right after resuming)
        try:
            if main and path.exists():
                shutil.rmtree(path)  # an incomplete leftover of an interrupted save
            barrier(self._group)  # no rank writes its shard before the leftover is gone
            with _single_process_quietly():
                dcp.save(tensors, checkpoint_id=str(path), no_dist=not distributed(), process_group=self._group)
            # dcp.save returns on rank 0 after every rank's shard and the metadata are written.
            if main:
                _write_atomically(path / TRAINER_STATE, json.dumps(skeleton, indent=1) + "\n")
                _write_atomically(self.root / LATEST, path.name + "\n")
        except OSError as exc:
            shutil.rmtree(path, ignore_errors=True)
            previous = self.latest()
            raise ForgeError(
                f"could not write checkpoint '{path}': {exc.strerror or exc}. The previous checkpoint "
                f"({previous.name if previous else 'none yet'}) is intact; free disk space or fix the "
                "permissions of the run directory, then run the same command again to resume."
            ) from exc
        if main:
            self._prune()

    def _prune(self) -> None:
        if not self.keep_last_n:
            return
        latest = self.latest()
        complete = [p for p in self.complete() if p != latest]
        for old in complete[: max(0, len(complete) - (self.keep_last_n - 1))]:
            shutil.rmtree(old, ignore_errors=True)

    # -- finding --------------------------------------------------------------------------------

    def latest(self) -> Path | None:
        pointer = self.root / LATEST
        if not pointer.exists():
            return None
        return self.root / pointer.read_text().strip()

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        steps = [p for p in self.root.glob("step_*") if (p / TRAINER_STATE).exists() and p.name[5:].isdigit()]
        return sorted(steps, key=lambda p: int(p.name[5:]))

    def candidates(self) -> list[Path]:
        """Where to resume from, best first: what ``latest`` names, then newer-to-older."""
        steps = sorted((p for p in self.root.glob("step_*") if p.name[5:].isdigit()), key=lambda p: -int(p.name[5:]))
        latest = self.latest()
        return ([latest] if latest else []) + [p for p in steps if p != latest]

    # -- loading --------------------------------------------------------------------------------

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """Restore the newest usable checkpoint into ``model`` and ``optimizer``; return its
        trainer state (with ``step``), or None when there is none. Unusable ones are reported.

        In a distributed run every rank calls it; rank 0 names the candidates, and a checkpoint
        that fails on any rank is passed over on all of them."""
        passed_over = []
        for path in from_rank0(self.candidates()):
            try:
                state = self._load(path, model, optimizer)
            except UnsafeCheckpointError:
                raise
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - damage shows in many ways; an older one may be fine
                passed_over.append(f"{path.name}: {_describe(exc)}")
                continue
            state["passed_over"] = passed_over
            return state
        if passed_over:
            raise ForgeError("no usable checkpoint in " + str(self.root) + ":\n  " + "\n  ".join(passed_over))
        return None

    def _prepare(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any, Any]:
        """What to read from ``path`` into this rank's model and optimizer; raises if it cannot fit."""
        state_file = path / TRAINER_STATE
        if not state_file.exists():
            raise ForgeError(f"incomplete: {TRAINER_STATE} is missing (the save was interrupted)")
        model_state, optimizer_state = get_state_dict(model, optimizer)
        skeleton = restrict_to_rank(json.loads(state_file.read_text()), model_state, optimizer_state)
        reader = SafeReader(str(path))
        stored = reader.read_metadata().state_dict_metadata
        # The model's tensors are loaded in place; the optimizer's into its current state's
        # tensors, which carry their sharding (DCP reshards from however the checkpoint was
        # saved); anything else (plugin tensors) into new full tensors.
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
        return wanted, skeleton, reader

    def _load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        problem, prepared = None, None
        try:
            prepared = self._prepare(path, model, optimizer)
        except UnsafeCheckpointError:
            raise
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported after the ranks agree
            problem = exc
        if any_rank(problem is not None):  # every rank passes over it, or none: no rank waits alone
            raise problem or ForgeError("unusable on another rank")
        wanted, skeleton, reader = prepared
        with _single_process_quietly():
            dcp.load(wanted, storage_reader=reader, planner=TensorsOnlyPlanner(), no_dist=not distributed())
        full = join(skeleton, wanted)
        set_state_dict(model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optimizer"])
        restore_rng(full["rng"])
        return {"step": full["step"], **full["trainer"], "path": str(path)}


def _describe(exc: BaseException) -> str:
    """One line for a load failure; DCP wraps each rank's error with its whole traceback."""
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))[0]
        return (
            f"{type(inner).__name__}: {inner}" if str(inner) else f"{type(inner).__name__} (damaged or truncated file)"
        )
    return str(exc) or type(exc).__name__


def rng_state() -> dict[str, Any]:
    """Every random generator the run uses, as plain data."""
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


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


def load_for_inference(path: str | Path, manager: Any) -> tuple[torch.nn.Module, Any, Any]:
    """``(model, config, tokenizer)`` from a run directory (its newest usable checkpoint) or a
    checkpoint directory. The model is rebuilt from the run's resolved ``config.toml`` with the
    components the installed plugins provide; it is returned in eval mode on CPU."""
    from forge_lm.config import load_config
    from forge_lm.model import build_model
    from forge_lm.train.components import build
    from forge_lm.train.run_dir import CONFIG_FILE

    path = Path(path)
    single = (path / TRAINER_STATE).exists()
    run_dir = path.parent.parent if single else path
    if not (run_dir / CONFIG_FILE).exists():
        raise ForgeError(
            f"'{path}' is neither a run directory nor a checkpoint in one; give a directory holding "
            f"{CONFIG_FILE} and {CHECKPOINTS}/, or a {CHECKPOINTS}/step_<N> directory."
        )
    config = load_config(run_dir / CONFIG_FILE, [], manager.registry)
    tokenizer = build(manager.registry, "tokenizers", config.tokenizer)
    model = build_model(config.model, config.model.vocab_size or tokenizer.vocab_size, manager.registry)
    optimizer = build(manager.registry, "optimizers", config.optimizer, model)
    checkpoints = CheckpointManager(run_dir)
    if single:
        checkpoints.candidates = lambda: [path]  # exactly this one
    if checkpoints.load(model, optimizer) is None:
        raise ForgeError(f"run directory '{run_dir}' has no checkpoint yet; train it first.")
    return model.eval(), config, tokenizer
