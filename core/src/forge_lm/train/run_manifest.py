"""``plugins.json``: which plugins a run was trained with, and what changed at a resume.

The file holds one entry (name, distribution, version) per loaded plugin, then one per installed
plugin that did not load because it is ``incompatible`` or ``broken``, with its ``status`` and
``reason`` (those took no part in the run), so that a later reader knows which distributions and
versions produced the run. A resume compares the loaded entries with its own plugins and warns
about each difference; a file that cannot be read is replaced, with a warning."""

from __future__ import annotations

import json
from pathlib import Path

from forge_lm.plugins import PluginManager, PluginStatus

MANIFEST_FILE = "plugins.json"
# Plugins that are installed but did not load for a reason the user did not choose; recorded
# so that a run's plugins.json tells why a plugin someone expected took no part in it.
_RECORDED_UNLOADED = (PluginStatus.INCOMPATIBLE, PluginStatus.BROKEN)


def manifest_record(manager: PluginManager) -> list[dict[str, str]]:
    """What ``plugins.json`` holds: the loaded plugins (``manager.manifest()``), then each
    incompatible or broken one with its ``status`` and ``reason``."""
    unloaded = [
        {
            "name": p.name,
            "distribution": p.distribution,
            "version": p.version,
            "status": str(p.status),
            "reason": p.reason or "",
        }
        for p in sorted(manager.plugins, key=lambda p: p.name)
        if p.status in _RECORDED_UNLOADED
    ]
    return [*manager.manifest(), *unloaded]


def manifest_text(manager: PluginManager) -> str:
    """What ``plugins.json`` holds, as its text."""
    return json.dumps(manifest_record(manager), indent=2) + "\n"


def loaded_entries(manifest: list[dict[str, str]]) -> list[dict[str, str]]:
    """The entries of a stored ``plugins.json`` that took part in the run (older files have no status)."""
    return [p for p in manifest if p.get("status", str(PluginStatus.OK)) == PluginStatus.OK]


def read_manifest(path: Path) -> tuple[list[dict[str, str]], str]:
    """The stored plugin manifest, or what is wrong with it."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 and bad JSON are ValueErrors; nesting recurses
        return [], f"its {MANIFEST_FILE} is not valid JSON ({exc}), so whether the plugins changed cannot be told"
    except OSError as exc:
        return [], f"its {MANIFEST_FILE} cannot be read ({exc.strerror}), so whether the plugins changed cannot be told"
    keys = ("name", "distribution", "version")
    if not (
        isinstance(manifest, list)
        and all(isinstance(p, dict) and all(isinstance(p.get(k), str) for k in keys) for p in manifest)
    ):
        return [], (
            f"its {MANIFEST_FILE} is not a list of plugins (name, distribution, version), so whether the plugins "
            "changed cannot be told"
        )
    return manifest, ""


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
