"""Checks of a checkpoint's ``trainer_state.json`` before anything in it is restored.

The file may have been edited by anyone: every field is checked for its type and range, the
step must be the one its directory is named after, and tensor references must be names. A
state that fails is a damaged checkpoint (passed over), never a traceback. Parts whose shape
only their owner knows (the scheduler's and the data loader's state) are compared with the
live objects' own state by :func:`check_like`.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import torch

from forge_lm.checkpoint._safe import DamagedCheckpointError, StepFiles
from forge_lm.plain_data import MAX_DEPTH

TRAINER_STATE = "trainer_state.json"
MAX_STATE_BYTES = 256 * 1024 * 1024
_MT_WORDS = len(random.getstate()[1])  # Mersenne Twister state: 624 words and a position


def read_trainer_state(files: StepFiles, step: int) -> dict[str, Any]:
    """The checked trainer state of the checkpoint whose files are ``files``, named for ``step``."""
    kind = files.kind(TRAINER_STATE)
    if kind == "link":
        raise DamagedCheckpointError(f"{TRAINER_STATE} is a link; checkpoints hold plain files only")
    if kind != "file":
        raise DamagedCheckpointError(f"incomplete: {TRAINER_STATE} is missing (the save was interrupted)")
    if files.size(TRAINER_STATE) > MAX_STATE_BYTES:
        raise DamagedCheckpointError(f"{TRAINER_STATE} is larger than {MAX_STATE_BYTES // 2**20} MiB")
    try:
        state = json.loads(files.read(TRAINER_STATE, MAX_STATE_BYTES).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DamagedCheckpointError(f"{TRAINER_STATE} is not valid JSON: {exc}") from None
    check_trainer_state(state, step)
    return state


def check_trainer_state(state: Any, step: int) -> None:
    _require(isinstance(state, dict), "is not a JSON object")
    missing = {"step", "model", "optimizer", "trainer", "rng"} - set(state)
    _require(not missing, f"lacks {', '.join(sorted(missing))}")
    _require(_is_int(state["step"]) and state["step"] >= 0, "step is not a non-negative integer")
    _require(state["step"] == step, f"claims step {state['step']} but its directory is step_{step}")
    _require(isinstance(state.get("run_id", ""), str), "run_id is not a string")
    for part in ("model", "optimizer", "trainer", "rng"):
        _require(isinstance(state[part], dict), f"{part} is not a JSON object")
    _check_tensor_references(state["model"], "model")
    _check_tensor_references(state["optimizer"], "optimizer")
    _check_trainer(state["trainer"])
    _check_rng(state["rng"])


def _check_trainer(trainer: dict[str, Any]) -> None:
    """The fields the training loop keeps, where present (other callers save other state)."""
    if "tokens_seen" in trainer:
        _require(_is_int(trainer["tokens_seen"]) and trainer["tokens_seen"] >= 0, "tokens_seen is not a count")
    if "tokens_per_step" in trainer:
        _require(_is_int(trainer["tokens_per_step"]) and trainer["tokens_per_step"] > 0, "tokens_per_step is bad")
    for key in ("plugins", "scheduler", "data", "config"):
        _require(isinstance(trainer.get(key, {}), dict), f"{key} is not a JSON object")
    _require(isinstance(trainer.get("manifest", []), list), "manifest is not a list")
    _check_tensor_references(trainer, "trainer")


def _check_rng(rng: dict[str, Any]) -> None:
    python = rng.get("python")
    _require(isinstance(python, list) and len(python) == 3, "rng.python is malformed")
    version, words, gauss = python
    _require(_is_int(version), "rng.python version is not an integer")
    _require(
        isinstance(words, list) and len(words) == _MT_WORDS and all(_is_int(w) and 0 <= w < 2**32 for w in words),
        "rng.python state is malformed",
    )
    _require(gauss is None or (isinstance(gauss, float) and math.isfinite(gauss)), "rng.python gauss is malformed")
    _require(_is_bytes(rng.get("torch"), len(torch.get_rng_state())), "rng.torch is malformed")
    if "cuda_device" in rng:
        _require(_is_bytes(rng["cuda_device"]), "rng.cuda_device is malformed")
    # "cuda" (every visible GPU's state) was written by earlier versions; it is not restored.
    if "cuda" in rng:
        _require(isinstance(rng["cuda"], list) and all(_is_bytes(s) for s in rng["cuda"]), "rng.cuda is malformed")


def _check_tensor_references(tree: Any, where: str, depth: int = 0) -> None:
    _require(depth < MAX_DEPTH, f"{where} is nested too deeply")
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            _require(set(tree) == {"__tensor__"} and isinstance(tree["__tensor__"], str), f"{where} has a bad tensor")
            return
        for value in tree.values():
            _check_tensor_references(value, where, depth + 1)
    elif isinstance(tree, list):
        for value in tree:
            _check_tensor_references(value, where, depth + 1)


def check_like(saved: Any, current: Any, what: str, depth: int = 0, *, equal_lengths: bool = False) -> None:
    """``saved`` (from a checkpoint) has the shape of ``current`` (the live object's state): the
    same keys, and values of the same kinds, so that loading it cannot plant a string where the
    code expects a number. Lists of the live list's length are checked item by item; others
    may differ in length, their items checked against the first live item. With
    ``equal_lengths`` (state with one entry per parameter group, such as a scheduler's) every
    list must have its live list's length."""
    _require(depth < MAX_DEPTH, f"{what} is nested too deeply")
    if isinstance(current, dict):
        _require(isinstance(saved, dict), f"{what} is not a JSON object")
        _require(set(saved) == set(current), f"{what} has keys {sorted(saved)[:6]}, expected {sorted(current)[:6]}")
        for key, value in current.items():
            check_like(saved[key], value, f"{what}.{key}", depth + 1, equal_lengths=equal_lengths)
    elif isinstance(current, list | tuple):
        _require(isinstance(saved, list | tuple), f"{what} is not a list")
        if equal_lengths:
            _require(len(saved) == len(current), f"{what} has {len(saved)} entries, expected {len(current)}")
        if len(saved) == len(current):
            # Item by item: a list of different things (a mixture's sources' states) is checked
            # against its own live items, not all against the first one.
            for index, (item, live) in enumerate(zip(saved, current, strict=True)):
                check_like(item, live, f"{what}[{index}]", depth + 1, equal_lengths=equal_lengths)
        elif current:
            for item in saved:
                check_like(item, current[0], f"{what}[]", depth + 1)
    elif isinstance(current, bool) or current is None:
        _require(isinstance(saved, bool) or saved is None, f"{what} is not a boolean")
    elif isinstance(current, int):
        _require(_is_int(saved), f"{what} is not an integer")
    elif isinstance(current, float):
        number = isinstance(saved, float | int) and not isinstance(saved, bool)
        _require(number and math.isfinite(saved), f"{what} is not a finite number")
    elif isinstance(current, str):
        _require(isinstance(saved, str), f"{what} is not a string")


# Parameter-group values that change as training goes on, restored from the checkpoint once
# they pass their check. Every other group value is a setting, taken from the live optimizer
# (built from this run's config). An optimizer whose groups carry other evolving values names
# them in an ``evolving_group_keys`` attribute (forge_lm.components.EvolvingGroupKeys; restored after
# the type check of every value).
EVOLVING_GROUP_KEYS: dict[str, Any] = {
    "lr": lambda v: _is_number(v) and v >= 0,  # set by the scheduler at every step
    "initial_lr": lambda v: _is_number(v) and v >= 0,  # set by the scheduler when it is built
    "step": lambda v: _is_int(v) and v >= 0,  # schedule-free AdamW's step count
    "lr_sq_sum": lambda v: _is_number(v) and v >= 0,  # schedule-free AdamW's averaging weight
}
# Settings that follow the machine (the kernels available), not the run: a checkpoint saved on
# another machine holds other values, and the live ones are taken without remark.
MACHINE_GROUP_KEYS = frozenset({"fused", "foreach", "capturable", "differentiable"})


def restore_param_groups(saved: Any, live: list[dict[str, Any]], evolving: Any = ()) -> tuple[list[Any], list[str]]:
    """The parameter groups to load, from ``saved`` (a checkpoint's, as plain data) and ``live``
    (the live optimizer's, the same way): as many groups as the live optimizer has, each with its
    keys and kinds of values, its parameters and settings the live group's, its evolving values
    (:data:`EVOLVING_GROUP_KEYS`, ``evolving``) the checkpoint's. Also returns the settings whose
    saved value the live one replaced (``optimizer.param_groups[0].weight_decay``)."""
    _require(isinstance(saved, list), "optimizer.param_groups is not a list")
    _require(
        len(saved) == len(live), f"optimizer.param_groups has {len(saved)} groups; this run's optimizer has {len(live)}"
    )
    extra = set(evolving) if isinstance(evolving, list | tuple | set | frozenset) else set()
    groups: list[Any] = []
    replaced: list[str] = []
    for index, (mine, theirs) in enumerate(zip(saved, live, strict=True)):
        where = f"optimizer.param_groups[{index}]"
        _require(isinstance(mine, dict), f"{where} is not a JSON object")
        names = mine.get("params")
        _require(isinstance(names, list) and all(isinstance(n, str) for n in names), f"{where}.params is malformed")
        # A scheduler adds its keys (initial_lr) to the groups: a checkpoint loaded without one
        # (generate, export) has them where the live groups do not, and the other way round.
        optional = {key for key in EVOLVING_GROUP_KEYS if (key in mine) != (key in theirs)}
        check_like(
            {k: v for k, v in mine.items() if k != "params" and k not in optional},
            {k: v for k, v in theirs.items() if k != "params" and k not in optional},
            where,
            equal_lengths=True,
        )
        group = dict(theirs)
        for key, value in mine.items():
            if key == "params":
                continue
            if key in EVOLVING_GROUP_KEYS:
                _require(EVOLVING_GROUP_KEYS[key](value), f"{where}.{key} is {value!r}, not a value it can have")
                group[key] = value
            elif key in extra:
                group[key] = value
            elif key not in MACHINE_GROUP_KEYS and value != theirs[key]:
                replaced.append(f"{where}.{key}")
        groups.append(group)
    return groups, replaced


def check_optimizer_state(saved: Any, live: Any) -> None:
    """``saved`` (a checkpoint's per-parameter optimizer state, as plain data with tensor
    references) describes parameters the live optimizer has, with its keys and kinds of values,
    and refers to exactly the tensors the live state's references name (so that each is loaded
    into a live tensor of its shape)."""
    _require(isinstance(saved, dict), "optimizer.state is not a JSON object")
    if not isinstance(live, dict):
        return
    for name, entry in saved.items():
        _require(name in live, f"optimizer.state has an entry for '{name}', which this run's optimizer lacks")
        check_like(entry, live[name], f"optimizer.state['{name}']", equal_lengths=True)
        _require(
            _references(entry) == _references(live[name]),
            f"optimizer.state['{name}'] refers to other tensors than this run's optimizer",
        )


def _references(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        if set(tree) == {"__tensor__"}:
            return [tree["__tensor__"]]
        return [ref for key in sorted(tree) for ref in _references(tree[key])]
    if isinstance(tree, list):
        return [ref for item in tree for ref in _references(item)]
    return []


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_bytes(value: Any, length: int | None = None) -> bool:
    return (
        isinstance(value, list)
        and (length is None or len(value) == length)
        and all(_is_int(b) and 0 <= b < 256 for b in value)
    )


def _require(condition: bool, problem: str) -> None:
    if not condition:
        raise DamagedCheckpointError(f"{TRAINER_STATE}: {problem}")
