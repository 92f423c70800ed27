"""``forge plot``: a PNG of loss, learning rate and tokens/s against the step, from metrics.jsonl."""

from __future__ import annotations

import json
import struct
import sys

import pytest

from forge_lm import hookimpl
from forge_lm.cli import main
from forge_lm.errors import PluginError, UsageError
from forge_lm.metrics import plot as plot_module
from forge_lm.metrics.plot import build_figure, plot_run, plot_runs, run_names
from forge_lm.metrics.plot_panels import PlotPanel
from forge_lm.plugins import PluginHookFailed, PluginManager, PluginSettings
from forge_lm.run_links import LinkInRunDir

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
    figure = build_figure({"run": RECORDS})

    assert lines_by_panel(figure) == {
        "loss": {"run": ([10, 20, 30, 40], [4.5, 3.75, 3.25, 3.0])},
        "eval loss": {"run": ([20, 40], [3.9, 3.5])},
        "learning rate": {"run": ([10, 20, 30, 40], [1e-4, 2e-4, 1.5e-4, 1e-4])},
        "tokens / s": {"run": ([10, 20, 30, 40], [1000.0, 1100.0, 1050.0, 1200.0])},
        "memory (GiB)": {},
    }
    assert figure.axes[-1].get_xlabel() == "step"
    assert [ax.get_legend() for ax in figure.axes[:4]] == [None] * 4  # one run, one line: no legend needed


def test_a_series_never_logged_leaves_its_panel_marked_not_logged():
    figure = build_figure({"run": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}]})

    for ax in figure.axes[1:]:
        assert ax.get_lines() == []
        assert [text.get_text() for text in ax.texts] == ["not logged"]
    assert list(figure.axes[0].texts) == []


