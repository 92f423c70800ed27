"""``forge export-hf`` and ``forge import-hf`` convert only through the ``forge_lm_hf_export`` /
``forge_lm_hf_import`` hooks: the first plugin that answers converts (the core's Llama and
Qwen3 conversion, :mod:`forge_lm.model.hf.llama`, is asked last), and what it returns is
checked before anything is written or built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from forge_lm.config import ModelSection
from forge_lm.errors import ForgeError
from forge_lm.model.hf.files import read_hf, write_hf
from forge_lm.model.hf_fields import CONFIG_FILE, listed, shown
from forge_lm.plugins import PluginHookFailed


def _checked_conversion(converted: Any, hook: str, shape: str, plugin: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``plugin``'s conversion hook returned, if it has the documented shape."""
    if not (
        isinstance(converted, tuple)
        and len(converted) == 2
        and all(isinstance(part, dict) and all(isinstance(k, str) for k in part) for part in converted)
    ):
        raise ForgeError(
            f"{plugin.label} returned {type(converted).__name__} from {hook}, not {shape}. This is a bug in the "
            f"plugin: report it to its authors, or run without it (--block-plugin {plugin.name})."
        )
    return converted


def _first_answer(manager: Any, hook: str, **kwargs: Any) -> tuple[Any, Any] | None:
    """``(plugin, result)`` of the first plugin whose ``hook`` answers, as ``manager.call_first``
    asks them (a converter's :class:`ForgeError` passes through), or None."""
    results = manager._call_each(hook, lambda _: kwargs, first=True, passes=(ForgeError,))
    return results[0] if results else None


def _askers(manager: Any, hook: str) -> str:
    """The plugins implementing ``hook``, in the order they are asked, for messages."""
    names = [impl.plugin_name for impl in reversed(getattr(manager.hook, hook).get_hookimpls())]
    return ", ".join(manager.plugin(name).label for name in names) or "none"


def export_with_plugins(
    manager: Any, model: nn.Module, config: ModelSection, out_dir: str | Path, *, eos_id: int | None = None
) -> Path:
    """Export through the first plugin that converts ``model`` (``forge_lm_hf_export``; the
    core's Llama conversion is asked last). Refuses a model that no installed plugin converts."""
    answer = _first_answer(manager, "forge_lm_hf_export", model=model, config=config)
    if answer is None:
        ffn = getattr(config, "ffn", None)
        made_of = (
            f"its feed-forward is [model.ffn] name = '{ffn.name}'"
            if ffn is not None
            else f"it is a {type(model).__name__} of another model family"
        )
        raise ForgeError(
            f"this model has no Hugging Face equivalent that an installed plugin writes: {made_of}, and no "
            "plugin's forge_lm_hf_export converts it (asked: "
            f"{_askers(manager, 'forge_lm_hf_export')}). Keep it in Forge's own checkpoint format, or install "
            "the plugin that converts such models."
        )
    plugin, converted = answer
    hf_config, state = _checked_conversion(converted, "forge_lm_hf_export", "(config.json dict, HF state dict)", plugin)
    return write_hf(out_dir, {**hf_config, "eos_token_id": eos_id}, state)


# What a [model] table from forge_lm_hf_import must state itself (Forge's defaults are no
# model's sizes): each a positive integer.
IMPORTED_SIZES = ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len")


def sized_table(table: dict[str, Any]) -> dict[str, Any]:
    """The table of an imported ``[model]`` that states the sizes: the table itself, or, for a
    family that nests its language model (a vision-language model's ``[model.language]``) and
    states none of them at its own level, that one."""
    nested = table.get("language")
    if isinstance(nested, dict) and not any(key in table for key in IMPORTED_SIZES):
        return nested
    return table


@dataclass(frozen=True)
class HFImport:
    """A Hugging Face model directory converted by a plugin's ``forge_lm_hf_import``: the
    ``[model]`` table, the Forge state dict, the plugin that converted it (its ``label`` and
    ``name`` for messages) and the ``config.json`` it was read from."""

    table: dict[str, Any]
    state: dict[str, torch.Tensor]
    plugin: Any
    config_path: Path


def convert_from_hf(manager: Any, hf_dir: str | Path) -> HFImport:
    """The model of ``hf_dir`` through the first plugin that understands its model type
    (``forge_lm_hf_import``; the core's Llama conversion is asked last). Refuses a model type
    that no installed plugin imports, and a plugin's answer that is not a usable table and
    state dict (naming the plugin)."""
    hf_config, hf_state = read_hf(hf_dir)
    try:
        answer = _first_answer(manager, "forge_lm_hf_import", hf_config=hf_config, state=hf_state)
    except PluginHookFailed:
        raise
    except ForgeError as exc:
        # A converter sees the contents of the directory, not where it is: name it here.
        raise ForgeError(f"'{hf_dir}': {exc}") from None
    config_path = Path(hf_dir) / CONFIG_FILE
    if answer is None:
        from forge_lm.plugins._hints import KNOWN_HF_MODEL_TYPES

        kind = hf_config.get("model_type")
        provider = KNOWN_HF_MODEL_TYPES.get(kind) if isinstance(kind, str) else None
        fix = (
            f"The package {provider} converts it: pip install {provider} (or enable it if it is installed)"
            if provider is not None
            else "Install the plugin that converts that model type"
        )
        raise ForgeError(
            f"'{config_path}' has model_type {kind!r}, which no installed plugin imports (asked: "
            f"{_askers(manager, 'forge_lm_hf_import')}). {fix}; forge list-plugins shows what is installed."
        )
    plugin, converted = answer
    table, state = _checked_conversion(converted, "forge_lm_hf_import", "([model] table, Forge state dict)", plugin)
    sizes = sized_table(table)
    problems = [f"no {key}" for key in IMPORTED_SIZES if key not in sizes]
    problems += [
        f"{key} = {shown(sizes[key])}, not a positive integer"
        for key in (*IMPORTED_SIZES, "n_kv_heads")
        if key in sizes and not (key == "n_kv_heads" and sizes[key] is None) and not _positive_int(sizes[key])
    ]
    not_tensors = [name for name, value in state.items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        problems.append(f"state entries that are not tensors: {listed(not_tensors)}")
    if problems:
        raise ForgeError(
            f"{plugin.label} converted '{config_path}' with forge_lm_hf_import into an unusable [model] table or "
            f"state dict: {'; '.join(problems)}. This is a bug in the plugin: report it to its authors, or run "
            f"without it (--block-plugin {plugin.name})."
        )
    return HFImport(table, state, plugin, config_path)


def import_with_plugins(manager: Any, hf_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``([model] table, Forge state dict)`` of ``hf_dir``, as :func:`convert_from_hf` converts it."""
    imported = convert_from_hf(manager, hf_dir)
    return imported.table, imported.state


def state_mismatches(expected: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> list[str]:
    """How ``state`` differs from ``expected`` (a built model's state dict) in names and shapes,
    one line each; empty when it loads into that model."""
    problems = [f"{name} is missing" for name in expected if name not in state]
    problems += [f"{name} is not a weight of the model" for name in state if name not in expected]
    problems += [
        f"{name} is {list(state[name].shape)}, the model's is {list(tensor.shape)}"
        for name, tensor in expected.items()
        if name in state and state[name].shape != tensor.shape
    ]
    return problems


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
