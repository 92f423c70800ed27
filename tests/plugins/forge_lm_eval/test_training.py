"""The ``lm_eval`` evaluator during training: ``eval/<task>/<metric>`` in metrics.jsonl at the
evaluation steps, the numbers ``forge eval`` gives for the same checkpoint (on one process and
on two FSDP ranks), ``every``, and config mistakes stopped before the first step."""

from __future__ import annotations

import json

import pytest

from forge_lm.cli._main import main
from forge_lm.config import load_config
from forge_lm.errors import ConfigError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing.distributed import torchrun
from forge_lm.train import train
from forge_lm_eval.harness import metrics_of

from .conftest import TASKS, TINY

TRAINING = (*TINY, "--train.max_steps=4", "--eval.interval=2", "--eval.steps=1")
LM_EVAL = ('--eval.evaluators=["lm_eval"]', '--eval.lm_eval.tasks=["choice.yaml", "complete.yaml", "rolling.yaml"]')
EXPECTED = {
    "eval/forge_test_choice/acc",
    "eval/forge_test_choice/acc_stderr",
    "eval/forge_test_choice/acc_norm",
    "eval/forge_test_choice/acc_norm_stderr",
    "eval/forge_test_complete/exact_match",
    "eval/forge_test_complete/exact_match_stderr",
    "eval/forge_test_rolling/word_perplexity",
    "eval/forge_test_rolling/byte_perplexity",
    "eval/forge_test_rolling/bits_per_byte",
}


def manager() -> PluginManager:
    return PluginManager(PluginSettings(autoload=False, allow=("lm_eval",)))


def run(tmp_path, name: str, *overrides: str):
    plugins = manager()
    config = load_config(None, [*TRAINING, f"--train.output_dir={tmp_path / name}", *overrides], plugins.registry)
    return train(config, plugins)


def evaluations(run_dir) -> dict[int, dict[str, float]]:
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/loss" in r}


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def test_the_evaluator_logs_task_metrics_at_each_evaluation_and_leaves_training_alone(tmp_path, in_tasks_dir):
    with_lm_eval = run(tmp_path, "with", *LM_EVAL)
    without = run(tmp_path, "without")

    evals = evaluations(with_lm_eval.run_dir)
    assert sorted(evals) == [2, 4]
    for record in evals.values():
        assert set(record) == {"step", "eval/loss", "eval/perplexity", *EXPECTED}
        assert 0.0 <= record["eval/forge_test_choice/acc"] <= 1.0
    # lm-eval seeds the global generators; they are put back, so the run trains as it would without it.
    assert losses(with_lm_eval.run_dir) == losses(without.run_dir)

    # The last evaluation is the final checkpoint's, as `forge eval` computes it.
    assert main(["eval", str(with_lm_eval.run_dir), "--tasks", "choice.yaml,complete.yaml,rolling.yaml"]) == 0
    results = json.loads((with_lm_eval.run_dir / "eval" / "step_4.json").read_text())
    logged = {key: value for key, value in evals[4].items() if key in EXPECTED}
    assert logged == pytest.approx(metrics_of(results), rel=1e-6)


def test_every_runs_the_tasks_at_every_kth_evaluation(tmp_path, in_tasks_dir):
    result = run(tmp_path, "every", *LM_EVAL, "--eval.lm_eval.every=2", "--eval.lm_eval.limit=2")
    evals = evaluations(result.run_dir)
    assert sorted(evals) == [2, 4]
    assert "eval/forge_test_choice/acc" not in evals[2]
    assert set(evals[4]) >= EXPECTED


def test_a_missing_task_list_is_a_config_error():
    with pytest.raises(ConfigError, match=r"\[eval.lm_eval\] tasks: name at least one lm-eval task"):
        load_config(None, [*TRAINING, '--eval.evaluators=["lm_eval"]'], manager().registry)


@pytest.mark.parametrize(
    ("tasks", "message"),
    [
        ('["nowhere.yaml"]', "task file 'nowhere.yaml' does not exist"),
        ('["hellaswg"]', "unknown lm-eval task 'hellaswg'. Did you mean 'hellaswag'?"),
    ],
)
def test_an_unknown_task_stops_forge_train_before_the_first_step(tmp_path, in_tasks_dir, capsys, tasks, message):
    run_dir = tmp_path / "bad"
    args = [
        *TRAINING,
        '--eval.evaluators=["lm_eval"]',
        f"--eval.lm_eval.tasks={tasks}",
        f"--train.output_dir={run_dir}",
    ]
    assert main(["--plugins", "lm_eval", "train", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (run_dir / "metrics.jsonl").exists()


def test_every_counts_the_evaluations_of_this_process(tmp_path, in_tasks_dir):
    every = (*LM_EVAL, "--eval.lm_eval.every=2", "--eval.lm_eval.limit=2")
    first = run(tmp_path, "resumed", *every)  # evaluations at steps 2 and 4: the tasks run at 4
    run(tmp_path, "resumed", *every, "--train.max_steps=8")  # resumed: 6 is its first, 8 its second
    evals = evaluations(first.run_dir)
    assert [step for step in sorted(evals) if "eval/forge_test_choice/acc" in evals[step]] == [4, 8]


def test_pipeline_parallelism_is_refused_by_the_core(tmp_path):
    pipeline = ["--distributed.pp=2", "--model.tie_embeddings=false", "--train.grad_accum_steps=2"]
    overrides = [*pipeline, *LM_EVAL, f"--train.output_dir={tmp_path / 'pp'}"]
    done = torchrun(["-m", "forge_lm", "train", *TRAINING, *overrides], nproc=2, cwd=TASKS, timeout=600)

    assert done.returncode != 0  # torchrun's own code for a failed rank; each rank's forge exited 2
    assert "forge: error: [distributed] pp = 2 cannot run [eval] evaluators" in done.stderr
    assert "forge_lm/" not in done.stderr  # a message, not a traceback through Forge (torchrun adds its own)


def test_on_two_fsdp_ranks_rank_0_logs_what_forge_eval_computes_on_one_process(tmp_path, in_tasks_dir):
    run_dir = tmp_path / "fsdp"
    overrides = ["--distributed.dp_shard=2", *LM_EVAL, "--eval.lm_eval.limit=4", f"--train.output_dir={run_dir}"]
    done = torchrun(["-m", "forge_lm", "train", *TRAINING, *overrides], nproc=2, cwd=TASKS, timeout=600)

    assert done.returncode == 0, done.stderr[-3000:]
    assert "dp_shard=2" in done.stderr
    assert done.stderr.count("Tokenizing inputs: 100%") == 2  # rank 0's progress only, at each evaluation
    evals = evaluations(run_dir)
    assert sorted(evals) == [2, 4]
    assert set(evals[4]) >= EXPECTED

    assert main(["eval", str(run_dir), "--tasks", "choice.yaml,complete.yaml,rolling.yaml", "--limit", "4"]) == 0
    results = json.loads((run_dir / "eval" / "step_4.json").read_text())
    logged = {key: value for key, value in evals[4].items() if key in EXPECTED}
    assert logged == pytest.approx(metrics_of(results), rel=1e-4)
