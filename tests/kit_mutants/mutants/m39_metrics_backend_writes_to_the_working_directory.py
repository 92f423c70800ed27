"""A metrics backend that writes 'corpus-metrics.jsonl' relative to the working directory,
forgetting the run directory."""

from pathlib import Path

from kit_mutant_base import JsonLinesBackend

CATEGORY = "metrics_backends"
EXPECTED_CHECK = "writes_nowhere_but_the_run_directory"


def factory(options, context):
    backend = JsonLinesBackend(context.run_dir)
    backend.path = Path("corpus-metrics.jsonl")  # bug: not under context.run_dir
    return backend
