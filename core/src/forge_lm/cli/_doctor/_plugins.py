"""Checks of the plugins: the core's built-ins, each third-party plugin (broken, incompatible,
or installed beside a core its distribution does not accept), and switches naming no plugin."""

from __future__ import annotations

from typing import Any

from forge_lm.cli._doctor import _environment
from forge_lm.cli._doctor._check import FAIL, OK, WARNING, Check, Context


def core_plugins(context: Context) -> list[Check]:
    from forge_lm.plugins import CORE_DISTRIBUTION, PluginStatus, core_version

    builtins = [p for p in context.manager.plugins if p.builtin]
    damaged = [p for p in builtins if p.status in (PluginStatus.BROKEN, PluginStatus.INCOMPATIBLE)]
    if damaged:
        return [
            Check(
                "core plugins",
                FAIL,
                "; ".join(f"'{p.name}' is {p.status}: {p.reason}" for p in damaged)
                + f". Fix: pip install --force-reinstall '{CORE_DISTRIBUTION}=={core_version()}'",
            )
        ]
    off = [p.name for p in builtins if p.status is PluginStatus.DISABLED]
    note = f" ({', '.join(off)} disabled by a switch)" if off else ""
    return [Check("core plugins", OK, f"{CORE_DISTRIBUTION} {core_version()}: {len(builtins)} built-ins{note}")]


def plugins(context: Context) -> list[Check]:
    """One row per third-party plugin, or one saying there is none."""
    third_party = [p for p in context.manager.plugins if not p.builtin]
    if not third_party:
        return [Check("plugins", OK, "no third-party plugin installed")]
    return [_check_plugin(plugin) for plugin in third_party]


def plugin_switches(context: Context) -> list[Check]:
    return [Check("plugin switches", WARNING, warning) for warning in context.manager.warnings]


CHECKS = (core_plugins, plugins, plugin_switches)


def _check_plugin(plugin: Any) -> Check:
    from forge_lm.plugins import PluginStatus

    what = f"plugin {plugin.name}"
    dist = plugin.distribution
    found = f"{dist} {plugin.version}"
    if plugin.status is PluginStatus.BROKEN:
        return Check(
            what,
            FAIL,
            f"{found} is broken: {plugin.reason}. Fix: reinstall it with its dependencies "
            f"(pip install --force-reinstall {dist}), uninstall it (pip uninstall {dist}), "
            f"or run without it (--block-plugin {plugin.name})",
        )
    if plugin.status is PluginStatus.INCOMPATIBLE:
        return Check(
            what,
            FAIL,
            f"{found} is incompatible: {plugin.reason}. Fix: pip install --upgrade {dist}, or pip uninstall {dist}",
        )
    requirements = _environment.unconditional_requirements(_environment.distribution_metadata(dist))
    unmet = [problem for problem in map(_environment.unmet, requirements) if problem]
    if unmet:
        return Check(
            what,
            FAIL,
            f"{found} needs {'; '.join(unmet)}. Fix: pip install --upgrade {dist} (a release made for what is "
            f"installed) or install what it needs",
        )
    if plugin.status is PluginStatus.DISABLED:
        return Check(what, OK, f"{found}: disabled ({plugin.reason})")
    components = sum(len(names) for names in plugin.components.values())
    return Check(what, OK, f"{found}: {components} component(s)")
