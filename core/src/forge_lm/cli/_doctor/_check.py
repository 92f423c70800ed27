"""What a check of ``forge doctor`` is, what it is given, and how the report shows the results.

A check is a function of one :class:`Context` returning the rows it found (none where it does
not apply). :func:`run_check` runs one, so that a check that crashes is one failed row and
never stops the checks after it.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

OK, WARNING, FAIL = "ok", "warning", "fail"


class Check(NamedTuple):
    """One row of the report."""

    what: str  # the check's name: the first column, and "check" in --json
    status: str  # OK, WARNING or FAIL
    detail: str  # what was found and, unless ok, how to fix it


@dataclass
class Context:
    """What every check receives: the command line's inputs, and what earlier checks found."""

    manager: Any  # the PluginManager of this command line's switches
    config_path: str | None
    overrides: list[str]
    run_dir: str | None
    min_free_gib: float
    config: Any = None  # the run config, set by the config check when it is valid

    @property
    def torch(self) -> Any:
        """torch once the torch check has imported it, None when that failed: the checks that
        need it then add no row, as the torch row already says what is wrong."""
        return sys.modules.get("torch")

    @property
    def directory(self) -> Path:
        """The run directory: --run-dir, else the valid config's train.output_dir, else the
        current directory (an invalid config names none)."""
        if self.run_dir is not None:
            return Path(self.run_dir)
        return Path(self.config.train.output_dir if self.config is not None else ".")


CheckFunction = Callable[[Context], list[Check]]


def run_check(check: CheckFunction, context: Context) -> list[Check]:
    """The rows of ``check``, or one failed row naming it when it raises: every check runs in
    the same process, and one bug (in doctor, or in what it calls) must not hide what the
    others find, nor, under torchrun, keep this rank from the health check the others wait in."""
    try:
        return list(check(context))
    except Exception as exc:  # noqa: BLE001 - whatever it was, it is this check's failure; Ctrl-C still stops
        return [crashed(check, exc)]


def crashed(check: CheckFunction, exc: Exception) -> Check:
    """The row of a check that raised ``exc``: its name, the exception and where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return Check(
        check.__name__.replace("_", " "),
        FAIL,
        f"the check crashed, so this was not checked (the other checks ran): {check.__module__}.{check.__name__} "
        f"raised {type(exc).__name__}: {exc}{where}. This is a bug: report it with this message and the output "
        "of 'forge --version'",
    )


_STYLE = {OK: "green", WARNING: "yellow", FAIL: "red"}


def report(checks: list[Check], *, as_json: bool) -> None:
    """Print ``checks`` as a table ending with the verdict, or as one JSON document."""
    failed = sum(check.status == FAIL for check in checks)
    warned = sum(check.status == WARNING for check in checks)
    if as_json:
        import json

        rows = [{"check": what, "status": status, "detail": detail} for what, status, detail in checks]
        print(json.dumps({"ok": not failed, "checks": rows}, indent=2))
        return
    import shutil

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title="forge doctor", title_justify="left", show_lines=True)
    for column in ("Check", "Status", "Detail"):
        table.add_column(column, overflow="fold")
    for what, status, detail in checks:
        table.add_row(Text(what), Text(status, style=_STYLE[status]), Text(detail))  # no markup: [train] ...
    console = Console(width=max(120, shutil.get_terminal_size((120, 24)).columns), soft_wrap=False)
    console.print(table)
    if failed:
        summary = f"{failed} check(s) failed"
        summary += f", {warned} warning(s)" if warned else ""
        console.print(f"{summary}: fix the failures above before training.", style="red", highlight=False)
    elif warned:
        console.print(f"ready to train, with {warned} warning(s).", style="yellow", highlight=False)
    else:
        console.print("ready to train: every check passed.", style="green", highlight=False)