def legend_labels(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


def test_several_runs_are_drawn_over_each_other_labelled_by_name_in_one_colour_each():
    other = [
        {"step": 10, "loss": 5.0, "lr": 3e-4, "tokens_per_sec": 900.0},
        {"step": 20, "loss": 4.0, "lr": 3e-4, "tokens_per_sec": 950.0},
    ]
    figure = build_figure({"base": RECORDS, "lion": other})

    panels = lines_by_panel(figure)
    assert panels["loss"] == {"base": ([10, 20, 30, 40], [4.5, 3.75, 3.25, 3.0]), "lion": ([10, 20], [5.0, 4.0])}
    assert panels["eval loss"] == {"base": ([20, 40], [3.9, 3.5])}  # lion never evaluated
    assert panels["learning rate"]["lion"] == ([10, 20], [3e-4, 3e-4])
    assert panels["tokens / s"]["lion"] == ([10, 20], [900.0, 950.0])
    loss, eval_loss, lr, throughput, memory = figure.axes
    assert legend_labels(loss) == ["base", "lion"]
    assert legend_labels(eval_loss) == ["base"]  # a lone line still names its run
    colours = {line.get_label(): line.get_color() for ax in (loss, lr, throughput) for line in ax.get_lines()}
    assert colours == {"base": "C0", "lion": "C1"}
    assert eval_loss.get_lines()[0].get_color() == "C0"
    assert [text.get_text() for text in memory.texts] == ["not logged"]
    assert figure.get_suptitle() == ""


CPU_MEMORY = [{"step": 1, "loss": 3.0, "memory/rss_gib": 1.5}, {"step": 2, "loss": 2.5, "memory/rss_gib": 1.75}]
CUDA_MEMORY = [
    {
        "step": 1,
        "loss": 3.0,
        "memory/peak_gib": 9.0,
        "memory/allocated_gib": 4.0,
        "memory/reserved_gib": 10.0,
        "memory/alloc_retries": 0.0,
    },
    {"step": 2, "loss": 2.0, "memory/allocated_gib": 4.5, "memory/reserved_gib": 10.0, "memory/peak_gib": 9.5},
]


def test_the_memory_panel_draws_every_gib_key_a_run_logged():
    figure = build_figure({"gpu": CUDA_MEMORY})

    memory = figure.axes[4]
    assert lines_by_panel(figure)["memory (GiB)"] == {  # alloc_retries is a count, not memory
        "allocated": ([1, 2], [4.0, 4.5]),
        "reserved": ([1, 2], [10.0, 10.0]),
        "peak": ([1, 2], [9.0, 9.5]),
    }
    assert legend_labels(memory) == ["allocated", "reserved", "peak"]
    assert [line.get_linestyle() for line in memory.get_lines()] == ["-", "--", ":"]


def test_memory_of_several_runs_is_labelled_by_run_and_kind():
    figure = build_figure({"gpu": CUDA_MEMORY, "cpu": CPU_MEMORY})

    memory = figure.axes[4]
    assert lines_by_panel(figure)["memory (GiB)"] == {
        "gpu allocated": ([1, 2], [4.0, 4.5]),
        "gpu reserved": ([1, 2], [10.0, 10.0]),
        "gpu peak": ([1, 2], [9.0, 9.5]),
        "cpu rss": ([1, 2], [1.5, 1.75]),
    }
    assert [(line.get_color(), line.get_linestyle()) for line in memory.get_lines()] == [
        ("C0", "-"),
        ("C0", "--"),
        ("C0", ":"),
        ("C1", "-."),
    ]


def test_plot_run_writes_a_png_of_the_figure_drawn_from_the_file(run_dir, monkeypatch):
    drawn = []

    def recording_build_figure(runs, title="", panels=None):
        figure = build_figure(runs, title, panels)
        drawn.append(figure)
        return figure

    monkeypatch.setattr(plot_module, "build_figure", recording_build_figure)

    output = plot_run(run_dir)

    assert output == run_dir / "metrics.png"
    assert png_size(output) == (8 * 120, round(5 * 2.3 * 120))  # figsize 8 x 11.5 inches at 120 dpi
    (figure,) = drawn
    assert lines_by_panel(figure)["loss"][run_dir.name] == ([10, 20, 30, 40], [4.5, 3.75, 3.25, 3.0])
    assert figure.get_suptitle() == run_dir.name


def test_plot_run_accepts_the_metrics_file_itself_and_an_output_path(run_dir, tmp_path):
    output = plot_run(run_dir / "metrics.jsonl", tmp_path / "out" / "curves.png")

    assert output == tmp_path / "out" / "curves.png"
    assert output.read_bytes().startswith(PNG_SIGNATURE)


def test_a_run_without_a_metrics_file_is_refused_with_what_to_give(tmp_path):
    with pytest.raises(UsageError, match=r"no metrics file at '.*metrics.jsonl'. Give the run directory of a run"):
        plot_run(tmp_path)


def test_a_run_whose_metrics_file_is_a_link_out_of_it_is_refused_and_the_file_itself_is_plotted(run_dir, tmp_path):
    outside = tmp_path.parent / f"{tmp_path.name}-outside.jsonl"
    (run_dir / "metrics.jsonl").rename(outside)
    (run_dir / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(LinkInRunDir, match=r"metrics\.jsonl' is a symbolic link .* Give the file it points to"):
        plot_run(run_dir)
    assert not (run_dir / "metrics.png").exists()
    assert plot_run(outside, tmp_path / "curves.png").read_bytes().startswith(PNG_SIGNATURE)  # named: read


def test_a_last_line_cut_short_by_a_crash_is_left_out(run_dir, monkeypatch):
    with (run_dir / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 50, "loss"')  # a crash in the middle of a write
    drawn = []

    def recording_build_figure(runs, title="", panels=None):
        drawn.append(runs)
        return build_figure(runs, title, panels)

    monkeypatch.setattr(plot_module, "build_figure", recording_build_figure)
    notes = []

    plot_run(run_dir, notes=notes)

    assert drawn == [{run_dir.name: RECORDS}]
    assert notes == []


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


def write_run(path, records) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))


def recording(monkeypatch) -> list:
    """Replace build_figure by one that keeps what it was given (runs, title)."""
    drawn = []

    def recording_build_figure(runs, title="", panels=None):
        drawn.append((runs, title))
        return build_figure(runs, title, panels)

    monkeypatch.setattr(plot_module, "build_figure", recording_build_figure)
    return drawn


def test_plot_runs_draws_each_run_under_its_directory_name_into_compare_png(tmp_path, monkeypatch):
    write_run(tmp_path / "base", RECORDS)
    write_run(tmp_path / "lion", [{"step": 10, "loss": 5.0}])
    drawn = recording(monkeypatch)

    output = plot_runs([tmp_path / "base", tmp_path / "lion" / "metrics.jsonl"])

    assert output == tmp_path / "base" / "compare.png"  # the first run's directory
    assert output.read_bytes().startswith(PNG_SIGNATURE)
    ((runs, title),) = drawn
    assert runs == {"base": RECORDS, "lion": [{"step": 10, "loss": 5.0}]}
    assert list(runs) == ["base", "lion"]  # drawn in the order given
    assert title == ""


def test_runs_of_the_same_name_are_told_apart_by_their_parent_folders(tmp_path):
    files = [tmp_path / "sweep-a" / "run" / "metrics.jsonl", tmp_path / "sweep-b" / "run" / "metrics.jsonl"]
    assert run_names([*files, tmp_path / "other" / "metrics.jsonl"]) == ["sweep-a/run", "sweep-b/run", "other"]
    deeper = [tmp_path / "x" / "a" / "run" / "metrics.jsonl", tmp_path / "y" / "a" / "run" / "metrics.jsonl"]
    assert run_names(deeper) == ["x/a/run", "y/a/run"]
    one_folder = [tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "old.jsonl"]
    assert run_names(one_folder) == ["metrics.jsonl", "old.jsonl"]


def test_plot_runs_labels_two_runs_of_one_name_with_their_parents(tmp_path, monkeypatch):
    write_run(tmp_path / "sweep-a" / "run", RECORDS)
    write_run(tmp_path / "sweep-b" / "run", RECORDS[:2])
    drawn = recording(monkeypatch)

    plot_runs([tmp_path / "sweep-a" / "run", tmp_path / "sweep-b" / "run"], tmp_path / "out.png")

    ((runs, _),) = drawn
    assert list(runs) == ["sweep-a/run", "sweep-b/run"]


def test_the_same_run_given_twice_is_refused(run_dir):
    with pytest.raises(UsageError, match=r"are the same run; give each run once"):
        plot_runs([run_dir, run_dir / "metrics.jsonl"])


def test_one_run_without_a_metrics_file_among_several_is_named(run_dir, tmp_path):
    with pytest.raises(UsageError, match=r"no metrics file at '.*missing.metrics.jsonl'"):
        plot_runs([run_dir, tmp_path / "missing"])


def test_untrusted_records_are_left_out_with_a_note_saying_what(run_dir, monkeypatch):
    damaged = [
        [1, 2, 3],
        "text",
        {"loss": 9.0},  # no step
        {"step": "10", "loss": 9.0},
        {"step": -1, "loss": 9.0},
        {"step": True, "loss": 9.0},
        {"step": 50, "loss": "nan", "lr": None, "tokens_per_sec": True},
        {"step": 60, "loss": float("nan"), "lr": float("inf"), "eval/loss": 10**400, "memory/rss_gib": {"a": 1}},
        {"step": 70.0, "loss": 2.5, "grad_norm": "kept: nothing draws it"},
    ]
    with (run_dir / "metrics.jsonl").open("a") as handle:
        handle.write("".join(json.dumps(record) + "\n" for record in damaged))
    drawn = recording(monkeypatch)
    notes = []

    plot_run(run_dir, notes=notes)

    ((runs, _),) = drawn
    assert runs[run_dir.name] == [
        *RECORDS,
        {"step": 50},
        {"step": 60},
        {"step": 70, "loss": 2.5, "grad_norm": "kept: nothing draws it"},
    ]
    assert notes == [
        f"{run_dir / 'metrics.jsonl'}: left out 2 lines that are not a JSON object, 4 records without a "
        "whole-number 'step', 7 values that are not a finite number: eval/loss (1), loss (2), lr (2), "
        "memory/rss_gib (1), tokens_per_sec (1)."
    ]
    figure = build_figure(runs)
    assert lines_by_panel(figure)["loss"][run_dir.name] == ([10, 20, 30, 40, 70], [4.5, 3.75, 3.25, 3.0, 2.5])


def test_a_file_left_with_nothing_to_plot_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"loss": 1.0}\n{"step": 1, "loss": null}\n[]\n')

    with pytest.raises(UsageError, match="has no loss, lr or tokens_per_sec records to plot"):
        plot_run(tmp_path)


