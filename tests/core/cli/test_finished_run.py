"""``forge train`` on a run that is already finished: says so, with its last logged loss and
how to go on, instead of a "final loss nan"."""

from __future__ import annotations

from pathlib import Path

import pytest

import forge_lm.cli._main as cli_main
from forge_lm.metrics.jsonl import last_logged, read_metrics
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL

TINY = (
    *TINY_MODEL,
    "--train.batch_size=2",
    "--train.seq_len=16",
    "--train.max_steps=2",
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--data.name=synthetic",
)


@pytest.fixture
def forge(monkeypatch, capsys, tmp_path):
    """``forge(*overrides)``: ``forge train`` in-process with the tiny run into ``tmp_path/run``
    and the built-in plugins only; returns (exit code, stdout)."""
    monkeypatch.setattr(cli_main, "plugin_manager", lambda args: PluginManager(PluginSettings(autoload=False)))

    def run(*overrides: str) -> tuple[int, str]:
        capsys.readouterr()
        code = cli_main.main(["train", *TINY, f"--train.output_dir={tmp_path / 'run'}", *overrides])
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return code, out

    return run


def test_a_finished_run_says_it_is_complete_with_its_last_logged_loss(forge, tmp_path):
    run_dir = tmp_path / "run"
    assert forge('--metrics.backends=["jsonl"]')[0] == 0
    last = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r][-1]

    code, out = forge('--metrics.backends=["jsonl"]')

    assert code == 0
    assert "nan" not in out
    assert out.splitlines()[-1] == (
        f"nothing to train: run directory {run_dir} already has 2 steps (train.max_steps=2); "
        f"last logged loss {last['loss']:.4f} at step 2. "
        "To train further, run the same command with --train.max_steps=N, N above 2."
    )


def test_the_console_summary_of_a_finished_run_has_no_final_loss(forge):
    assert forge('--metrics.backends=["console"]')[0] == 0

    code, out = forge('--metrics.backends=["console"]')

    assert code == 0
    assert "summary: steps 2\n" in out
    assert "nan" not in out
    assert "last logged loss" not in out  # no metrics.jsonl to read it from
    assert "nothing to train" in out.splitlines()[-1]


def test_the_suggested_max_steps_extends_the_run(forge, tmp_path):
    assert forge('--metrics.backends=["jsonl"]')[0] == 0
    forge('--metrics.backends=["jsonl"]')

    code, out = forge('--metrics.backends=["jsonl"]', "--train.max_steps=3")

    assert code == 0
    assert out.splitlines()[-1].startswith("trained 3 steps; final loss ")
    assert "nan" not in out
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


def test_last_logged_reads_the_newest_record_holding_the_key(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 4.25}\n{"step": 2, "eval/loss": 4.5}\n')

    assert last_logged(path, "loss") == (2, 4.25)
    assert last_logged(path, "grad_norm") is None
    assert last_logged(tmp_path / "missing.jsonl", "loss") is None
    path.write_text("not json\n")
    assert last_logged(path, "loss") is None
