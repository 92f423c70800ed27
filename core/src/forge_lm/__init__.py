"""Forge: a plugin ecosystem for pre-training language models with PyTorch.

The distribution is ``forge-lm``, the import package ``forge_lm``, the command ``forge``.
Plugin authors need :data:`hookimpl`, the hooks in :mod:`forge_lm.hookspecs`, the contracts
in :mod:`forge_lm.components` and the conformance kit in :mod:`forge_lm.testing`. Users load a
trained model with :func:`load_pretrained`.
"""

from typing import Any

from forge_lm._import_noise import quiet_when_torch_is_imported
from forge_lm.errors import ConfigError, ForgeError, PluginError, UsageError
from forge_lm.hookspecs import hookimpl
from forge_lm.plugins import PLUGIN_API_VERSION, core_version

__version__ = core_version()

# Any process that uses Forge (the CLI, a notebook calling load_pretrained) is spared torchao's
# import-time lines, from the moment torch is imported; see forge_lm._import_noise.
quiet_when_torch_is_imported()


def load_pretrained(path: Any, device: Any = "cpu", **kwargs: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a run directory, a checkpoint directory or a Hugging Face
    model directory; see :func:`forge_lm.pretrained.load_pretrained`. (Imported on call: torch
    is not loaded with ``forge_lm``.)"""
    from forge_lm.pretrained import load_pretrained as load

    return load(path, device, **kwargs)


__all__ = [
    "PLUGIN_API_VERSION",
    "ConfigError",
    "ForgeError",
    "PluginError",
    "UsageError",
    "__version__",
    "hookimpl",
    "load_pretrained",
]
