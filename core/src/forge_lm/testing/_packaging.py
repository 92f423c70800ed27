"""Checks of a plugin distribution as installed: entry points, light imports, API range."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

from forge_lm.hookspecs import PROJECT_NAME
from forge_lm.plugins import API_ATTRIBUTE, PLUGIN_API_VERSION, PluginManager, PluginSettings, PluginStatus
from forge_lm.plugins._api import api_incompatibility
from forge_lm.testing._kit import Check

HEAVY_MODULES = ("torch", "numpy", "wandb", "datasets", "transformers", "tokenizers")
"""Modules a plugin module must not import at import time (listing plugins stays fast)."""


def _entry_points(dist: str) -> list[importlib.metadata.EntryPoint]:
    try:
        found = importlib.metadata.distribution(dist).entry_points
    except importlib.metadata.PackageNotFoundError:
        raise AssertionError(f"distribution '{dist}' is not installed") from None
    return [ep for ep in found if ep.group == PROJECT_NAME]


def check_declares_forge_lm_entry_points(dist: str) -> None:
    assert _entry_points(dist), (
        f"'{dist}' declares no entry point in the '{PROJECT_NAME}' group; add to its pyproject.toml:\n"
        f'[project.entry-points.{PROJECT_NAME}]\nmy_plugin = "my_package.plugin"'
    )


def check_plugin_modules_import_nothing_heavy(dist: str) -> None:
    for ep in _entry_points(dist):
        probe = (
            "import importlib, json, sys\n"
            f"importlib.import_module({ep.module!r})\n"
            f"print(json.dumps([m for m in {list(HEAVY_MODULES)!r} if m in sys.modules]))\n"
        )
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"importing '{ep.module}' failed:\n{done.stderr}"
        heavy = json.loads(done.stdout.strip().splitlines()[-1])
        assert not heavy, (
            f"importing plugin module '{ep.module}' of '{dist}' imports {heavy}; import them inside "
            "factories (or register factories as 'module:function' strings) so listing plugins stays fast"
        )


def check_declared_plugin_api_admits_this_core(dist: str) -> None:
    for ep in _entry_points(dist):
        module = importlib.import_module(ep.module)
        problem = api_incompatibility(getattr(module, API_ATTRIBUTE, None), ep.module)
        assert problem is None, f"plugin '{ep.name}' of '{dist}' (core plugin API {PLUGIN_API_VERSION}): {problem}"


def check_loads_cleanly(dist: str) -> None:
    names = tuple(ep.name for ep in _entry_points(dist))
    manager = PluginManager(PluginSettings(allow=names))
    for name in names:
        plugin = manager.plugin(name)
        assert plugin.status is PluginStatus.OK, f"plugin '{name}' of '{dist}' is {plugin.status}: {plugin.reason}"


def distribution_checks(dist: str) -> list[Check]:
    """The packaging checks of an installed plugin distribution."""
    functions = (
        check_declares_forge_lm_entry_points,
        check_plugin_modules_import_nothing_heavy,
        check_declared_plugin_api_admits_this_core,
        check_loads_cleanly,
    )
    return [Check(f"{dist}:{f.__name__.removeprefix('check_')}", lambda f=f: f(dist)) for f in functions]
