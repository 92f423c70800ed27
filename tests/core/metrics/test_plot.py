"""``forge plot``: a PNG of loss, learning rate and tokens/s against the step, from metrics.jsonl."""

from __future__ import annotations

import json
import struct
import sys

import pytest

from forge_lm.cli import main
from forge_lm.errors import PluginError, UsageError
from forge_lm.metrics import plot as plot_module
from forge_lm.metrics.plot import build_figure, plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

RECORDS = [
    {"step": 10, "loss": 4.5, "lr": 1e-4, "tokens_per_sec": 1000.0},
    {"step": 20, "loss": 3.75, "lr": 2e-4, "tokens_per_sec": 1100.0},
    {"step": 20, "eval/loss": 3.9},
    {"step": 30, "loss": 3.25, "lr": 1.5e-4, "tokens_per_sec": 1050.0, "grad_norm": 0.5},
    {"step": 40, "loss": 3.0, "lr": 1e-4, "tokens_per_sec": 1200.0},
    {"step": 40, "eval/loss": 3.5},
]


@pytest.fixture
def run_dir(tmp_path):
    """A run directory whose metrics.jsonl holds RECORDS, written as the jsonl backend writes."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    return tmp_path


def lines_by_panel(figure) -> dict[str, dict[str, tuple[list, list]]]:
    return {
        ax.get_title(loc="left"): {
            line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()
        }
        for ax in figure.axes
    }


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"  # the first chunk, holding width and height
    return struct.unpack(">II", data[16:24])


def test_figure_draws_each_series_at_the_steps_that_logged_it():
    figure = build_figure(RECORDS)

    assert lines_by_panel(figure) == {
        "loss": {"train": ([10, 20, 30, 40], [4.5, 3.75, 3.25, 3.0]), "eval": ([20, 40], [3.9, 3.5])},
        "learning rate": {"lr": ([10, 20, 30, 40], [1e-4, 2e-4, 1.5e-4, 1e-4])},
        "tokens / s": {"tokens/s": ([10, 20, 30, 40], [1000.0, 1100.0, 1050.0, 1200.0])},
    }
    assert figure.axes[-1].get_xlabel() == "step"


def test_a_series_never_logged_leaves_its_panel_marked_not_logged():
    figure = build_figure([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}])

    throughput = figure.axes[2]
    assert throughput.get_lines() == []
    assert [text.get_text() for text in throughput.texts] == ["not logged"]


def test_plot_run_writes_a_png_of_the_figure_drawn_from_the_file(run_dir, monkeypatch):
    drawn = []

    def recording_build_figure(records, title=""):
        figure = build_figure(records, title)
        drawn.append(figure)
        return figure

    monkeypatch.setattr(plot_module, "build_figure", recording_build_figure)

    output = plot_run(run_dir)

    assert output == run_dir / "metrics.png"
    assert png_size(output) == (8 * 120, round(7.8 * 120))  # figsize 8 x 7.8 inches at 120 dpi
    (figure,) = drawn
    assert lines_by_panel(figure)["loss"]["train"] == ([10, 20, 30, 40], [4.5, 3.75, 3.25, 3.0])
    assert figure.get_suptitle() == run_dir.name


def test_plot_run_accepts_the_metrics_file_itself_and_an_output_path(run_dir, tmp_path):
    output = plot_run(run_dir / "metrics.jsonl", tmp_path / "out" / "curves.png")

    assert output == tmp_path / "out" / "curves.png"
    assert output.read_bytes().startswith(PNG_SIGNATURE)


def test_a_run_without_a_metrics_file_is_refused_with_what_to_give(tmp_path):
    with pytest.raises(UsageError, match=r"no metrics file at '.*metrics.jsonl'. Give the run directory of a run"):
        plot_run(tmp_path)


def test_a_last_line_cut_short_by_a_crash_is_left_out(run_dir, monkeypatch):
    with (run_dir / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 50, "loss"')  # a crash in the middle of a write
    drawn = []

    def recording_build_figure(records, title=""):
        drawn.append(records)
        return build_figure(records, title)

    monkeypatch.setattr(plot_module, "build_figure", recording_build_figure)

    plot_run(run_dir)

    assert drawn == [RECORDS]


def test_a_damaged_line_inside_the_file_is_named(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[2] = '{"step": 20, eval}\n'
    (run_dir / "metrics.jsonl").write_text("".join(lines))

    with pytest.raises(UsageError, match=r"metrics.jsonl: line 3 is not valid JSON: .* Remove or repair that line"):
        plot_run(run_dir)


def test_a_metrics_file_with_nothing_to_plot_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "grad_norm": 0.5}\n')

    with pytest.raises(UsageError, match="has no loss, lr or tokens_per_sec records to plot"):
        plot_run(tmp_path)


def test_an_output_suffix_matplotlib_cannot_write_asks_for_png(run_dir):
    with pytest.raises(UsageError, match=r"cannot write '.*plot\.xyz': .*Use a \.png output"):
        plot_run(run_dir, run_dir / "plot.xyz")


def test_without_matplotlib_the_error_names_the_extra(run_dir, monkeypatch):
    # What absent modules look like to import, even after an earlier test imported them.
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)

    with pytest.raises(PluginError, match=r"`pip install forge-lm\[plot\]`"):
        plot_run(run_dir)


def test_forge_plot_writes_the_png_and_says_where(run_dir, capsys):
    code = main(["plot", str(run_dir)])

    assert code == 0
    assert capsys.readouterr().out == f"wrote {run_dir / 'metrics.png'}\n"
    assert (run_dir / "metrics.png").read_bytes().startswith(PNG_SIGNATURE)


def test_forge_plot_output_option_chooses_the_file(run_dir, tmp_path, capsys):
    code = main(["plot", str(run_dir), "--output", str(tmp_path / "plot.png")])

    assert code == 0
    assert (tmp_path / "plot.png").read_bytes().startswith(PNG_SIGNATURE)


def test_forge_plot_of_a_directory_without_metrics_exits_2_with_the_message(tmp_path, capsys):
    code = main(["plot", str(tmp_path)])

    assert code == 2
    assert capsys.readouterr().err.startswith(f"forge: error: no metrics file at '{tmp_path / 'metrics.jsonl'}'")


def test_forge_plot_takes_no_config_overrides(run_dir, capsys):
    code = main(["plot", str(run_dir), "--model.dim=64"])

    assert code == 2
    assert "unrecognized arguments: --model.dim=64" in capsys.readouterr().err
