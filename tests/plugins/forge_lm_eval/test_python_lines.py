"""The bundled task configs/lm_eval/python_lines.yaml: large enough to rank models, its data
found from any working directory, made by the script beside it."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sysconfig
from pathlib import Path

import pytest

from forge_lm.cli._main import main
from forge_lm.config import load_config
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train import train
from forge_lm_eval.harness import TaskSet

TASK_DIR = Path(__file__).resolve().parents[3] / "configs" / "lm_eval"
TASK = TASK_DIR / "python_lines.yaml"
DATA = TASK_DIR / "python_lines.jsonl"
# A byte-level model trained for 60 steps on the standard library (loss about 3.0): enough to
# learn letter frequencies, the task's easiest tell.
MODEL = (
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.max_seq_len=64",
    "--train.batch_size=8",
    "--train.seq_len=64",
    "--optimizer.lr=3e-3",
    "--scheduler.warmup_steps=5",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--checkpoint.interval=0",
    "--data.name=python_stdlib",
)


# The first 300 items, in batches of 60 requests: cheap enough for the suite, and acc's standard
# error (about 0.026) well below the gap between the two models.
EVAL = ("--limit", "300", "--batch-size", "60")


def items() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]


def test_the_task_has_hundreds_of_well_formed_items_of_four_equal_length_choices():
    loaded = items()

    assert len(loaded) >= 300
    for item in loaded:
        assert len(item["choices"]) == 4
        assert len(set(item["choices"])) == 4
        assert len({len(choice) for choice in item["choices"]}) == 1  # no choice wins by length
        assert item["answer"] in range(4)
    answers = [item["answer"] for item in loaded]
    assert all(answers.count(k) > len(loaded) / 8 for k in range(4))  # the right answer is not in one place


def test_the_right_answer_is_the_real_line_of_the_module_it_names():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for item in items()[:50]:
        module, line = item["source"].rsplit(":", 1)
        lines = (stdlib / module).read_text(encoding="utf-8").splitlines()
        assert item["choices"][item["answer"]] == lines[int(line) - 1].rstrip()


def test_the_script_makes_the_same_items_every_time(tmp_path):
    spec = importlib.util.spec_from_file_location("make_python_lines", TASK_DIR / "make_python_lines.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    stdlib = Path(sysconfig.get_paths()["stdlib"])

    first, second = script.make_items(40, stdlib), script.make_items(40, stdlib)

    assert first == second
    assert len(first) == 40


def test_the_task_loads_from_another_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    tasks = TaskSet([str(TASK)], 64)

    (task,) = tasks.manager.load(tasks.specs)["tasks"].values()
    assert len(list(task.test_docs())) == len(items())


@pytest.fixture(scope="module")
def scores(tmp_path_factory) -> dict[str, float]:
    """acc of an untrained model (one step at a learning rate of 1e-12) and of one trained for
    60 steps, on the task, evaluated from a directory that is not the checkout."""
    manager = PluginManager(PluginSettings(autoload=False))
    runs = {"untrained": ("--train.max_steps=1", "--optimizer.lr=1e-12"), "trained": ("--train.max_steps=60",)}
    results = {}
    for name, extra in runs.items():
        run_dir = tmp_path_factory.mktemp(name) / "run"
        train(load_config(None, [*MODEL, *extra, f"--train.output_dir={run_dir}"], manager.registry), manager)
        out = run_dir / "python_lines.json"
        with contextlib.chdir(run_dir):
            evaluate = ["--no-plugin-autoload", "--plugins", "lm_eval", "eval", ".", "--tasks", str(TASK), *EVAL]
            assert main([*evaluate, "--output", str(out)]) == 0
        results[name] = json.loads(out.read_text())["results"]["forge_python_lines"]["acc,none"]
    return results


def test_a_trained_model_scores_clearly_above_an_untrained_one(scores):
    # Measured on the 300 items: about 0.11-0.14 untrained, 0.29 trained.
    assert scores["trained"] > scores["untrained"] + 0.08
    assert scores["trained"] > 0.25  # above chance, too
