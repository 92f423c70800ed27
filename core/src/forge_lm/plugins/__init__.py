"""Plugin discovery, the component registry and the switches that control loading."""

from typing import Any

from forge_lm.plugins._api import API_ATTRIBUTE, PLUGIN_API_VERSION
from forge_lm.plugins._calls import PLUGIN_HOOK_EXIT_CODE, PluginHookFailed
from forge_lm.plugins._categories import CATEGORIES
from forge_lm.plugins._manager import BUILTIN_PLUGINS, CORE_DISTRIBUTION, PluginManager, core_version
from forge_lm.plugins._model import Component, PluginInfo, PluginStatus
from forge_lm.plugins._registry import Registry
from forge_lm.plugins._settings import ENV_ALLOW, ENV_BLOCK, ENV_DISABLE_AUTOLOAD, PluginSettings

__all__ = [
    "API_ATTRIBUTE",
    "BUILTIN_PLUGINS",
    "CATEGORIES",
    "CORE_DISTRIBUTION",
    "ENV_ALLOW",
    "ENV_BLOCK",
    "ENV_DISABLE_AUTOLOAD",
    "PLUGIN_API_VERSION",
    "PLUGIN_HOOK_EXIT_CODE",
    "Component",
    "NoOptions",
    "PluginHookFailed",
    "PluginInfo",
    "PluginManager",
    "PluginSettings",
    "PluginStatus",
    "Registry",
    "core_version",
]


def __getattr__(name: str) -> Any:
    # NoOptions is an attrs class, imported on first use: forge list-plugins imports no attrs.
    if name == "NoOptions":
        from forge_lm.plugins._no_options import NoOptions

        return NoOptions
    raise AttributeError(f"module 'forge_lm.plugins' has no attribute {name!r}")
