"""``[checkpoint] init_from``: a new run starts from another model's weights.

The source is a run directory (its newest usable checkpoint), one of its ``checkpoints/step_<N>``
directories, or a Hugging Face model directory, each loaded by :func:`forge_lm.load_pretrained`
with the checks its command makes (nothing in it is trusted). Only the weights are taken: the
optimizer, the schedule and the data position start fresh. Every name and shape must be the new
``[model]``'s, unless ``[checkpoint.growth]`` says how to grow a smaller source
(:mod:`forge_lm.train.growth`); a mismatch no rule covers is refused naming the tensors. The
weights are read, checked and grown before the run directory is written, so a refused source
leaves nothing behind. A grown start prints a table of every tensor (copied, grown or new) and
records it as an ``init_from`` event. A run that has a checkpoint of its own resumes from it and
ignores ``init_from`` (said once).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from forge_lm import events
from forge_lm.checkpoint import CheckpointManager
from forge_lm.distributed.reduce import rank
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.train.growth import Growth, grow, report_lines


@attrs.frozen
class InitialWeights:
    """The weights a run starts from (full, this run's names and shapes), how each was made, and
    where they came from."""

    source: str
    growth: Growth


def read_initial_weights(config: Any, model: torch.nn.Module, manager: Any) -> InitialWeights | None:
    """The checked (and, by ``[checkpoint.growth]``, grown) weights ``init_from`` names, or None:
    none named, or the run directory has a checkpoint of its own (a resume, which ignores
    ``init_from``). Under FSDP every rank calls it (growing gathers the new tensors' initial values)."""
    source = config.checkpoint.init_from
    if source is None:
        return None
    if not source.strip():
        raise ConfigError("[checkpoint] init_from: empty; name a run directory, a checkpoint or a Hugging Face model.")
    if CheckpointManager(config.train.output_dir, location=config.checkpoint.dir).complete():
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
    target = get_model_state_dict(model)  # names as saved, global shapes under FSDP
    growth = grow(loaded.state_dict(), model, target, config.checkpoint.growth, config.train.seed, source)
    return InitialWeights(source, growth)


def load_initial_weights(model: torch.nn.Module, initial: InitialWeights) -> None:
    """Copy the full (unsharded) weights into ``model``, sharded or not (every rank holds them);
    for a grown model, print how each tensor was made and record it as an event."""
    set_model_state_dict(model, initial.growth.weights, options=StateDictOptions(full_state_dict=True, strict=True))
    if not initial.growth.grew:
        return
    if rank() == 0:
        table = "\n".join(report_lines(initial.growth))
        print(f"forge: [checkpoint.growth] grew '{initial.source}' into this run's [model]:\n{table}", file=sys.stderr)
    events.record(
        "init_from",
        source=initial.source,
        tensors=[
            {"name": e.name, "how": e.how, "source": e.source, "shape": list(e.shape), "note": e.note}
            for e in initial.growth.entries
        ],
    )
