"""Forge: a plugin ecosystem for pre-training language models with PyTorch.

The distribution is ``forge-lm``, the import package ``forge_lm``, the command ``forge``.
Plugin authors need :data:`hookimpl`, the hooks in :mod:`forge_lm.hookspecs`, the contracts
in :mod:`forge_lm.components` and the conformance kit in :mod:`forge_lm.testing`.
"""

from forge_lm.errors import ConfigError, ForgeError, PluginError, UsageError
from forge_lm.hookspecs import hookimpl
from forge_lm.plugins import PLUGIN_API_VERSION, core_version

__version__ = core_version()

__all__ = [
    "PLUGIN_API_VERSION",
    "ConfigError",
    "ForgeError",
    "PluginError",
    "UsageError",
    "__version__",
    "hookimpl",
]
