"""Split nested state into tensors (for DCP) and a plain-data skeleton (for JSON), and back.

A tensor is replaced in the skeleton by ``{"__tensor__": key}``, a tuple by
``{"__tuple__": [...]}`` (optimizers care about tuples such as ``betas``). Anything that is
neither a tensor nor plain data cannot be checkpointed without pickling, so saving it fails
with the path of the offending value.

A value of one rank's own (:class:`PerRank`: PowerSGD's error feedback differs on every rank)
becomes ``{"__rank__": {"<rank>": skeleton}}``, its tensors named ``<path>.rank<rank>``; rank 0's
skeleton, gathered from every rank (:func:`merge_rank_skeletons`), holds every rank's entry, and
:func:`own_rank_parts` keeps only the loading rank's, so that a resume reads no other rank's tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from forge_lm.distributed.reduce import rank as current_rank
from forge_lm.errors import ForgeError

_PLAIN = (bool, int, float, str, type(None))


PER_RANK = "__rank__"


class PerRank:
    """``value`` (tensors and plain data) is ``rank``'s own: saved by that rank under its rank,
    and on a resume read back by the same rank only (None where the checkpoint holds nothing of
    that rank's). ``rank``: the global rank; by default this process's."""

    def __init__(self, value: Any, rank: int | None = None) -> None:
        self.value = value
        self.rank = current_rank() if rank is None else rank


def split(obj: Any, prefix: str) -> tuple[dict[str, torch.Tensor], Any]:
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, PerRank):  # ranks' tensors need names of their own: DCP keeps one per name
            return {PER_RANK: {str(value.rank): walk(value.value, f"{path}.rank{value.rank}")}}
        if isinstance(value, torch.Tensor):
            tensors[path] = value
            return {"__tensor__": path}
        if isinstance(value, _PLAIN):
            return value
        if isinstance(value, tuple):
            return {"__tuple__": [walk(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if not isinstance(key, str | int):
                    raise ForgeError(f"cannot checkpoint '{path}': key {key!r} is not a string or an integer.")
                out[str(key) if isinstance(key, str) else f"__int__{key}"] = walk(item, f"{path}.{key}")
            return out
        raise ForgeError(
            f"cannot checkpoint '{path}': it holds a {type(value).__name__}; checkpoints keep tensors and "
            "plain data (numbers, strings, lists, dicts) only, so that loading never unpickles code."
        )

    return tensors, walk(obj, prefix)


def join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, list):
        return [join(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if set(skeleton) == {"__tensor__"}:
            return tensors[skeleton["__tensor__"]]
        if set(skeleton) == {"__tuple__"}:
            return tuple(join(v, tensors) for v in skeleton["__tuple__"])
        return {(int(k[7:]) if k.startswith("__int__") else k): join(v, tensors) for k, v in skeleton.items()}
    return skeleton


def tensor_keys(skeleton: Any) -> list[str]:
    if isinstance(skeleton, list):
        return [key for v in skeleton for key in tensor_keys(v)]
    if isinstance(skeleton, dict):
        if set(skeleton) == {"__tensor__"}:
            return [skeleton["__tensor__"]]
        return [key for v in skeleton.values() for key in tensor_keys(v)]
    return []


def merge_rank_skeletons(skeletons: list[Any]) -> Any:
    """One skeleton from every rank's: under pipeline parallelism each rank's model and optimizer
    hold other parameters, so the union describes the whole model. Keys present on several
    ranks keep the first rank's value; parameter groups concatenate their ``params`` lists."""
    merged = skeletons[0]
    for other in skeletons[1:]:
        merged = _merge(merged, other)
    return merged


def _merge(first: Any, second: Any) -> Any:
    if isinstance(first, dict) and isinstance(second, dict):
        out = dict(first)
        for key, value in second.items():
            out[key] = _merge(first[key], value) if key in first else value
        return out
    if _is_param_groups(first) and _is_param_groups(second) and len(first) == len(second):
        return [
            {**mine, "params": mine["params"] + [name for name in theirs["params"] if name not in mine["params"]]}
            for mine, theirs in zip(first, second, strict=True)
        ]
    return first


def _is_param_groups(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(group, dict) and "params" in group for group in value)


def own_rank_parts(skeleton: Any, rank: int) -> Any:
    """``skeleton`` with every :class:`PerRank` entry replaced by ``rank``'s part of it (None when
    it has none): what this rank loads, without any other rank's tensors. The skeleton was read
    from a file: an entry that is not a table of parts by rank raises ValueError (a damaged
    checkpoint, passed over)."""
    if isinstance(skeleton, list):
        return [own_rank_parts(v, rank) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if PER_RANK in skeleton:
        parts = skeleton[PER_RANK]
        by_rank = isinstance(parts, dict) and all(key.isascii() and key.isdigit() for key in parts)
        if len(skeleton) != 1 or not by_rank:
            raise ValueError(f"its trainer state holds a malformed {PER_RANK} entry (a table of parts by rank)")
        return parts.get(str(rank))
    return {key: own_rank_parts(value, rank) for key, value in skeleton.items()}


def restrict_to_rank(skeleton: dict[str, Any], model_state: dict[str, Any], optimizer_state: Any) -> dict[str, Any]:
    """The part of a whole-model skeleton that this rank's model and optimizer hold (all of it in
    one process; one stage's parameters under pipeline parallelism)."""
    restricted = {**skeleton, "model": {k: v for k, v in skeleton["model"].items() if k in model_state}}
    saved = skeleton.get("optimizer")
    if not (isinstance(saved, dict) and isinstance(optimizer_state, dict) and "param_groups" in optimizer_state):
        return restricted
    names = set(optimizer_state.get("state", {}))
    names.update(name for group in optimizer_state["param_groups"] for name in group["params"])
    restricted["optimizer"] = {
        **saved,
        "state": {k: v for k, v in saved.get("state", {}).items() if k in names},
        "param_groups": [
            {**group, "params": [name for name in group["params"] if name in names]}
            for group in saved.get("param_groups", [])
        ],
    }
    return restricted
