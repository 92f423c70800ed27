"""Reading a metrics.jsonl back: every record in order, tolerant of a crash mid-write only."""

from __future__ import annotations

import json
import math

import pytest

from forge_lm.components import MetricsContext
from forge_lm.default_plugins.options.metrics import JsonlOptions
from forge_lm.metrics.jsonl import build_jsonl, last_logged, read_metrics


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


def _refuse(constant: str) -> None:
    raise ValueError(f"not strict JSON: {constant}")


def test_non_finite_numbers_are_written_as_null_with_their_spelling_beside(tmp_path):
    backend = build_jsonl(JsonlOptions(), MetricsContext(run_dir=tmp_path))
    backend.start({}, [])
    backend.log(4, {"loss": float("inf"), "lr": 1e-4, "grad_norm": float("-inf"), "x": float("nan")})
    backend.finish({})

    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line, parse_constant=_refuse) == {
        "step": 4, "loss": None, "lr": 1e-4, "grad_norm": None, "x": None,
        "nonfinite": {"loss": "inf", "grad_norm": "-inf", "x": "nan"},
    }  # fmt: skip
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert (record["loss"], record["grad_norm"], record["lr"]) == (math.inf, -math.inf, 1e-4)
    assert math.isnan(record["x"])
    assert set(record) == {"step", "loss", "lr", "grad_norm", "x"}


def test_read_metrics_reads_the_bare_nan_and_infinity_older_runs_wrote(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": NaN, "grad_norm": Infinity, "lr": -Infinity}\n')

    (record,) = read_metrics(path)
    assert math.isnan(record["loss"])
    assert (record["grad_norm"], record["lr"]) == (math.inf, -math.inf)
    assert last_logged(path, "grad_norm") == (1, math.inf)


def test_a_spelling_map_that_is_not_the_writers_is_left_as_it_is(tmp_path):
    """A hand-edited or hostile file: only a null beside a known spelling becomes a number."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0, "a": null, "nonfinite": {"loss": "nan", "a": "huge", "b": "inf"}}\n')

    assert read_metrics(path) == [{"step": 1, "loss": 2.0, "a": None}]


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
