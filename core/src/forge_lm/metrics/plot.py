"""A PNG of the metrics of one run, or of several runs drawn over each other.

Reads the ``metrics.jsonl`` that the jsonl backend writes. The figure's panels share the step
axis. The core's five come first, always in this order: training loss, evaluation loss (the
held-out split's ``eval/loss`` and every named set's ``eval/<set>/loss``, labelled with the
set's name), learning rate, tokens/s and memory (every ``memory/*_gib`` key a run logged:
``rss`` on CPU; ``allocated``, ``reserved`` and ``peak`` on CUDA). A core panel that no run has
data for stays in place, marked "not logged", so that figures of different runs always have the
same layout. Plugins add panels after them (forge-moe: load balance and drops per layer)
through the ``forge_lm_plot_panels`` hook; see :mod:`forge_lm.metrics.plot_panels`.

Each run is drawn in a colour of its own and labelled with its name: the name of its run
directory, or, when two runs share that name, as many of the parent folders as tell them
apart (``sweep-a/run``, ``sweep-b/run``). In a panel of several keys (memory kinds, named
evaluation sets, a plugin's per-layer lines) the label adds the key's label (``run
allocated``) and each key has a line style of its own; with one run the lines are labelled
with the key's label alone and each has a colour of its own.

A metrics file is untrusted input. Lines that are not JSON objects, records without a
whole-number ``step``, and values that are not finite numbers (text, ``null``, ``NaN``,
infinities) are left out, and each file's omissions are reported as notes; a file with nothing
left to plot is refused. A line that is not JSON at all is refused with its line number,
unless it is the last line, cut short by a crash in the middle of a write.

matplotlib is an optional dependency (``pip install forge-lm[plot]``), imported when a plot is
drawn. Figures are drawn on an Agg canvas without pyplot: no display is needed, no window
opens, and no global matplotlib state (the backend of a notebook that calls this) is touched.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from forge_lm.errors import PluginError, UsageError
from forge_lm.metrics import EVAL_LOSS, LEARNING_RATE, LOSS, TOKENS_PER_SECOND
from forge_lm.metrics.plot_panels import PlotPanel, core_panels, is_core_key, plugin_panels
from forge_lm.run_links import refuse_links

INSTALL_HINT = "pip install forge-lm[plot]"
METRICS_FILE = "metrics.jsonl"
SINGLE_OUTPUT = "metrics.png"  # written into the run directory when one run is plotted
COMPARE_OUTPUT = "compare.png"  # written into the first run's directory when several are

PANEL_HEIGHT = 2.3  # inches per panel; the figure is 8 inches wide
DPI = 120
LINE_STYLES = ("-", "--", ":", "-.")
LEGEND_COLUMNS_AT = 8  # a legend of more lines than this is laid out in columns
MAX_STEP = 2**63 - 1


def series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` over the records that have it (evaluation records may lack it).

    ``records`` are expected to be cleaned by :func:`clean_records`.
    """
    points = [(record["step"], float(record[key])) for record in records if key in record]
    return [step for step, _ in points], [value for _, value in points]


