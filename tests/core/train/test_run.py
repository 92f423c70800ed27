"""The Run object (forge_lm.train.run): a run driven step by step from Python is the run
``forge train`` trains. Its steps' losses are train()'s bit for bit, a save and a restore bring
back the same training point (the next steps' losses again bit for bit), and its evaluation is
the loop's evaluation record. One reference train() run is shared by the module."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from forge_lm import hookimpl
from forge_lm.config import load_config
from forge_lm.errors import ConfigError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train import start_run, train

from .conftest import TINY

README = Path(__file__).resolve().parents[3] / "README.md"
STEPS = 4  # an evaluation at step 3 (TINY's eval.interval) and one at the last step


def _config(run_dir: Path, manager: PluginManager, *extra: str):
    overrides = [*TINY, f"--train.max_steps={STEPS}", f"--train.output_dir={run_dir}", *extra]
    return load_config(None, overrides, manager.registry)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One train() run of STEPS steps: its per-step losses and its evaluation records."""
    manager = PluginManager(PluginSettings(autoload=False))
    result = train(_config(tmp_path_factory.mktemp("reference") / "run", manager), manager)
    records = read_metrics(result.run_dir / "metrics.jsonl")
    return {
        "losses": [record["loss"] for record in records if "loss" in record],
        "evaluations": {record["step"]: record for record in records if "eval/loss" in record},
    }


@pytest.fixture
def fresh_manager() -> PluginManager:
    return PluginManager(PluginSettings(autoload=False))


def test_a_run_stepped_n_times_has_train_s_losses_bit_for_bit(tmp_path, fresh_manager, reference):
    with start_run(_config(tmp_path / "run", fresh_manager), fresh_manager) as run:
        assert run.step_count == 0
        assert run.resumed_at == 0
        outcomes = [run.step() for _ in range(STEPS)]
        assert all(outcome.taken and not outcome.nonfinite for outcome in outcomes)
        assert run.step_count == STEPS
        assert run.context.tokens_seen == STEPS * run.context.tokens_per_step
    assert [outcome.values()[0] for outcome in outcomes] == reference["losses"]
    assert len(reference["losses"]) == STEPS


def test_evaluate_returns_the_loops_evaluation_record(tmp_path, fresh_manager, reference):
    with start_run(_config(tmp_path / "run", fresh_manager), fresh_manager) as run:
        for _ in range(3):
            run.step()
        results = run.evaluate()
    logged = {key: value for key, value in reference["evaluations"][3].items() if key not in ("step", "time")}
    assert results == logged
    assert set(results) >= {"eval/loss", "eval/perplexity"}
    # The Run logs it to its metrics backends as the loop does: the same record, at step 3.
    (record,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval/loss" in r]
    assert record["step"] == 3
    assert record["eval/loss"] == results["eval/loss"]


def test_save_then_restore_brings_back_the_training_point(tmp_path, fresh_manager, reference):
    with start_run(_config(tmp_path / "run", fresh_manager), fresh_manager) as run:
        run.step()
        run.step()
        run.save()
        later = [run.step().values()[0] for _ in range(2)]
        assert run.restore()
        assert run.step_count == 2
        again = [run.step().values()[0] for _ in range(2)]  # the same batches after the same weights
    assert later == again == reference["losses"][2:]


def test_a_run_started_again_resumes_from_its_newest_checkpoint(tmp_path, fresh_manager, reference):
    config = _config(tmp_path / "run", fresh_manager)
    with start_run(config, fresh_manager) as run:
        run.step()
        run.save()
    assert (tmp_path / "run" / "config.toml").is_file()  # opened as forge train opens a run directory
    with start_run(config, fresh_manager) as resumed:
        assert resumed.resumed_at == resumed.step_count == 1
        losses = [resumed.step().values()[0] for _ in range(STEPS - 1)]
    assert losses == reference["losses"][1:]
    # The directory is an ordinary run's: forge train resumes it where the Run left it.
    assert train(config, fresh_manager).resumed_at == 1


def test_a_run_that_failed_before_its_first_step_leaves_no_directory(tmp_path, fresh_manager):
    config = _config(tmp_path / "new" / "run", fresh_manager)
    with pytest.raises(RuntimeError, match="stopped by the caller"), start_run(config, fresh_manager):
        raise RuntimeError("stopped by the caller")
    assert not (tmp_path / "new").exists()  # as a failed forge train start: nothing left behind


def test_restore_without_a_checkpoint_says_so_and_changes_nothing(tmp_path, fresh_manager):
    with start_run(_config(tmp_path / "run", fresh_manager), fresh_manager) as run:
        run.step()
        assert run.restore() is False
        assert run.step_count == 1


def test_evaluate_without_eval_data_is_a_config_error(tmp_path, fresh_manager):
    config = _config(tmp_path / "run", fresh_manager, "--eval.interval=0")
    with start_run(config, fresh_manager) as run, pytest.raises(ConfigError, match=r"\[eval\] interval"):
        run.evaluate()


class _Recorder:
    """Records which lifecycle hooks a run calls."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self):
        self.calls = []

    @hookimpl
    def forge_lm_train_start(self, context):
        self.calls.append("train_start")

    @hookimpl
    def forge_lm_step_end(self, context, step, metrics):
        self.calls.append("step_end")

    @hookimpl
    def forge_lm_eval_end(self, context, step, metrics):
        self.calls.append("eval_end")
        return {"recorded": 1.0}

    @hookimpl
    def forge_lm_train_end(self, context, status):
        self.calls.append("train_end")


def test_a_run_calls_only_the_hooks_of_what_it_is_asked_to_do(tmp_path, fresh_manager):
    """The loop's lifecycle hooks are the loop's: a Run calls eval_end from evaluate() alone."""
    recorder = _Recorder()
    fresh_manager.add_plugin(recorder, "recorder")
    with start_run(_config(tmp_path / "run", fresh_manager), fresh_manager) as run:
        run.step()
        assert run.evaluate()["recorded"] == 1.0
    assert recorder.calls == ["eval_end"]


def test_the_readme_example_steps_and_saves_a_run(tmp_path, monkeypatch):
    """The README's start_run example, as written, but for where it writes."""
    (code,) = re.findall(r"```python\n(from forge_lm.config import load_config\n.*?)```", README.read_text(), re.DOTALL)
    assert '"--train.output_dir=runs/stepped"' in code
    monkeypatch.chdir(README.parent)  # its config path is the repository's
    monkeypatch.setenv("FORGE_LM_DISABLE_PLUGIN_AUTOLOAD", "1")  # the built-ins: the same here whatever is installed
    exec(code.replace("runs/stepped", str(tmp_path / "stepped")), {})  # the README's own code
    assert [p.name for p in (tmp_path / "stepped" / "checkpoints").glob("step_*")] == ["step_10"]
