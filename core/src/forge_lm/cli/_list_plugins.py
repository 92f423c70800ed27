"""``forge list-plugins``: every plugin seen, its status, and what it registers.

``--requirements`` prints instead one pinned requirement line per installed Forge
distribution (the core first, then every distribution with a plugin entry point, whatever
its status), so ``pip install -r`` of the output rebuilds the set after an upgrade or in a
new environment.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import textwrap
from typing import Any

from forge_lm.plugins import CATEGORIES, CORE_DISTRIBUTION, PluginManager, core_version

# Listing plugins is the command people run to see what is installed: it imports no torch, no
# rich and no packaging.requirements (only --requirements needs those), so it starts in a
# tenth of the time of import torch (tests/core/cli/test_list_plugins_imports.py).

HELP = "show installed plugins and their components"
TAKES_OVERRIDES = False


def add_arguments(parser) -> None:
    from forge_lm.cli._main import add_plugin_switches

    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON for scripts")
    output.add_argument(
        "--requirements",
        action="store_true",
        help="print pinned requirement lines (forge-moe==0.1.0) of the core and every installed plugin, "
        "for pip install -r",
    )
    add_plugin_switches(parser, after_command=True)


def run(args, overrides, plugins) -> int:
    if args.requirements:
        print("\n".join(requirement_lines(plugins())))
        return 0
    return list_plugins(plugins(), as_json=args.json)


def requirement_lines(manager: PluginManager) -> list[str]:
    """``forge-lm[hf]==0.1.0``, then ``forge-moe==0.1.0`` ...: the installed Forge distributions, pinned.

    Every distribution that provides a plugin is listed, loaded or not (a disabled, broken or
    incompatible plugin is still installed). An extra is kept when everything it requires is
    installed, so ``forge-lm[hf]`` comes back with the Hugging Face components.
    """
    from packaging.utils import canonicalize_name

    lines = [_pinned(CORE_DISTRIBUTION, core_version())]
    seen = {canonicalize_name(CORE_DISTRIBUTION)}
    third_party = sorted((p for p in manager.plugins if not p.builtin), key=lambda p: canonicalize_name(p.distribution))
    for plugin in third_party:
        key = canonicalize_name(plugin.distribution)
        if key in seen:
            continue
        seen.add(key)
        if plugin.version == "?":  # an entry point whose distribution metadata cannot be read
            lines.append(f"# plugin '{plugin.name}' ({plugin.module}): its distribution is unknown, pin it by hand")
        else:
            lines.append(_pinned(plugin.distribution, plugin.version))
    return lines


def _pinned(distribution: str, version: str) -> str:
    extras = _installed_extras(distribution)
    return f"{distribution}{'[' + ','.join(extras) + ']' if extras else ''}=={version}"


def _installed_extras(distribution: str) -> list[str]:
    """The extras of ``distribution`` whose every requirement is installed in a matching version."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        metadata = importlib.metadata.metadata(distribution)
    except importlib.metadata.PackageNotFoundError:
        return []
    requirements = []
    for line in metadata.get_all("Requires-Dist") or []:
        try:
            requirements.append(Requirement(line))
        except InvalidRequirement:
            continue
    extras = []
    for extra in sorted(set(metadata.get_all("Provides-Extra") or [])):
        needed = [r for r in requirements if r.marker is not None and r.marker.evaluate({"extra": extra})]
        needed = [r for r in needed if not r.marker.evaluate({"extra": ""})]  # not needed by every install anyway
        if needed and all(_satisfied(r) for r in needed):
            extras.append(extra)
    return extras


def _satisfied(requirement: Any) -> bool:
    try:
        version = importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return requirement.specifier.contains(version, prereleases=True)


def list_plugins(manager: PluginManager, *, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"plugins": [p.as_dict() for p in manager.plugins], "warnings": manager.warnings}, indent=2))
        return 0
    rows = []
    for plugin in manager.plugins:
        listed = [
            f"{category}: {', '.join(sorted(plugin.components[category]))}"
            for category in CATEGORIES
            if plugin.components.get(category)
        ]
        if plugin.commands:
            listed.append(f"commands: {', '.join(f'forge {name}' for name in sorted(plugin.commands))}")
        status = f"{plugin.status}: {plugin.reason}" if plugin.reason else str(plugin.status)
        rows.append([plugin.name, plugin.distribution, plugin.version, status, "\n".join(listed) or "-"])
    # A pipe or CI log gets a table wide enough not to fold every cell.
    width = max(120, shutil.get_terminal_size((120, 24)).columns)
    print("Forge plugins")
    print(boxed_table(["Plugin", "Distribution", "Version", "Status", "Components"], rows, width))
    return 0


def boxed_table(header: list[str], rows: list[list[str]], width: int) -> str:
    """``rows`` under ``header`` in box-drawing lines, a rule between rows, at most ``width``
    characters wide: the widest columns are narrowed first and their cells folded."""
    columns = list(zip(header, *rows, strict=True))
    widths = [max(len(line) for cell in column for line in cell.splitlines() or [""]) for column in columns]
    while sum(widths) + 3 * len(widths) + 1 > width and max(widths) > 8:
        widths[widths.index(max(widths))] -= 1

    def rule(left: str, middle: str, right: str) -> str:
        return left + middle.join("─" * (w + 2) for w in widths) + right

    def lines_of(row: list[str], bar: str = "│") -> list[str]:
        cells = [
            [
                part
                for line in cell.splitlines() or [""]
                for part in textwrap.wrap(line, w, break_on_hyphens=False) or [""]
            ]
            for cell, w in zip(row, widths, strict=True)
        ]
        height = max(len(cell) for cell in cells)
        return [
            bar
            + bar.join(f" {(cell[i] if i < len(cell) else ''):<{w}} " for cell, w in zip(cells, widths, strict=True))
            + bar
            for i in range(height)
        ]

    out = [rule("┏", "┳", "┓").replace("─", "━"), *lines_of(header, "┃"), rule("┡", "╇", "┩").replace("─", "━")]
    for index, row in enumerate(rows):
        if index:
            out.append(rule("├", "┼", "┤"))
        out.extend(lines_of(row))
    out.append(rule("└", "┴", "┘"))
    return "\n".join(out)