def logged_keys(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> frozenset[str]:
    """Every key but ``step`` that a record of one of the runs holds."""
    return frozenset(key for records in runs.values() for record in records for key in record if key != "step")


def clean_records(
    records: Sequence[Any], drawn: Callable[[str], bool] = is_core_key
) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of a metrics file fit to plot, and what was left out, in words.

    Left out: entries that are not JSON objects, records whose ``step`` is missing or not a
    whole number from 0, and (only from the keys a panel draws: ``drawn(key)``) values that
    are not finite numbers. Other keys are kept as they are: nothing reads them.
    """
    clean: list[dict[str, Any]] = []
    not_objects = 0
    bad_steps = 0
    bad_values: Counter[str] = Counter()
    for record in records:
        if not isinstance(record, dict):
            not_objects += 1
            continue
        step = _whole_number(record.get("step"))
        if step is None:
            bad_steps += 1
            continue
        kept: dict[str, Any] = {**record, "step": step}
        for key, value in record.items():
            if drawn(key):
                number = _finite_number(value)
                if number is None:
                    bad_values[key] += 1
                    del kept[key]
                else:
                    kept[key] = number
        clean.append(kept)
    omissions = []
    if not_objects:
        omissions.append(f"{_count(not_objects, 'line')} that {_verb(not_objects)} not a JSON object")
    if bad_steps:
        omissions.append(f"{_count(bad_steps, 'record')} without a whole-number 'step'")
    if bad_values:
        keys = ", ".join(f"{key} ({n})" for key, n in sorted(bad_values.items()))
        total = sum(bad_values.values())
        omissions.append(f"{_count(total, 'value')} that {_verb(total)} not a finite number: {keys}")
    return clean, omissions


def _whole_number(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and 0 <= value <= MAX_STEP:
        return value
    return None


def _finite_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # a JSON integer too large for a float
        return None
    return number if math.isfinite(number) else None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _verb(n: int) -> str:
    return "is" if n == 1 else "are"


def build_figure(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], title: str = "", panels: Sequence[PlotPanel] | None = None
) -> Any:
    """A matplotlib Figure with one panel per entry of ``panels``, sharing the step axis.

    ``runs`` maps each run's label to its records (cleaned by :func:`clean_records`), in the
    order the runs are drawn. ``panels`` defaults to the core's (:func:`core_panels` of the keys
    the runs logged). With several runs each run has a colour of its own in every panel and
    each key of a panel a line style; with one run each key has a colour of its own. A legend
    names the lines of a panel when the figure has several runs, or the panel several lines.
    """
    if panels is None:
        panels = core_panels(logged_keys(runs))
    figure_class, canvas_class = _matplotlib()
    figure = figure_class(figsize=(8, PANEL_HEIGHT * len(panels)), layout="constrained")
    canvas_class(figure)  # attaches itself to the figure: savefig then renders with Agg
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    several = len(runs) > 1
    for ax, panel in zip(axes, panels, strict=True):
        _draw_panel(ax, panel, runs, several)
    axes[-1].set_xlabel("step")
    if title:
        figure.suptitle(title)
    return figure


def _draw_panel(ax: Any, panel: PlotPanel, runs: Mapping[str, Sequence[Mapping[str, Any]]], several: bool) -> None:
    marker = "o" if panel.markers else None
    for run_index, (name, records) in enumerate(runs.items()):
        for key_index, (key, label) in enumerate(panel.lines):
            steps, values = series(records, key)
            if not steps:
                continue
            # A key without a label is the run's own line; with several runs a label names its run too.
            line_label = name if label is None else (f"{name} {label}" if several else label)
            color = f"C{(run_index if several else key_index) % 10}"  # a run keeps its colour in every panel
            style = LINE_STYLES[key_index % len(LINE_STYLES)]
            ax.plot(steps, values, label=line_label, color=color, linestyle=style, marker=marker, markersize=3)
    ax.set_title(panel.title, loc="left")
    ax.grid(alpha=0.3)
    lines = ax.get_lines()
    if not lines:
        ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="gray")
    elif several or len(lines) > 1:
        columns = 1 + (len(lines) - 1) // LEGEND_COLUMNS_AT
        ax.legend(fontsize="small" if columns == 1 else "x-small", ncols=columns)


def metrics_file_of(path: str | Path) -> Path:
    """The metrics file of a run directory (or the file itself); UsageError if there is none."""
    path = Path(path)
    if path.is_dir():  # a run directory: its metrics file is read only if it is the run's own
        refuse_links(path, [METRICS_FILE], "Give the file it points to itself if you mean to plot that file.")
    metrics_file = path if path.is_file() else path / METRICS_FILE
    if not metrics_file.is_file():
        raise UsageError(
            f"no metrics file at '{metrics_file}'. Give the run directory of a run that logged with the "
            "'jsonl' metrics backend (it writes metrics.jsonl), or the metrics file itself."
        )
    return metrics_file


def run_names(metrics_files: Sequence[Path]) -> list[str]:
    """A label per run: its directory's name, with as many parent folders as it takes to tell
    runs of the same name apart. Two metrics files in one directory are told apart by file name."""
    paths = [file.resolve() for file in metrics_files]
    parents = [path.parent for path in paths]
    parts = []
    for path, parent in zip(paths, parents, strict=True):
        chosen = path if parents.count(parent) > 1 else parent
        parts.append(chosen.parts[1:] if chosen.is_absolute() else chosen.parts)  # no root in a label
    depth = [1] * len(paths)
    while True:
        labels = ["/".join(p[-d:]) or "/" for p, d in zip(parts, depth, strict=True)]
        clashing = {label for label in labels if labels.count(label) > 1}
        if not clashing:
            return labels
        grown = False
        for i, label in enumerate(labels):
            if label in clashing and depth[i] < len(parts[i]):
                depth[i] += 1
                grown = True
        if not grown:  # distinct files always differ somewhere; this is a last resort
            return [f"{label} ({i + 1})" if label in clashing else label for i, label in enumerate(labels)]


def read_run(metrics_file: Path) -> list[Any]:
    """The entries of one metrics file, as read (untrusted: see :func:`clean_records`)."""
    from forge_lm.metrics.jsonl import read_metrics

    try:
        return read_metrics(metrics_file)
    except UnicodeDecodeError:
        raise UsageError(f"'{metrics_file}' is not a text file; give the metrics.jsonl of a run.") from None
    except ValueError as exc:  # a damaged line; the message names the file and the line
        raise UsageError(f"{exc}. Remove or repair that line to plot the rest.") from None
    except OSError as exc:
        raise UsageError(f"cannot read '{metrics_file}': {exc.strerror or exc}.") from None


def load_run(metrics_file: Path, drawn: Callable[[str], bool] = is_core_key) -> tuple[list[dict[str, Any]], list[str]]:
    """The cleaned records of one metrics file and the notes on what was left out of it."""
    return clean_run(metrics_file, read_run(metrics_file), drawn)


def clean_run(
    metrics_file: Path, entries: Sequence[Any], drawn: Callable[[str], bool]
) -> tuple[list[dict[str, Any]], list[str]]:
    records, omissions = clean_records(entries, drawn)
    notes = [f"{metrics_file}: left out {', '.join(omissions)}."] if omissions else []
    if not any(drawn(key) for record in records for key in record):
        raise UsageError(
            f"'{metrics_file}' has no {LOSS}, {LEARNING_RATE} or {TOKENS_PER_SECOND} records to plot "
            f"(nor {EVAL_LOSS}, eval/<set>/loss, memory/..._gib or a key a plugin's panel draws)."
        )
    return records, notes


def plot_runs(
    run_dirs: Sequence[str | Path],
    output: str | Path | None = None,
    notes: list[str] | None = None,
    manager: Any = None,
) -> Path:
    """Draw the metrics of ``run_dirs`` over each other into ``output``; return its path.

    Each entry of ``run_dirs`` is a run directory or its metrics file. ``output`` defaults to
    ``metrics.png`` in the run's directory for one run, and to ``compare.png`` in the first
    run's directory for several. What was left out of a metrics file is appended to ``notes``
    (when given) as one sentence per file. With a plugin ``manager``, the panels its plugins
    return from ``forge_lm_plot_panels`` follow the core's.
    """
    if not run_dirs:
        raise UsageError("give at least one run directory to plot.")
    metrics_files = [metrics_file_of(path) for path in run_dirs]
    seen: dict[Path, str | Path] = {}
    for given, metrics_file in zip(run_dirs, metrics_files, strict=True):
        resolved = metrics_file.resolve()
        if resolved in seen:
            raise UsageError(f"'{given}' and '{seen[resolved]}' are the same run; give each run once.")
        seen[resolved] = given
    entries = {name: read_run(file) for name, file in zip(run_names(metrics_files), metrics_files, strict=True)}
    keys = frozenset(
        key
        for records in entries.values()
        for record in records
        if isinstance(record, dict)
        for key in record
        if key != "step"
    )
    added = plugin_panels(manager, keys) if manager is not None else []
    plugin_keys = frozenset(key for panel in added for key in panel.keys)
    panels = core_panels(keys) + added
    runs: dict[str, list[dict[str, Any]]] = {}
    for (name, records), metrics_file in zip(entries.items(), metrics_files, strict=True):
        runs[name], file_notes = clean_run(metrics_file, records, lambda key: is_core_key(key) or key in plugin_keys)
        if notes is not None:
            notes.extend(file_notes)
    if output is None:
        output = metrics_files[0].parent / (SINGLE_OUTPUT if len(runs) == 1 else COMPARE_OUTPUT)
        # In the run: a link there is refused, not written through (out of the run).
        refuse_links(output.parent, [output.name], "Remove the link, or name the image with --output PNG.")
    output = Path(output)
    figure = build_figure(runs, title=next(iter(runs)) if len(runs) == 1 else "", panels=panels)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        # The format follows the suffix (.png by default; .svg and .pdf work too).
        figure.savefig(output, dpi=DPI)
    except OSError as exc:
        raise UsageError(f"cannot write '{output}': {exc.strerror or exc}.") from None
    except ValueError as exc:  # matplotlib's answer to a suffix it has no writer for
        raise UsageError(f"cannot write '{output}': {exc} Use a .png output.") from None
    return output


def plot_run(
    run_dir: str | Path, output: str | Path | None = None, notes: list[str] | None = None, manager: Any = None
) -> Path:
    """Draw one run's metrics into ``output`` (default ``<run_dir>/metrics.png``); return its path.

    ``run_dir`` may also be the metrics file itself.
    """
    return plot_runs([run_dir], output, notes, manager)


def _matplotlib() -> tuple[type, type]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PluginError(
            f"plotting needs matplotlib, which is not installed. Install it with `{INSTALL_HINT}`."
        ) from None
    return Figure, FigureCanvasAgg
