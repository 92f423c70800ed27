"""Reading a metrics.jsonl back: every record in order, tolerant of a crash mid-write only."""

from __future__ import annotations

import math

import pytest

from forge_lm.components import MetricsContext
from forge_lm.default_plugins.metrics import JsonlOptions
from forge_lm.metrics.jsonl import build_jsonl, read_metrics


def test_read_metrics_returns_what_the_backend_wrote_including_nan(tmp_path):
    backend = build_jsonl(JsonlOptions(), MetricsContext(run_dir=tmp_path))
    backend.start({}, [])
    backend.log(1, {"loss": 3.25, "lr": 1e-4})
    backend.log(2, {"loss": float("nan")})
    backend.finish({})

    records = read_metrics(tmp_path / "metrics.jsonl")

    assert records[0] == {"step": 1, "loss": 3.25, "lr": 1e-4}
    assert records[1]["step"] == 2
    assert math.isnan(records[1]["loss"])


def test_read_metrics_skips_a_last_line_cut_short(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n\n{"step": 2, "lo')

    assert read_metrics(path) == [{"step": 1, "loss": 2.5}]


def test_read_metrics_keeps_a_complete_last_line_without_its_newline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}')

    assert read_metrics(path) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]


def test_read_metrics_names_a_damaged_line_that_is_not_the_last(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, lo\n{"step": 3, "loss": 2.0}\n')

    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not valid JSON"):
        read_metrics(path)
