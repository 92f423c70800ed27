"""A PNG of the metrics of one run, or of several runs drawn over each other.

Reads the ``metrics.jsonl`` that the jsonl backend writes. The figure has five panels sharing
the step axis, always in this order: training loss, evaluation loss, learning rate, tokens/s
and memory (every ``memory/*_gib`` key a run logged: ``rss`` on CPU; ``allocated``,
``reserved`` and ``peak`` on CUDA). A panel that no run has data for stays in place, marked
"not logged", so that figures of different runs always have the same layout.

Each run is drawn in a colour of its own and labelled with its name: the name of its run
directory, or, when two runs share that name, as many of the parent folders as tell them
apart (``sweep-a/run``, ``sweep-b/run``). In the memory panel the label adds the kind of
memory (``run allocated``); each kind has a line style of its own. With one run the memory
lines are labelled with the kind alone.

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from forge_lm.errors import PluginError, UsageError
from forge_lm.metrics import EVAL_LOSS, LEARNING_RATE, LOSS, TOKENS_PER_SECOND
from forge_lm.run_links import refuse_links

INSTALL_HINT = "pip install forge-lm[plot]"
METRICS_FILE = "metrics.jsonl"
SINGLE_OUTPUT = "metrics.png"  # written into the run directory when one run is plotted
COMPARE_OUTPUT = "compare.png"  # written into the first run's directory when several are

MEMORY_PREFIX, MEMORY_SUFFIX = "memory/", "_gib"
MEMORY = "memory"  # the panel of every memory/*_gib key, whichever a run logged

# One panel per entry: its title and the key it draws (MEMORY: all memory/*_gib keys).
PANELS: list[tuple[str, str]] = [
    ("loss", LOSS),
    ("eval loss", EVAL_LOSS),
    ("learning rate", LEARNING_RATE),
    ("tokens / s", TOKENS_PER_SECOND),
    ("memory (GiB)", MEMORY),
]
PLOTTED = frozenset(key for _, key in PANELS if key != MEMORY)  # and every memory/*_gib key
PANEL_HEIGHT = 2.3  # inches per panel; the figure is 8 inches wide
DPI = 120

# Memory kinds in the order their lines are drawn (and take line styles); others follow, sorted.
MEMORY_ORDER = ("allocated", "reserved", "peak", "rss", "peak_rss")
LINE_STYLES = ("-", "--", ":", "-.")
MAX_STEP = 2**63 - 1


def is_memory_key(key: str) -> bool:
    return (
        key.startswith(MEMORY_PREFIX) and key.endswith(MEMORY_SUFFIX) and len(key) > len(MEMORY_PREFIX + MEMORY_SUFFIX)
    )


def memory_kind(key: str) -> str:
    """``memory/allocated_gib`` -> ``allocated``."""
    return key[len(MEMORY_PREFIX) : -len(MEMORY_SUFFIX)]


def memory_keys(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """The memory/*_gib keys any of the runs logged, in drawing order."""
    found = {key for records in runs.values() for record in records for key in record if is_memory_key(key)}
    rank = {kind: i for i, kind in enumerate(MEMORY_ORDER)}
    return sorted(found, key=lambda key: (rank.get(memory_kind(key), len(rank)), key))


def series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` over the records that have it (evaluation records may lack it).

    ``records`` are expected to be cleaned by :func:`clean_records`.
    """
    points = [(record["step"], float(record[key])) for record in records if key in record]
    return [step for step, _ in points], [value for _, value in points]


def clean_records(records: Sequence[Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of a metrics file fit to plot, and what was left out, in words.

    Left out: entries that are not JSON objects, records whose ``step`` is missing or not a
    whole number from 0, and (only from the keys a panel draws) values that are not finite
    numbers. Other keys are kept as they are: nothing reads them.
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
            if key in PLOTTED or is_memory_key(key):
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


def build_figure(runs: Mapping[str, Sequence[Mapping[str, Any]]], title: str = "") -> Any:
    """A matplotlib Figure with one panel per :data:`PANELS` entry, sharing the step axis.

    ``runs`` maps each run's label to its records (cleaned by :func:`clean_records`), in the
    order the runs are drawn. A legend names the lines of a panel when the figure has several
    runs, or the panel several lines.
    """
    figure_class, canvas_class = _matplotlib()
    figure = figure_class(figsize=(8, PANEL_HEIGHT * len(PANELS)), layout="constrained")
    canvas_class(figure)  # attaches itself to the figure: savefig then renders with Agg
    axes = figure.subplots(len(PANELS), 1, sharex=True)
    memory = memory_keys(runs)
    several = len(runs) > 1
    for ax, (panel_title, panel_key) in zip(axes, PANELS, strict=True):
        for index, (name, records) in enumerate(runs.items()):
            color = f"C{index % 10}"  # a run keeps its colour in every panel
            if panel_key != MEMORY:
                steps, values = series(records, panel_key)
                if steps:
                    # Evaluations are few points: markers show where each one was taken.
                    marker = "o" if panel_key == EVAL_LOSS else None
                    ax.plot(steps, values, label=name, color=color, marker=marker, markersize=3)
                continue
            for key_index, key in enumerate(memory):
                steps, values = series(records, key)
                if steps:
                    label = f"{name} {memory_kind(key)}" if several else memory_kind(key)
                    style = LINE_STYLES[key_index % len(LINE_STYLES)]
                    ax.plot(steps, values, label=label, color=color, linestyle=style)
        ax.set_title(panel_title, loc="left")
        ax.grid(alpha=0.3)
        lines = ax.get_lines()
        if not lines:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="gray")
        elif several or len(lines) > 1:
            ax.legend(fontsize="small")
    axes[-1].set_xlabel("step")
    if title:
        figure.suptitle(title)
    return figure


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


def load_run(metrics_file: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The cleaned records of one metrics file and the notes on what was left out of it."""
    from forge_lm.metrics.jsonl import read_metrics

    try:
        records = read_metrics(metrics_file)
    except UnicodeDecodeError:
        raise UsageError(f"'{metrics_file}' is not a text file; give the metrics.jsonl of a run.") from None
    except ValueError as exc:  # a damaged line; the message names the file and the line
        raise UsageError(f"{exc}. Remove or repair that line to plot the rest.") from None
    except OSError as exc:
        raise UsageError(f"cannot read '{metrics_file}': {exc.strerror or exc}.") from None
    records, omissions = clean_records(records)
    notes = [f"{metrics_file}: left out {', '.join(omissions)}."] if omissions else []
    if not any(key in PLOTTED or is_memory_key(key) for record in records for key in record):
        raise UsageError(
            f"'{metrics_file}' has no {LOSS}, {LEARNING_RATE} or {TOKENS_PER_SECOND} records to plot "
            f"(nor {EVAL_LOSS} or memory/..._gib ones)."
        )
    return records, notes


def plot_runs(run_dirs: Sequence[str | Path], output: str | Path | None = None, notes: list[str] | None = None) -> Path:
    """Draw the metrics of ``run_dirs`` over each other into ``output``; return its path.

    Each entry of ``run_dirs`` is a run directory or its metrics file. ``output`` defaults to
    ``metrics.png`` in the run's directory for one run, and to ``compare.png`` in the first
    run's directory for several. What was left out of a metrics file is appended to ``notes``
    (when given) as one sentence per file.
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
    runs: dict[str, list[dict[str, Any]]] = {}
    for name, metrics_file in zip(run_names(metrics_files), metrics_files, strict=True):
        records, file_notes = load_run(metrics_file)
        runs[name] = records
        if notes is not None:
            notes.extend(file_notes)
    if output is None:
        output = metrics_files[0].parent / (SINGLE_OUTPUT if len(runs) == 1 else COMPARE_OUTPUT)
        # In the run: a link there is refused, not written through (out of the run).
        refuse_links(output.parent, [output.name], "Remove the link, or name the image with --output PNG.")
    output = Path(output)
    figure = build_figure(runs, title=next(iter(runs)) if len(runs) == 1 else "")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        # The format follows the suffix (.png by default; .svg and .pdf work too).
        figure.savefig(output, dpi=DPI)
    except OSError as exc:
        raise UsageError(f"cannot write '{output}': {exc.strerror or exc}.") from None
    except ValueError as exc:  # matplotlib's answer to a suffix it has no writer for
        raise UsageError(f"cannot write '{output}': {exc} Use a .png output.") from None
    return output


def plot_run(run_dir: str | Path, output: str | Path | None = None, notes: list[str] | None = None) -> Path:
    """Draw one run's metrics into ``output`` (default ``<run_dir>/metrics.png``); return its path.

    ``run_dir`` may also be the metrics file itself.
    """
    return plot_runs([run_dir], output, notes)


def _matplotlib() -> tuple[type, type]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PluginError(
            f"plotting needs matplotlib, which is not installed. Install it with `{INSTALL_HINT}`."
        ) from None
    return Figure, FigureCanvasAgg