def test_a_file_with_only_memory_records_is_plotted(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "memory/rss_gib": 0.5}\n')
    drawn = recording(monkeypatch)

    plot_run(tmp_path)

    ((runs, _),) = drawn
    assert lines_by_panel(build_figure(runs))["memory (GiB)"] == {"rss": ([1], [0.5])}


def test_a_metrics_file_that_is_not_text_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe\x00\x01\n")

    with pytest.raises(UsageError, match=r"metrics.jsonl' is not a text file"):
        plot_run(tmp_path)


def test_forge_plot_of_several_runs_writes_compare_png_and_prints_the_notes(tmp_path, capsys):
    write_run(tmp_path / "a", RECORDS)
    write_run(tmp_path / "b", [*RECORDS[:2], {"step": 50, "loss": "high"}])

    code = main(["plot", str(tmp_path / "a"), str(tmp_path / "b")])

    assert code == 0
    captured = capsys.readouterr()
    assert captured.out == f"wrote {tmp_path / 'a' / 'compare.png'}\n"
    assert captured.err == (
        f"forge: note: {tmp_path / 'b' / 'metrics.jsonl'}: left out 1 value that is not a finite number: loss (1).\n"
    )
    assert (tmp_path / "a" / "compare.png").read_bytes().startswith(PNG_SIGNATURE)


