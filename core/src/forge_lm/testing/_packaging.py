"""Checks of a plugin distribution as installed: entry points, light imports, API range.

A packaging mistake (an entry point naming a module the package does not ship, a dependency
left out of ``pyproject.toml``) is the author's to fix, so every check that meets one fails with
the same message: which entry point, what is missing and what to change in the package. The
core's own message for the same failure speaks to the user (reinstall the plugin or remove it).
"""

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


def entry_point_problem(ep: importlib.metadata.EntryPoint, dist: str) -> str | None:
    """Why ``ep`` of ``dist`` cannot be loaded, said to the plugin's author with the fix; None
    if it loads. Imports the module in this process, as loading the plugin does."""
    table = f"[project.entry-points.{PROJECT_NAME}]"
    where = f"entry point '{ep.name} = {ep.value}' of '{dist}' ({table} in its pyproject.toml)"
    reinstall = "then reinstall the distribution (pip install -e . in its source tree)"
    try:
        module = importlib.import_module(ep.module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == ep.module or ep.module.startswith(f"{missing}."):  # the named module itself is absent
            return (
                f"{where} names module '{ep.module}', which the installed package does not have ({exc}). Name the "
                "module that holds your hook implementations by its dotted import path ('my_package.plugin'), or "
                f"make the package ship it (the build's package list), {reinstall}."
            )
        return (
            f"{where}: importing '{ep.module}' needs module '{missing}', which is not installed. Declare the "
            f"distribution that provides it in [project] dependencies (or import it inside the factories), {reinstall}."
        )
    except Exception as exc:  # noqa: BLE001 - a plugin module may fail to import in any way
        return (
            f"{where}: importing '{ep.module}' raised {type(exc).__name__}: {exc}. The module must import with only "
            f"its declared dependencies; fix it, {reinstall}."
        )
    target: object = module
    for part in (ep.attr or "").split(".") if ep.attr else ():
        if not hasattr(target, part):
            return (
                f"{where} names '{ep.attr}' in module '{ep.module}', which has no '{part}'. Point the entry point at "
                f"the module (or an object in it) that holds your hook implementations, {reinstall}."
            )
        target = getattr(target, part)
    return None


def _assert_entry_points_load(dist: str) -> None:
    problems = [problem for ep in _entry_points(dist) if (problem := entry_point_problem(ep, dist))]
    assert not problems, "\n".join(problems)


def check_declares_forge_lm_entry_points(dist: str) -> None:
    assert _entry_points(dist), (
        f"'{dist}' declares no entry point in the '{PROJECT_NAME}' group; add to its pyproject.toml:\n"
        f'[project.entry-points.{PROJECT_NAME}]\nmy_plugin = "my_package.plugin"'
    )


def check_entry_points_load(dist: str) -> None:
    _assert_entry_points_load(dist)


def check_plugin_modules_import_nothing_heavy(dist: str) -> None:
    _assert_entry_points_load(dist)  # a module that does not import is named as such, not as a traceback
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
    _assert_entry_points_load(dist)
    for ep in _entry_points(dist):
        module = importlib.import_module(ep.module)
        problem = api_incompatibility(getattr(module, API_ATTRIBUTE, None), ep.module)
        assert problem is None, f"plugin '{ep.name}' of '{dist}' (core plugin API {PLUGIN_API_VERSION}): {problem}"


def check_loads_cleanly(dist: str) -> None:
    _assert_entry_points_load(dist)  # else the core's message would give the user's fix (reinstall, remove)
    names = tuple(ep.name for ep in _entry_points(dist))
    manager = PluginManager(PluginSettings(allow=names))
    for name in names:
        plugin = manager.plugin(name)
        assert plugin.status is PluginStatus.OK, f"plugin '{name}' of '{dist}' is {plugin.status}: {plugin.reason}"


def distribution_checks(dist: str) -> list[Check]:
    """The packaging checks of an installed plugin distribution."""
    functions = (
        check_declares_forge_lm_entry_points,
        check_entry_points_load,
        check_plugin_modules_import_nothing_heavy,
        check_declared_plugin_api_admits_this_core,
        check_loads_cleanly,
    )
    return [Check(f"{dist}:{f.__name__.removeprefix('check_')}", lambda f=f: f(dist)) for f in functions]


def unloaded_plugin_problems(manager: PluginManager) -> list[str]:
    """The packaging problems (:func:`entry_point_problem`) of the installed plugins that
    ``manager`` found broken: why a component they were to register is missing."""
    broken = {p.name for p in manager.plugins if p.status is PluginStatus.BROKEN and not p.builtin}
    problems = []
    for ep in importlib.metadata.entry_points(group=PROJECT_NAME):
        if ep.name in broken:
            problem = entry_point_problem(ep, ep.dist.name if ep.dist else "<unknown distribution>")
            if problem is not None:
                problems.append(problem)
    return problems
