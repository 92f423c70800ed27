"""``forge eval``: the table printed, the results JSON written into the run, the options, and one
clear message (exit 2, no traceback) for each thing that can be wrong, a missing plugin first."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from forge_lm.cli import _main
from forge_lm.cli._main import main
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train.inference import load_for_inference
from forge_lm_eval.harness import TaskSet, metrics_of, run_tasks
from forge_lm_eval.lm import ForgeLM

from .conftest import CHOICE, ROLLING, TASKS


@pytest.fixture
def run_dir(make_run, tmp_path):
    """A copy of the tiny bytes run, so that results written into it stay with this test."""
    return shutil.copytree(make_run("bytes"), tmp_path / "run")


def forge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "forge_lm", *args], capture_output=True, text=True, cwd=TASKS, timeout=300
    )


def test_forge_eval_prints_lm_evals_table_and_writes_the_results_into_the_run(run_dir):
    done = forge("eval", str(run_dir), "--tasks", "choice.yaml,rolling.yaml")

    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert table[0].split("|")[1].strip() == "Tasks"
    assert [row.split("|")[5].strip() for row in table[2:]] == [
        "acc",
        "acc_norm",
        "bits_per_byte",
        "byte_perplexity",
        "word_perplexity",
    ]
    written = run_dir / "eval" / "step_2.json"
    assert done.stdout.endswith(f"wrote the results of step 2 to {written}\n")
    results = json.loads(written.read_text())
    assert {"results", "versions", "n-shot", "n-samples", "configs", "pretty_env_info", "forge"} <= set(results)
    assert results["forge"] == {"run": str(run_dir), "checkpoint": str(run_dir / "checkpoints" / "step_2"), "step": 2}
    assert set(results["results"]) == {"forge_test_choice", "forge_test_rolling"}
    assert results["n-shot"] == {"forge_test_choice": 0, "forge_test_rolling": 0}

    # The numbers are those of the bridge run directly on the checkpoint.
    model, _, tokenizer = load_for_inference(run_dir, PluginManager(PluginSettings(autoload=False)))
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.chdir(TASKS)
    try:
        direct = run_tasks(ForgeLM(model, tokenizer, max_length=64, batch_size=4), TaskSet([CHOICE, ROLLING], 64))
    finally:
        monkeypatch.undo()
    assert metrics_of(results) == pytest.approx(metrics_of(direct), rel=1e-6)


def test_results_are_never_replaced_and_a_checkpoint_and_options_can_be_named(run_dir, in_tasks_dir, tmp_path, capsys):
    checkpoint = run_dir / "checkpoints" / "step_2"
    assert main(["eval", str(run_dir), "--tasks", "choice.yaml"]) == 0
    assert main(["eval", str(checkpoint), "--tasks", "choice.yaml", "--limit", "3", "--num-fewshot", "1"]) == 0
    output = tmp_path / "elsewhere" / "results.json"
    args = ["--tasks", "choice.yaml", "--tasks", "rolling.yaml", "--batch-size", "2", "--output", str(output)]
    assert main(["eval", str(checkpoint), *args]) == 0
    assert capsys.readouterr().out.endswith(f"wrote the results of step 2 to {output}\n")
    assert main(["eval", str(run_dir), "--tasks", "rolling.yaml"]) == 0

    names = sorted(path.name for path in (run_dir / "eval").iterdir())
    assert names == ["step_2-2.json", "step_2-3.json", "step_2.json"]
    first, second = (json.loads((run_dir / "eval" / name).read_text()) for name in ("step_2.json", "step_2-2.json"))
    assert first["n-samples"]["forge_test_choice"]["effective"] == 12
    assert second["n-samples"]["forge_test_choice"]["effective"] == 3
    assert second["n-shot"] == {"forge_test_choice": 1}
    third = json.loads(output.read_text())
    assert set(third["results"]) == {"forge_test_choice", "forge_test_rolling"}
    assert third["forge"]["checkpoint"] == str(checkpoint)


def test_tasks_and_groups_of_an_include_path_can_be_named(run_dir, tmp_path, capsys):
    output = tmp_path / "group.json"
    args = ["--include-path", str(TASKS), "--tasks", "forge_test_group", "--limit", "2", "--output", str(output)]
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(TASKS)
        assert main(["eval", str(run_dir), *args]) == 0

    results = json.loads(output.read_text())
    assert results["group_subtasks"] == {"forge_test_group": ["forge_test_choice", "forge_test_complete"]}
    assert "|Groups" in capsys.readouterr().out.replace(" ", "")  # lm-eval's second table, of groups
    assert set(metrics_of(results)) >= {"eval/forge_test_group/acc", "eval/forge_test_choice/acc"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "hellaswg"], "forge: error: unknown lm-eval task 'hellaswg'. Did you mean 'hellaswag'?"),
        (["--tasks", "missing.yaml"], "forge: error: task file 'missing.yaml' does not exist"),
        (["--tasks", "choice.yaml", "--limit", "0"], "forge: error: --limit: must be > 0, got 0."),
        (["--tasks", " , "], "forge: error: --tasks: name at least one lm-eval task"),
        (["--tasks", "choice.yaml", "--include-path", "nowhere"], "forge: error: task directory 'nowhere'"),
        ([], "forge: error: the following arguments are required: --tasks"),
    ],
)
def test_mistakes_are_one_message_and_exit_2(run_dir, in_tasks_dir, capsys, args, message):
    assert main(["eval", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message)
    assert "Traceback" not in err
    assert not (run_dir / "eval").exists()


def test_a_run_without_checkpoints_is_refused_by_the_loader(run_dir, in_tasks_dir, capsys):
    shutil.rmtree(run_dir / "checkpoints")
    assert main(["eval", str(run_dir), "--tasks", "choice.yaml"]) == 2
    assert "has no checkpoint yet; train it first." in capsys.readouterr().err
    assert not (run_dir / "eval").exists()


def test_a_damaged_newer_checkpoint_is_passed_over_with_a_warning(run_dir, in_tasks_dir, capsys):
    damaged = run_dir / "checkpoints" / "step_5"
    damaged.mkdir()
    (damaged / "trainer_state.json").write_text("{not json")

    assert main(["eval", str(run_dir), "--tasks", "choice.yaml", "--limit", "2"]) == 0

    assert "forge: warning: passed over checkpoint step_5: " in capsys.readouterr().err
    assert json.loads((run_dir / "eval" / "step_2.json").read_text())["forge"]["step"] == 2


def test_a_checkpoint_whose_metadata_names_code_to_run_is_refused(run_dir, in_tasks_dir, tmp_path, capsys):
    marker = tmp_path / "ran"
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()  # a pickle calling os.system
    (run_dir / "checkpoints" / "step_2" / ".metadata").write_bytes(payload)

    assert main(["eval", str(run_dir), "--tasks", "choice.yaml"]) == 2

    assert "forge: error: refusing to load checkpoint" in capsys.readouterr().err
    assert not marker.exists()
    assert not (run_dir / "eval").exists()


def test_a_group_file_given_by_path_is_refused_with_lm_evals_reason(run_dir, in_tasks_dir, capsys):
    # lm-eval 0.4 cannot load a group by its file's path; the README says to name it instead.
    assert main(["eval", str(run_dir), "--tasks", "group.yaml"]) == 2
    err = capsys.readouterr().err
    assert "forge: error: lm-eval could not load the tasks ['group.yaml']" in err
    assert "Traceback" not in err


def test_without_the_plugin_installed_forge_eval_says_what_to_install(run_dir, monkeypatch, capsys):
    # What a machine without forge-lm-eval sees: no installed plugin is found, so no plugin adds the command.
    monkeypatch.setattr(_main, "plugin_manager", lambda args: PluginManager(PluginSettings(), entry_points=False))

    assert main(["eval", str(run_dir), "--tasks", "choice.yaml"]) == 2

    assert capsys.readouterr().err == (
        "forge: error: forge eval is a command of the forge-lm-eval plugin, which is not installed: "
        "pip install forge-lm-eval\n"
    )


def test_with_the_plugin_blocked_forge_eval_says_how_to_enable_it(run_dir):
    done = forge("eval", str(run_dir), "--tasks", "choice.yaml", "--block-plugin", "lm_eval")

    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines()[-1] == (
        "forge: error: forge eval is a command of plugin 'lm_eval' (forge-lm-eval 0.1.0), which is installed but "
        "disabled: blocked by FORGE_LM_BLOCK_PLUGINS or --block-plugin. Enable it to use its commands."
    )
    assert "Traceback" not in done.stderr