def test_forge_plot_help_names_the_panels_and_the_default_outputs(capsys):
    with pytest.raises(SystemExit):
        main(["plot", "--help"])

    out = " ".join(capsys.readouterr().out.split())
    assert "RUN_DIR [RUN_DIR ...]" in out
    assert "loss, eval loss (every named set's too), learning rate, tokens/s and memory" in out
    assert "the panels plugins add (forge- moe: load balance and drops per layer)" in out  # argparse breaks at '-'
    assert "RUN_DIR/metrics.png for one run, compare.png in the first RUN_DIR for several" in out


NAMED_SETS = [
    {"step": 10, "loss": 4.0},
    {"step": 10, "eval/code/loss": 3.5, "eval/code/perplexity": 33.1, "eval/prose/loss": 4.25},
    {"step": 20, "loss": 3.0},
    {"step": 20, "eval/code/loss": 3.0, "eval/code/perplexity": 20.1, "eval/prose/loss": 3.75},
]


def test_a_run_that_evaluated_named_sets_draws_each_set_labelled_with_its_name():
    figure = build_figure({"run": NAMED_SETS})

    eval_loss = figure.axes[1]
    assert lines_by_panel(figure)["eval loss"] == {"code": ([10, 20], [3.5, 3.0]), "prose": ([10, 20], [4.25, 3.75])}
    assert list(eval_loss.texts) == []  # not "not logged"
    assert legend_labels(eval_loss) == ["code", "prose"]
    assert [line.get_marker() for line in eval_loss.get_lines()] == ["o", "o"]


