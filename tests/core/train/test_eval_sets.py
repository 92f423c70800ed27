"""Named validation sets, ``[eval.datasets.<set name>]``: each any dataset with its own options,
logged as ``eval/<set name>/loss`` and ``eval/<set name>/perplexity``; without them, the held-out
split of ``[data]`` as ``eval/loss``."""

from __future__ import annotations

import math
import textwrap
import tomllib
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F

from forge_lm import hookimpl
from forge_lm.cli import main
from forge_lm.config import load_config, to_toml
from forge_lm.data.loader import BatchLoader
from forge_lm.errors import ConfigError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.train import train
from forge_lm.train.builders import build_dataset
from forge_lm.train.inference import load_for_inference

CODE = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n\n" for i in range(40))  # about 1,400 bytes


def _sets(tmp_path):
    """Three sets: synthetic's held-out stream, a whole separate text file, and [data]'s own held-out split."""
    (tmp_path / "code.txt").write_text(CODE, encoding="utf-8")
    return (
        "--eval.datasets.synth.name=synthetic",
        "--eval.datasets.code.name=hf_text",
        f"--eval.datasets.code.path={tmp_path / 'code.txt'}",
        f"--eval.datasets.code.cache_dir={tmp_path / 'hf_cache'}",
        "--eval.datasets.code.eval_fraction=0",
        "--eval.datasets.code.split=train",
        "--eval.datasets.code.steps=3",
        "--eval.datasets.heldout.steps=1",
    )


def _records(run_dir):
    return read_metrics(run_dir / "metrics.jsonl")


def _evaluations(run_dir):
    return [r for r in _records(run_dir) if any(key.startswith("eval/") for key in r)]


def _losses(run_dir):
    return [(r["step"], r["loss"]) for r in _records(run_dir) if "loss" in r]


def test_each_named_set_is_logged_in_one_record_per_evaluation_and_matches_the_final_model(
    tiny_config, manager, tmp_path
):
    config = tiny_config(*_sets(tmp_path))
    run_dir = train(config, manager).run_dir

    evaluations = _evaluations(run_dir)
    assert [r["step"] for r in evaluations] == [3, 6]
    names = [f"eval/{name}/{metric}" for name in ("synth", "code", "heldout") for metric in ("loss", "perplexity")]
    assert all(sorted(r) == sorted(["step", *names]) for r in evaluations)  # no eval/loss beside them
    last = evaluations[-1]

    # The same batches computed apart from the loop: the final checkpoint's model, each set's
    # dataset built again from the run's own config.toml, its first `steps` batches.
    model, saved, tokenizer = load_for_inference(run_dir, manager)
    vocab_size = saved.model.options.vocab_size or tokenizer.vocab_size
    for name, chosen in saved.eval.datasets.items():
        data = build_dataset(saved, manager.registry, tokenizer, vocab_size, chosen.split, 0, 1, chosen.dataset)
        batches = iter(BatchLoader(data, saved.train.batch_size))
        losses = []
        with torch.no_grad():
            for _ in range(chosen.steps or saved.eval.steps):
                batch = next(batches)
                logits = model(batch["input_ids"], batch.get("document_ids"))
                losses.append(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item())
        want = sum(losses) / len(losses)
        assert last[f"eval/{name}/loss"] == pytest.approx(want, abs=1e-6), name
        assert last[f"eval/{name}/perplexity"] == pytest.approx(math.exp(last[f"eval/{name}/loss"]), rel=1e-12)
    # Three different sets, three different numbers: the metrics are not one set's copied.
    assert len({last[f"eval/{name}/loss"] for name in ("synth", "code", "heldout")}) == 3


def test_without_named_sets_the_metrics_are_as_before_and_named_sets_leave_training_unchanged(tiny_config, manager):
    plain = train(tiny_config(), manager).run_dir
    assert [sorted(r) for r in _evaluations(plain)] == [["eval/loss", "eval/perplexity", "step"]] * 2
    # A set reading [data]'s own training split reads its own copy of the data: the training
    # stream's position, and so every training loss, is unchanged.
    with_sets = train(
        tiny_config("--eval.datasets.train_sample.split=train", "--eval.datasets.synth.name=synthetic"), manager
    ).run_dir
    assert _losses(with_sets) == _losses(plain)
    assert len(_losses(plain)) == 6
    first = _evaluations(with_sets)[0]
    assert "eval/loss" not in first
    assert first["eval/synth/loss"] == pytest.approx(_evaluations(plain)[0]["eval/loss"], abs=1e-6)  # same batches


