"""``forge_lm.load_pretrained``: a trained model and its tokenizer, for notebooks and scripts.

Three kinds of directory load the same way, each through the path its command uses, so the
same checks apply (the files are untrusted: configs validated, memory estimated before any
allocation, checkpoints read without running code, weights' names and shapes compared):

- a run directory (its newest usable checkpoint) or one of its ``checkpoints/step_<N>``
  directories, as ``forge generate`` loads them;
- a Hugging Face model directory (``config.json`` with safetensors weights) of a model type an
  installed plugin converts, as ``forge import-hf`` reads it; its ``tokenizer.json``, if any,
  is the tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

HF_CONFIG = "config.json"


def load_pretrained(path: str | Path, device: str | torch.device = "cpu", *, plugins: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``path``: the model in eval mode on ``device``, ``model(input_ids)``
    giving logits ``[batch, seq, vocab]`` for token ids ``[batch, seq]``, and the tokenizer its
    run trained with (``encode``/``decode``; None for a Hugging Face directory without a
    ``tokenizer.json``).

    ``plugins``: a :class:`forge_lm.plugins.PluginManager` to build components with (default:
    every installed plugin). Raises :class:`forge_lm.errors.ForgeError` (or a subclass) naming
    the problem for anything that is not a loadable model.
    """
    from forge_lm.errors import ForgeError
    from forge_lm.plugins import PluginManager

    manager = plugins if plugins is not None else PluginManager()
    path = Path(path)
    if not path.is_dir():
        raise ForgeError(f"'{path}' is not a directory; give a run directory, a checkpoint or a Hugging Face model.")
    if (path / HF_CONFIG).is_file() and not (path / "trainer_state.json").exists():
        model, tokenizer = _from_hf(path, manager)
    else:
        from forge_lm.train.inference import load_for_inference

        model, _, tokenizer = load_for_inference(path, manager)
    return model.to(device).eval(), tokenizer


def _from_hf(hf_dir: Path, manager: Any) -> tuple[torch.nn.Module, Any]:
    """A Hugging Face directory converted by the first plugin that reads its model type."""
    from forge_lm.config import TrainSection, structure_config
    from forge_lm.errors import ConfigError, ForgeError, UsageError
    from forge_lm.model.hf import build_imported, check_imported_fits, convert_from_hf, load_imported, sized_table

    imported = convert_from_hf(manager, hf_dir)
    table = imported.table
    layers: dict[str, Any] = {
        "model": table,
        # a vision-language table keeps its sizes in [model.language]
        "train": {"seq_len": min(TrainSection().seq_len, sized_table(table)["max_seq_len"])},
    }
    tokenizer_file = hf_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        layers["tokenizer"] = {"name": "hf", "path": str(tokenizer_file.resolve())}
    try:
        config = structure_config(layers, manager.registry)
    except (ConfigError, UsageError) as exc:
        raise ForgeError(
            f"the [model] table that {imported.plugin.label} made from '{imported.config_path}' is not valid: {exc}"
        ) from None
    check_imported_fits(config, manager.registry, imported)
    model = build_imported(config, manager.registry, imported)
    load_imported(model, imported)
    tokenizer = config.tokenizer.build() if tokenizer_file.is_file() else None
    return model, tokenizer
