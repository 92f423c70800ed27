"""``forge plot RUN_DIR [--output PNG]``: loss, learning rate and throughput of a run, as a PNG."""

from __future__ import annotations

HELP = "plot a run's loss, learning rate and tokens/s (from its metrics.jsonl) into a PNG"
TAKES_OVERRIDES = False


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding metrics.jsonl (or the file itself)")
    parser.add_argument(
        "--output", "-o", metavar="PNG", default=None, help="image to write (default: RUN_DIR/metrics.png)"
    )


def run(args, overrides, plugins) -> int:
    # Plotting reads a file and needs no plugins, so `plugins` is never called.
    from forge_lm.metrics.plot import plot_run

    output = plot_run(args.run_dir, args.output)
    print(f"wrote {output}")
    return 0
