"""The run directory: what a run writes besides checkpoints and metrics.

``config.toml`` is the fully resolved config (``forge train <run>/config.toml`` reproduces the
run); ``plugins.json`` is the plugin manifest, so a later reader knows which distributions
and versions produced it.
"""

from __future__ import annotations

import json
from pathlib import Path

from forge_lm.config import ForgeConfig, to_toml
from forge_lm.errors import ConfigError
from forge_lm.plugins import PluginManager

CONFIG_FILE = "config.toml"
MANIFEST_FILE = "plugins.json"


def prepare_run_dir(config: ForgeConfig, manager: PluginManager) -> Path:
    run_dir = Path(config.train.output_dir)
    if (run_dir / CONFIG_FILE).exists():
        raise ConfigError(
            f"[train] output_dir: '{run_dir}' already holds a run ({CONFIG_FILE} exists); choose a new "
            "train.output_dir or remove the old run. Nothing in it was changed."
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG_FILE).write_text(to_toml(config))
        (run_dir / MANIFEST_FILE).write_text(json.dumps(manager.manifest(), indent=2) + "\n")
    except OSError as exc:
        raise ConfigError(f"[train] output_dir: cannot write to '{run_dir}': {exc.strerror}.") from None
    return run_dir
