"""A later layer that changes a component's ``name`` replaces the component.

Options an earlier layer (the file) set for the old component that the new one does not take
are dropped, with a note; options given in the same layer as the new name, or kept with the
same component, are still checked strictly.
"""

from __future__ import annotations

import tomllib

import pytest

from forge_lm.cli import main
from forge_lm.config import load_config
from forge_lm.errors import ConfigError

COSINE = """
[scheduler]
name = "cosine"
warmup_steps = 5
min_lr_ratio = 0.1
"""


def _load(builtins, write_toml, toml, *overrides):
    notes: list[str] = []
    config = load_config(write_toml(toml), list(overrides), builtins.registry, notes)
    return config, notes


def test_a_new_name_on_the_command_line_drops_the_files_options_it_does_not_take(builtins, write_toml):
    config, notes = _load(builtins, write_toml, COSINE, "--scheduler.name=constant")
    assert config.scheduler.name == "constant"
    assert config.scheduler.options.warmup_steps == 5  # an option the new scheduler takes is kept
    assert len(notes) == 1
    assert notes[0].startswith("[scheduler] min_lr_ratio = 0.1, set in ")
    assert "scheduler 'constant', which does not take it, is selected on the command line" in notes[0]


def test_the_default_component_counts_as_the_files_choice(builtins, write_toml):
    # The file sets an option of the default scheduler (cosine) without naming it.
    config, notes = _load(builtins, write_toml, "[scheduler]\nmin_lr_ratio = 0.1\n", "--scheduler.name=constant")
    assert config.scheduler.name == "constant"
    assert [note.split(",")[0] for note in notes] == ["[scheduler] min_lr_ratio = 0.1"]


def test_options_both_components_take_carry_over(builtins, write_toml):
    toml = '[optimizer]\nname = "adamw"\nlr = 2e-3\neps = 1e-6\n'
    config, notes = _load(builtins, write_toml, toml, "--optimizer.name=lion")
    assert config.optimizer.name == "lion"
    assert config.optimizer.options.lr == 2e-3
    assert [note.split(",")[0] for note in notes] == ["[optimizer] eps = 1e-06"]


def test_options_in_the_same_layer_as_the_new_name_are_still_strict(builtins, write_toml, error):
    with pytest.raises(ConfigError, match=r"\[scheduler\] min_lr_ratio: unknown key for scheduler 'constant'"):
        _load(builtins, write_toml, COSINE, "--scheduler.name=constant", "--scheduler.min_lr_ratio=0.2")
    message = error('[scheduler]\nname = "constant"\nmin_lr_ratio = 0.1\n')
    assert "[scheduler] min_lr_ratio: unknown key for scheduler 'constant'" in message


def test_the_same_name_again_drops_nothing(builtins, write_toml):
    toml = '[scheduler]\nname = "cosine"\nmin_lr_ratio = 0.1\nbogus = 1\n'
    with pytest.raises(ConfigError, match=r"\[scheduler\] bogus: unknown key for scheduler 'cosine'"):
        _load(builtins, write_toml, toml, "--scheduler.name=cosine")


def test_an_unknown_new_name_is_reported_as_such(builtins, write_toml):
    with pytest.raises(ConfigError, match=r"\[scheduler\] name = 'constnat'"):
        _load(builtins, write_toml, COSINE, "--scheduler.name=constnat")


def test_a_backend_list_change_is_not_a_name_change_and_stays_strict(builtins, write_toml):
    # Dropping a backend whose options the file set is refused with the fix named (by design:
    # the file's table would silently stop applying); only a component's name change prunes.
    toml = '[metrics]\nbackends = ["console", "jsonl"]\n\n[metrics.jsonl]\nfilename = "m.jsonl"\n'
    with pytest.raises(ConfigError, match=r"\[metrics.jsonl\] configures the metrics backend 'jsonl'"):
        _load(builtins, write_toml, toml, '--metrics.backends=["console"]')


def test_config_show_says_what_was_dropped(write_toml, capsys):
    path = write_toml(COSINE)
    assert main(["config", "show", str(path), "--scheduler.name=constant"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("# [scheduler] min_lr_ratio = 0.1, set in ")
    assert "forge: note: [scheduler] min_lr_ratio = 0.1" in err
    shown = tomllib.loads(out)  # the notes are comments: the output is still a config
    assert shown["scheduler"] == {"name": "constant", "warmup_steps": 5}


def test_config_validate_accepts_the_changed_component_and_notes_the_drop(write_toml, capsys):
    path = write_toml(COSINE)
    assert main(["config", "validate", str(path), "--scheduler.name=constant"]) == 0
    assert "forge: note: [scheduler] min_lr_ratio = 0.1" in capsys.readouterr().err


def test_forge_train_notes_the_drop_before_it_trains(write_toml, capsys, tmp_path):
    path = write_toml(COSINE)
    tiny = ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=4", "--model.max_seq_len=32"]
    tiny += ["--train.seq_len=16", "--train.batch_size=2", "--train.max_steps=1", "--data.name=synthetic"]
    tiny += ['--metrics.backends=["jsonl"]', "--eval.interval=0", f"--train.output_dir={tmp_path / 'run'}"]
    assert main(["train", str(path), *tiny, "--scheduler.name=constant"]) == 0
    assert capsys.readouterr().err.startswith("forge: note: [scheduler] min_lr_ratio = 0.1")
