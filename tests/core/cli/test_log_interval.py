"""Which steps ``forge train`` logs: step 1 (the starting loss), every ``metrics.log_interval``
steps, and the last."""

from __future__ import annotations

import forge_lm.cli._main as cli_main
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.testing._references import read_console

TINY = (
    *TINY_MODEL,
    "--train.batch_size=2",
    "--train.seq_len=16",
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--data.name=synthetic",
    '--metrics.backends=["console", "jsonl"]',
)


def test_step_one_the_interval_and_the_last_step_are_logged_to_every_backend(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli_main, "plugin_manager", lambda args: PluginManager(PluginSettings(autoload=False)))
    run_dir = tmp_path / "run"

    code = cli_main.main(
        ["train", *TINY, "--train.max_steps=10", "--metrics.log_interval=4", f"--train.output_dir={run_dir}"]
    )

    assert code == 0
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 4, 8, 10]
    assert [step for step, _ in read_console(run_dir, capsys.readouterr().out)] == [1, 4, 8, 10]


def test_a_resumed_run_does_not_log_its_first_step_again(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli_main, "plugin_manager", lambda args: PluginManager(PluginSettings(autoload=False)))
    run_dir = tmp_path / "run"
    common = ["train", *TINY, "--metrics.log_interval=4", f"--train.output_dir={run_dir}"]

    assert cli_main.main([*common, "--train.max_steps=2"]) == 0
    assert cli_main.main([*common, "--train.max_steps=5"]) == 0

    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 4, 5]