def test_a_resumed_run_with_named_sets_logs_what_an_uninterrupted_one_does(tiny_config, manager):
    sets = ("--eval.datasets.synth.name=synthetic", "--eval.datasets.synth.steps=3", "--eval.datasets.mine.split=eval")
    sets += ("--scheduler.name=constant",)  # a learning rate that does not depend on max_steps
    whole = train(tiny_config(*sets), manager).run_dir
    run_dir = train(tiny_config(*sets, "--train.max_steps=3"), manager).run_dir
    longer = load_config(run_dir / "config.toml", ["--train.max_steps=6"], manager.registry)
    assert longer.eval.datasets.keys() == {"synth", "mine"}
    assert train(longer, manager).steps == 6
    assert _losses(run_dir) == _losses(whole)
    assert _evaluations(run_dir) == _evaluations(whole)


# -- config ----------------------------------------------------------------------------------


@attrs.define
class ProbeOptions:
    text: str = "x"


@attrs.define
class StepsOptions:
    steps: int = 1  # the name an eval set's table keeps for itself


class _Finite:
    """``count`` samples and then the end, like a plugin's finite dataset."""

    def __init__(self, count, context):
        self.count, self.context = count, context

    def __iter__(self):
        ids = torch.zeros(self.context.seq_len, dtype=torch.long)
        return iter([{"input_ids": ids, "labels": ids}] * self.count)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class _Plugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    @hookimpl
    def forge_lm_register_evaluators(self, register):
        register("probe", lambda options, context: None, config=ProbeOptions, description="a probe")
        register("datasets", lambda options, context: None, description="an evaluator with an awkward name")

    @hookimpl
    def forge_lm_register_datasets(self, register):
        register("five", lambda options, context: _Finite(5, context), description="five samples")
        register("stepped", lambda options, context: _Finite(5, context), config=StepsOptions, description="x")


@pytest.fixture
def plugin(manager):
    manager.add_plugin(_Plugin(), "sets")
    return manager


def _error(manager, *overrides, toml=None, tmp_path=None):
    path = None
    if toml is not None:
        path = tmp_path / "run.toml"
        path.write_text(textwrap.dedent(toml), encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(path, list(overrides), manager.registry)
    return str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["--eval.datasets.val.name=hf_txt"],
            "[eval.datasets.val] name = 'hf_txt': unknown dataset 'hf_txt'. Did you mean 'hf_text'?\n"
            "Available datasets: 'hf_text', 'memmap', 'mixture', 'python_stdlib', 'synthetic'.",
        ),
        (
            ["--eval.datasets.val.name=hf_text", "--eval.datasets.val.path=a.txt", "--eval.datasets.val.fromat=json"],
            "[eval.datasets.val] fromat: unknown key for dataset 'hf_text'. Did you mean 'format'? Valid keys: "
            "'cache_dir', 'dataset', 'dataset_config', 'eval_fraction', 'format', 'hub_split', 'path', ",
        ),
        (
            ["--eval.datasets.val.name=hf_text"],
            "[eval.datasets.val] path: hf_text reads local files (path) or a Hugging Face Hub dataset (dataset = "
            '"org/name"): set exactly one.',
        ),
        (
            ["--eval.datasets.val.path=a.txt"],
            '[eval.datasets.val] path: an option, but [eval.datasets.val] names no dataset; add name = "<dataset>" '
            "to say which dataset it is for (without a name, the set is the run's [data] as configured there).",
        ),
        (["--eval.datasets.val.step=3"], "[eval.datasets.val] step: unknown key. Did you mean 'steps'?"),
        (["--eval.datasets.val.steps=0"], "[eval.datasets.val] steps: must be > 0, got 0."),
        (["--eval.datasets.val.split=test"], "[eval.datasets.val] split: must be one of 'eval', 'train', got 'test'."),
        (
            ["--eval.datasets.val=x"],
            "[eval.datasets.val] must be a table with the dataset's name and options, got 'x'.",
        ),
        (["--eval.datasets=x"], "[eval] datasets: expected tables, [eval.datasets.<name>], got 'x'."),
        (
            ["--eval.datasets.a b.name=synthetic"],
            "[eval] datasets: the set name 'a b' may hold only letters, digits, '_' and '-' (and at least one): it is "
            "part of the set's metric names, eval/<set name>/loss.",
        ),
    ],
)
def test_a_mistake_in_a_set_is_refused_naming_its_table_and_key(manager, overrides, expected):
    message = _error(manager, *overrides)
    assert message.startswith(expected), message


def test_set_names_may_hold_letters_digits_underscores_and_dashes(manager):
    config = load_config(None, ["--eval.datasets.Val_2-b.name=synthetic"], manager.registry)
    assert list(config.eval.datasets) == ["Val_2-b"]