def test_named_sets_and_the_held_out_split_of_several_runs_are_labelled_by_run_and_set():
    figure = build_figure({"sets": NAMED_SETS, "split": RECORDS})

    assert lines_by_panel(figure)["eval loss"] == {
        "sets code": ([10, 20], [3.5, 3.0]),
        "sets prose": ([10, 20], [4.25, 3.75]),
        "split held-out split": ([20, 40], [3.9, 3.5]),
    }


def test_a_file_of_named_set_evaluations_only_is_plotted_and_its_bad_values_noted(tmp_path, monkeypatch):
    records = [{"step": 5, "eval/code/loss": 2.5}, {"step": 6, "eval/code/loss": "NaN"}]
    write_run(tmp_path / "run", records)
    drawn = recording(monkeypatch)
    notes = []

    plot_run(tmp_path / "run", notes=notes)

    ((runs, _),) = drawn
    assert lines_by_panel(build_figure(runs))["eval loss"] == {"code": ([5], [2.5])}
    assert notes == [
        f"{tmp_path / 'run' / 'metrics.jsonl'}: left out 1 value that is not a finite number: eval/code/loss (1)."
    ]


class PanelPlugin:
    """A plugin adding one panel of the 'gate/<i>' keys the runs logged (and nothing else)."""

    FORGE_LM_PLUGIN_API = ">=1,<2"
    seen: list = []

    @hookimpl
    def forge_lm_plot_panels(self, keys):
        self.seen.append(keys)
        gates = sorted(key for key in keys if key.startswith("gate/"))
        return [PlotPanel("gates", [(key, key.removeprefix("gate/")) for key in gates])] if gates else None


def manager_with(plugin, name="panels"):
    manager = PluginManager(PluginSettings(), entry_points=False)
    manager.add_plugin(plugin, name)
    return manager


def test_a_plugin_panel_follows_the_core_panels_with_the_keys_it_chose(tmp_path):
    records = [{"step": 1, "loss": 2.0, "gate/a": 0.5, "gate/b": 0.25}, {"step": 2, "loss": 1.5, "gate/a": 0.75}]
    write_run(tmp_path / "run", records)
    plugin = PanelPlugin()
    plugin.seen = []
    drawn = []
    real = plot_module.build_figure

    def keep(runs, title="", panels=None):
        drawn.append(real(runs, title, panels))
        return drawn[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plot_module, "build_figure", keep)
        plot_run(tmp_path / "run", manager=manager_with(plugin))

    assert plugin.seen == [frozenset({"loss", "gate/a", "gate/b"})]
    (figure,) = drawn
    assert [ax.get_title(loc="left") for ax in figure.axes] == [
        "loss",
        "eval loss",
        "learning rate",
        "tokens / s",
        "memory (GiB)",
        "gates",
    ]
    assert lines_by_panel(figure)["gates"] == {"a": ([1, 2], [0.5, 0.75]), "b": ([1], [0.25])}
    assert [line.get_color() for line in figure.axes[5].get_lines()] == ["C0", "C1"]  # one run: a colour per key


class BadPanelPlugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    @hookimpl
    def forge_lm_plot_panels(self, keys):
        return {"title": "gates"}


def test_a_plugin_returning_anything_but_panels_is_named(run_dir):
    with pytest.raises(PluginHookFailed, match=r"plugin 'bad' .* returned dict from forge_lm_plot_panels"):
        plot_run(run_dir, manager=manager_with(BadPanelPlugin(), "bad"))


@pytest.mark.parametrize(
    ("title", "lines", "problem"),
    [("", [("k", None)], "title"), ("t", [], "at least one"), ("t", [("k", 3)], "metric key, label")],
)
def test_a_malformed_panel_is_refused_where_it_is_made(title, lines, problem):
    with pytest.raises(ValueError, match=problem):
        PlotPanel(title, lines)
