"""``[checkpoint] init_from``: a new run starts from another model's weights.

The source is a run directory (its newest usable checkpoint), one of its ``checkpoints/step_<N>``
directories, or a Hugging Face model directory, each loaded by :func:`forge_lm.load_pretrained`
with the checks its command makes (nothing in it is trusted). Only the weights are taken: the
optimizer, the schedule and the data position start fresh. Every name and shape must be the new
``[model]``'s: there is no growth, and a mismatch is refused naming the tensors. The weights are
read and checked before the run directory is written, so a refused source leaves nothing behind.
A run that has a checkpoint of its own resumes from it and ignores ``init_from`` (said once).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from forge_lm.checkpoint import CheckpointManager
from forge_lm.distributed.reduce import rank
from forge_lm.errors import ConfigError, ForgeError

_SHOWN = 5  # mismatched tensors named in a refusal


def read_initial_weights(config: Any, model: torch.nn.Module, manager: Any) -> dict[str, torch.Tensor] | None:
    """The checked weights ``init_from`` names, or None: none named, or the run directory has a
    checkpoint of its own (a resume, which ignores ``init_from``)."""
    source = config.checkpoint.init_from
    if source is None:
        return None
    if not source.strip():
        raise ConfigError("[checkpoint] init_from: empty; name a run directory, a checkpoint or a Hugging Face model.")
    if CheckpointManager(config.train.output_dir).complete():
        if rank() == 0:
            print(
                f"forge: [checkpoint] init_from = '{source}' is ignored: '{config.train.output_dir}' has checkpoints "
                "of its own, and the run resumes from the newest",
                file=sys.stderr,
            )
        return None
    from forge_lm.pretrained import load_pretrained

    try:
        loaded, _ = load_pretrained(Path(source), "cpu", plugins=manager)
    except ForgeError as exc:
        raise ConfigError(
            f"[checkpoint] init_from: {exc} (init_from takes a run directory, one of its checkpoints/step_<N> or a "
            "Hugging Face model directory with config.json)"
        ) from None
    weights = loaded.state_dict()
    _check_fits(weights, get_model_state_dict(model), source)  # names as saved, global shapes under FSDP
    return weights


def load_initial_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy the full (unsharded) ``weights`` into ``model``, sharded or not; every rank holds them."""
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=True))


def _check_fits(weights: dict[str, torch.Tensor], target: dict[str, Any], source: str) -> None:
    problems = [f"'{name}' is missing from the source" for name in target if name not in weights]
    problems += [f"'{name}' is not in this run's model" for name in weights if name not in target]
    problems += [
        f"'{name}' is {list(weights[name].shape)} in the source but {list(target[name].shape)} here"
        for name in target
        if name in weights and tuple(weights[name].shape) != tuple(target[name].shape)
    ]
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise ConfigError(
            f"[checkpoint] init_from: the weights of '{source}' do not fit this run's [model]: "
            f"{'; '.join(problems[:_SHOWN])}{more}. Set [model] to the source's sizes (growing a model is not "
            "supported), or start without init_from."
        )
