"""The run directory: what a run writes besides checkpoints and metrics, and whether it resumes.

``config.toml`` is the fully resolved config (``forge train <run>/config.toml`` reproduces the
run); ``plugins.json`` is the plugin manifest, so a later reader knows which distributions and
versions produced it. Training into a directory that already holds a run resumes it: the new
config may change how the run goes on (steps, intervals, metrics) but not what it trains.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from typing import Any

from forge_lm.config import ForgeConfig, structure_config, to_data, to_toml
from forge_lm.errors import ConfigError
from forge_lm.plugins import PluginManager

CONFIG_FILE = "config.toml"
MANIFEST_FILE = "plugins.json"
# Settings a resumed run may not change: the checkpoint would not fit, or would mean another run.
# The batch size may change (with a warning): a run resumed on another number of ranks adjusts
# the per-rank batch to keep the global batch.
FIXED_ON_RESUME = ("model.", "tokenizer.", "optimizer.name", "train.seq_len", "train.seed")


def prepare_run_dir(config: ForgeConfig, manager: PluginManager) -> tuple[Path, bool]:
    """Create the run directory, or check that ``config`` may resume the run already in it.

    Returns ``(run_dir, resuming)``.
    """
    run_dir = Path(config.train.output_dir)
    if (run_dir / CONFIG_FILE).exists():
        _check_resume(run_dir, config, manager)
        return run_dir, True
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG_FILE).write_text(to_toml(config))
        (run_dir / MANIFEST_FILE).write_text(json.dumps(manager.manifest(), indent=2) + "\n")
    except OSError as exc:
        raise ConfigError(f"[train] output_dir: cannot write to '{run_dir}': {exc.strerror}.") from None
    return run_dir, False


def _check_resume(run_dir: Path, config: ForgeConfig, manager: PluginManager) -> None:
    stored_data = tomllib.loads((run_dir / CONFIG_FILE).read_text())
    try:  # every component the stored run used must still be available
        stored = structure_config(stored_data, manager.registry)
    except ConfigError as exc:
        raise ConfigError(f"cannot resume the run in '{run_dir}': its {CONFIG_FILE} no longer loads: {exc}") from exc
    changed = differences(to_data(stored), to_data(config))
    fixed = [key for key in changed if key.startswith(FIXED_ON_RESUME)]
    if fixed:
        raise ConfigError(
            f"[train] output_dir: '{run_dir}' holds a run with other settings for {', '.join(fixed)}; a resumed "
            f"run cannot change them. Resume with its own config (forge train {run_dir / CONFIG_FILE}) or "
            "choose a new train.output_dir."
        )
    if changed:
        _warn(f"resuming '{run_dir}' with changed settings: {', '.join(changed)}")
        index = len(list(run_dir.glob("config.resume-*.toml"))) + 1
        (run_dir / f"config.resume-{index}.toml").write_text(to_toml(config))
    manifest_path = run_dir / MANIFEST_FILE
    if manifest_path.exists():
        for difference in manifest_differences(json.loads(manifest_path.read_text()), manager.manifest()):
            _warn(f"resuming '{run_dir}': {difference}")


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two plain config trees."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        return [d for key in keys for d in differences(old.get(key), new.get(key), f"{prefix}{key}.")]
    return [] if old == new else [prefix.rstrip(".")]


def manifest_differences(old: list[dict[str, str]], new: list[dict[str, str]]) -> list[str]:
    before = {p["name"]: p for p in old}
    after = {p["name"]: p for p in new}
    notes = [
        f"plugin '{name}' ({before[name]['distribution']}) is no longer loaded" for name in before.keys() - after.keys()
    ]
    notes += [f"plugin '{name}' ({after[name]['distribution']}) is new" for name in after.keys() - before.keys()]
    notes += [
        f"plugin '{name}' changed from {before[name]['distribution']} {before[name]['version']} to "
        f"{after[name]['distribution']} {after[name]['version']}"
        for name in before.keys() & after.keys()
        if (before[name]["distribution"], before[name]["version"])
        != (after[name]["distribution"], after[name]["version"])
    ]
    return sorted(notes)


def _warn(message: str) -> None:
    print(f"forge: warning: {message}", file=sys.stderr, flush=True)
