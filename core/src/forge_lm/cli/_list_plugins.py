"""``forge list-plugins``: every plugin seen, its status, and what it registers."""

from __future__ import annotations

import json
import shutil

from forge_lm.plugins import CATEGORIES, PluginManager, PluginStatus

HELP = "show installed plugins and their components"
TAKES_OVERRIDES = False


def add_arguments(parser) -> None:
    from forge_lm.cli._main import add_plugin_switches

    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    add_plugin_switches(parser, after_command=True)


def run(args, overrides, plugins) -> int:
    return list_plugins(plugins(), as_json=args.json)


_STYLE = {
    PluginStatus.OK: "green",
    PluginStatus.BROKEN: "red",
    PluginStatus.INCOMPATIBLE: "yellow",
    PluginStatus.DISABLED: "dim",
}


def list_plugins(manager: PluginManager, *, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"plugins": [p.as_dict() for p in manager.plugins], "warnings": manager.warnings}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title="Forge plugins", title_justify="left", show_lines=True)
    for column in ("Plugin", "Distribution", "Version", "Status", "Components"):
        table.add_column(column, overflow="fold")
    for plugin in manager.plugins:
        status = Text(str(plugin.status), style=_STYLE[plugin.status])
        if plugin.reason:
            status.append(f": {plugin.reason}")
        listed = "\n".join(
            f"{category}: {', '.join(sorted(plugin.components[category]))}"
            for category in CATEGORIES
            if plugin.components.get(category)
        )
        table.add_row(plugin.name, plugin.distribution, plugin.version, status, listed or "-")
    # A pipe or CI log gets a table wide enough not to fold every cell.
    width = max(120, shutil.get_terminal_size((120, 24)).columns)
    Console(width=width, soft_wrap=False).print(table)
    return 0
