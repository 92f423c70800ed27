"""A PNG of a run's metrics: loss, learning rate and throughput against the step.

Reads the ``metrics.jsonl`` that the jsonl backend writes. matplotlib is an optional
dependency (``pip install forge-lm[plot]``), imported when a plot is drawn. Figures are drawn
on an Agg canvas without pyplot: no display is needed, no window opens, and no global
matplotlib state (the backend of a notebook that calls this) is touched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from forge_lm.errors import PluginError, UsageError
from forge_lm.metrics import EVAL_LOSS, LEARNING_RATE, LOSS, TOKENS_PER_SECOND

INSTALL_HINT = "pip install forge-lm[plot]"
METRICS_FILE = "metrics.jsonl"

# One panel per entry: its title and the series drawn in it (key, legend label).
PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("loss", [(LOSS, "train"), (EVAL_LOSS, "eval")]),
    ("learning rate", [(LEARNING_RATE, "lr")]),
    ("tokens / s", [(TOKENS_PER_SECOND, "tokens/s")]),
]


def series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` over the records that have it (evaluation records may lack it)."""
    points = [(record["step"], float(record[key])) for record in records if key in record]
    return [step for step, _ in points], [value for _, value in points]


def build_figure(records: Sequence[Mapping[str, Any]], title: str = "") -> Any:
    """A matplotlib Figure with one panel per :data:`PANELS` entry, sharing the step axis."""
    figure_class, canvas_class = _matplotlib()
    figure = figure_class(figsize=(8, 2.6 * len(PANELS)), layout="constrained")
    canvas_class(figure)  # attaches itself to the figure: savefig then renders with Agg
    axes = figure.subplots(len(PANELS), 1, sharex=True)
    for ax, (panel_title, keys) in zip(axes, PANELS, strict=True):
        drawn = False
        for key, label in keys:
            steps, values = series(records, key)
            if steps:
                # Evaluations are few points: markers show where each one was taken.
                ax.plot(steps, values, label=label, marker="o" if key == EVAL_LOSS else None, markersize=3)
                drawn = True
        ax.set_title(panel_title, loc="left")
        ax.grid(alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="gray")
        elif len(ax.get_lines()) > 1:
            ax.legend()
    axes[-1].set_xlabel("step")
    if title:
        figure.suptitle(title)
    return figure


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Draw ``run_dir``'s metrics into ``output`` (default ``<run_dir>/metrics.png``); return its path.

    ``run_dir`` may also be the metrics file itself.
    """
    from forge_lm.metrics.jsonl import read_metrics

    run_dir = Path(run_dir)
    metrics_file = run_dir if run_dir.is_file() else run_dir / METRICS_FILE
    if not metrics_file.is_file():
        raise UsageError(
            f"no metrics file at '{metrics_file}'. Give the run directory of a run that logged with the "
            "'jsonl' metrics backend (it writes metrics.jsonl), or the metrics file itself."
        )
    try:
        records = read_metrics(metrics_file)
    except ValueError as exc:  # a damaged line; the message names the file and the line
        raise UsageError(f"{exc}. Remove or repair that line to plot the rest.") from None
    if not any(key in record for record in records for _, keys in PANELS for key, _ in keys):
        raise UsageError(f"'{metrics_file}' has no {LOSS}, {LEARNING_RATE} or {TOKENS_PER_SECOND} records to plot.")
    output = Path(output) if output is not None else metrics_file.parent / "metrics.png"
    figure = build_figure(records, title=metrics_file.parent.name)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        # The format follows the suffix (.png by default; .svg and .pdf work too).
        figure.savefig(output, dpi=120)
    except OSError as exc:
        raise UsageError(f"cannot write '{output}': {exc.strerror or exc}.") from None
    except ValueError as exc:  # matplotlib's answer to a suffix it has no writer for
        raise UsageError(f"cannot write '{output}': {exc} Use a .png output.") from None
    return output


def _matplotlib() -> tuple[type, type]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PluginError(
            f"plotting needs matplotlib, which is not installed. Install it with `{INSTALL_HINT}`."
        ) from None
    return Figure, FigureCanvasAgg
