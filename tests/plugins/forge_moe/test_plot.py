"""forge-moe's panels in ``forge plot``: load balance and drop fraction per layer, added through
the core's forge_lm_plot_panels hook from the keys the MoE layers log."""

from __future__ import annotations

import json

import pytest

from forge_lm.cli import main
from forge_lm.metrics import plot as plot_module
from forge_lm.metrics.plot import plot_run

# What a 2-layer MoE run logs (forge_moe.layer), with a named validation set.
RECORDS = [
    {
        "step": 1,
        "loss": 4.0,
        "moe/layer0/load_max": 3.23,
        "moe/layer0/load_min": 0.25,
        "moe/layer0/load_cv": 1.1,
        "moe/layer0/drop_fraction": 0.278,
        "moe/layer1/load_max": 1.5,
        "moe/layer1/load_min": 0.5,
        "moe/layer1/load_cv": 0.4,
        "moe/layer1/drop_fraction": 0.05,
        "moe/layer0/aux_loss": 0.01,
    },
    {
        "step": 2,
        "loss": 3.5,
        "moe/layer0/load_max": 2.0,
        "moe/layer0/load_min": 0.5,
        "moe/layer0/load_cv": 0.6,
        "moe/layer0/drop_fraction": 0.1,
        "moe/layer1/load_max": 1.25,
        "moe/layer1/load_min": 0.75,
        "moe/layer1/load_cv": 0.2,
        "moe/layer1/drop_fraction": 0.0,
    },
    {"step": 2, "eval/val/loss": 3.75},
]
BALANCE = "MoE load balance (per layer: max, min over the uniform share; cv)"
DROPS = "MoE drop fraction (per layer)"


@pytest.fixture
def drawn(monkeypatch) -> list:
    """The figures plot_runs draws."""
    figures = []
    real = plot_module.build_figure

    def keep(runs, title="", panels=None):
        figures.append(real(runs, title, panels))
        return figures[-1]

    monkeypatch.setattr(plot_module, "build_figure", keep)
    return figures


def panels_of(figure) -> dict[str, dict[str, tuple[list, list]]]:
    return {
        ax.get_title(loc="left"): {
            line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()
        }
        for ax in figure.axes
    }


def test_forge_plot_of_an_moe_run_draws_load_balance_and_drops_per_layer(tmp_path, drawn, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in RECORDS))

    assert main(["--plugins", "moe", "plot", str(tmp_path)]) == 0

    assert capsys.readouterr().out == f"wrote {tmp_path / 'metrics.png'}\n"
    (figure,) = drawn
    panels = panels_of(figure)
    assert list(panels)[5:] == [BALANCE, DROPS]
    assert panels[BALANCE] == {
        "layer 0 max": ([1, 2], [3.23, 2.0]),
        "layer 0 min": ([1, 2], [0.25, 0.5]),
        "layer 0 cv": ([1, 2], [1.1, 0.6]),
        "layer 1 max": ([1, 2], [1.5, 1.25]),
        "layer 1 min": ([1, 2], [0.5, 0.75]),
        "layer 1 cv": ([1, 2], [0.4, 0.2]),
    }
    assert panels[DROPS] == {"layer 0": ([1, 2], [0.278, 0.1]), "layer 1": ([1, 2], [0.05, 0.0])}
    assert panels["eval loss"] == {"val": ([2], [3.75])}  # the named set, not "not logged"


def test_layers_are_ordered_by_number_and_a_dense_run_gets_no_moe_panel(tmp_path, drawn, moe_manager):
    records = [{"step": 1, f"moe/layer{i}/drop_fraction": i / 100} for i in (10, 2, 0)]
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")

    plot_run(tmp_path / "moe", manager=moe_manager)
    plot_run(tmp_path / "dense", manager=moe_manager)

    moe, dense = drawn
    assert list(panels_of(moe)[DROPS]) == ["layer 0", "layer 2", "layer 10"]
    assert len(dense.axes) == 5  # the core's panels alone
