"""``forge plot RUN_DIR [RUN_DIR ...] [--output PNG]``: the metrics of one run, or of several
runs drawn over each other, as a PNG."""

from __future__ import annotations

import sys

HELP = (
    "plot the loss, eval loss (every named set's too), learning rate, tokens/s and memory of a run (from its "
    "metrics.jsonl), and the panels plugins add (forge-moe: load balance and drops per layer), into a PNG; give "
    "several runs to draw them over each other, each labelled with its directory's name"
)
EPILOG = (
    "A panel that no run logged is marked 'not logged'. Runs that share a directory name are told "
    "apart by their parent folders. Lines of a metrics file that are not JSON objects, records "
    "without a whole-number step and values that are not finite numbers are left out, with a note "
    "on standard error."
)
TAKES_OVERRIDES = False


def add_arguments(parser) -> None:
    parser.epilog = EPILOG
    parser.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="run directory holding metrics.jsonl (or the file itself); several are drawn in one figure",
    )
    parser.add_argument(
        "--output",
        "-o",
        metavar="PNG",
        default=None,
        help="image to write (default: RUN_DIR/metrics.png for one run, compare.png in the first RUN_DIR for several)",
    )


def run(args, overrides, plugins) -> int:
    # Plugins are loaded for their panels (forge_lm_plot_panels); --no-plugin-autoload draws the core's alone.
    from forge_lm.metrics.plot import plot_runs

    notes: list[str] = []
    output = plot_runs(args.run_dirs, args.output, notes, manager=plugins())
    for note in notes:
        print(f"forge: note: {note}", file=sys.stderr)
    print(f"wrote {output}")
    return 0