def test_an_empty_set_name_is_refused(manager, tmp_path):
    message = _error(manager, toml='[eval.datasets.""]\nname = "synthetic"\n', tmp_path=tmp_path)
    assert message.startswith("[eval] datasets: the set name '' may hold only letters"), message


def test_a_dataset_with_an_option_named_like_a_sets_own_key_is_refused(plugin):
    assert _error(plugin, "--eval.datasets.val.name=stepped") == (
        "[eval.datasets.val] name = 'stepped': the dataset has an option 'steps', but [eval.datasets.val] keeps "
        "that key for its own setting, so the dataset cannot be used here."
    )


def test_named_sets_and_an_evaluators_options_table_sit_side_by_side_in_eval(plugin, tmp_path):
    toml = """
        [eval]
        evaluators = ["probe"]

        [eval.probe]
        text = "def f(): pass"

        [eval.datasets.val]
        name = "synthetic"
        steps = 2
    """
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent(toml), encoding="utf-8")
    config = load_config(path, [], plugin.registry)
    assert config.eval.evaluators[0].options == ProbeOptions("def f(): pass")
    assert (config.eval.datasets["val"].dataset.name, config.eval.datasets["val"].steps) == ("synthetic", 2)
    # An evaluator named like the key cannot have its options table there.
    message = _error(plugin, '--eval.evaluators=["datasets"]')
    assert message.startswith("[eval] evaluators: the evaluator 'datasets' has the name of the key [eval] datasets")


def test_config_show_writes_the_sets_and_its_output_loads_back_equal(manager, tmp_path, capsys):
    toml = """
        [data]
        name = "synthetic"

        [eval.datasets.code]
        name = "hf_text"
        path = "code.txt"
        split = "train"
        eval_fraction = 0.0

        [eval.datasets.heldout]
    """
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent(toml), encoding="utf-8")
    overrides = ["--eval.datasets.code.steps=8", "--eval.datasets.synth.name=synthetic"]
    assert main(["config", "show", str(path), *overrides]) == 0
    shown = capsys.readouterr().out
    sets = tomllib.loads(shown)["eval"]["datasets"]
    assert list(sets) == ["code", "heldout", "synth"]
    code = {"name": "hf_text", "path": "code.txt", "format": "text", "eval_fraction": 0.0, "split": "train", "steps": 8}
    assert {key: sets["code"][key] for key in code} == code  # with every other option of hf_text, at its default
    assert next(iter(sets["code"])) == "name"  # the dataset's name first, the set's own keys last
    assert list(sets["code"])[-2:] == ["split", "steps"]
    assert sets["heldout"] == {"split": "eval"}  # no name: the run's [data]
    assert sets["synth"] == {"name": "synthetic", "split": "eval"}
    config = load_config(path, overrides, manager.registry)
    (tmp_path / "shown.toml").write_text(shown, encoding="utf-8")
    assert load_config(tmp_path / "shown.toml", [], manager.registry) == config
    assert "datasets" not in tomllib.loads(to_toml(load_config(None, [], manager.registry)))["eval"]


def test_choosing_another_dataset_for_a_set_on_the_command_line_drops_the_files_options_for_the_old_one(
    manager, tmp_path
):
    path = tmp_path / "run.toml"
    path.write_text('[eval.datasets.val]\nname = "hf_text"\npath = "a.txt"\nformat = "text"\nsteps = 2\n')
    notes = []
    config = load_config(path, ["--eval.datasets.val.name=memmap"], manager.registry, notes)
    chosen = config.eval.datasets["val"]
    assert (chosen.dataset.name, chosen.dataset.options.path, chosen.steps) == ("memmap", "a.txt", 2)
    assert notes == [
        f"[eval.datasets.val] format = \"text\", set in {path}, is dropped: dataset 'memmap', which does not take "
        "it, is selected on the command line."
    ]


# -- building --------------------------------------------------------------------------------


def test_a_set_shorter_than_its_steps_stops_the_run_at_its_start(tiny_config, plugin):
    config = tiny_config("--eval.datasets.short.name=five", "--eval.datasets.short.steps=3")
    with pytest.raises(ConfigError) as caught:
        train(config, plugin)
    assert str(caught.value) == (
        "eval set 'short' ends after 1 batches of 4 samples, but an evaluation reads 3 ([eval.datasets.short] "
        "steps); lower it, or give the data more samples."
    )
    assert not Path(config.train.output_dir).exists()  # a failed start leaves no run directory


def test_a_sets_dataset_error_names_the_set(tiny_config, manager):
    config = tiny_config("--eval.datasets.py.name=python_stdlib", "--eval.datasets.py.eval_fraction=0")
    with pytest.raises(ConfigError) as caught:
        train(config, manager)
    assert str(caught.value).startswith("[eval.datasets.py]: the eval split of dataset 'python_stdlib' has no modules")
