"""``forge config show|validate``."""

from __future__ import annotations

import sys

from forge_lm.config import load_config, to_toml
from forge_lm.plugins import PluginManager


def config_command(manager: PluginManager, action: str, path: str | None, overrides: list[str]) -> int:
    config = load_config(path, overrides, manager.registry)
    manager.configure(config)
    if action == "show":
        sys.stdout.write(to_toml(config))
    else:
        print(f"{path or 'the default config'} is valid.")
    return 0
