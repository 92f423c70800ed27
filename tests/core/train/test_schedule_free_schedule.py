"""schedule_free_adamw runs under a flat schedule with one warmup; anything else is refused up front."""

from __future__ import annotations

import pytest

from forge_lm.config import load_config
from forge_lm.errors import ConfigError
from forge_lm.train import train

SF = "--optimizer.name=schedule_free_adamw"


def _configure(manager, *overrides):
    config = load_config(None, list(overrides), manager.registry)
    manager.configure(config)
    return config


def test_schedule_free_under_the_default_cosine_schedule_is_refused_naming_the_fix(manager):
    with pytest.raises(ConfigError) as caught:
        _configure(manager, SF)
    message = str(caught.value)
    assert message.startswith("[scheduler] name: 'cosine' decays the learning rate")
    assert '[scheduler] name = "none"' in message


@pytest.mark.parametrize("scheduler", ["wsd", "linear"])
def test_every_decaying_schedule_is_refused(manager, scheduler):
    with pytest.raises(ConfigError, match=f"'{scheduler}' decays"):
        _configure(manager, SF, f"--scheduler.name={scheduler}")


def test_two_warmups_are_refused(manager):
    with pytest.raises(ConfigError) as caught:
        _configure(manager, SF, "--scheduler.name=none", "--scheduler.warmup_steps=10", "--optimizer.warmup_steps=10")
    assert str(caught.value) == (
        "[optimizer] warmup_steps = 10 and [scheduler] warmup_steps = 10 are two warmups, and they multiply; "
        "set one of them to 0."
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ("--scheduler.name=none", "--optimizer.warmup_steps=10"),
        ("--scheduler.name=constant", "--scheduler.warmup_steps=10"),
        ("--scheduler.name=none",),
    ],
)
def test_a_flat_schedule_with_at_most_one_warmup_is_accepted(manager, overrides):
    _configure(manager, SF, *overrides)


def test_other_optimizers_keep_the_cosine_default(manager):
    _configure(manager, "--optimizer.name=adamw")


def test_forge_config_validate_catches_it(forge_cli, tmp_path):
    result = forge_cli("config", "validate", SF, "--data.name=synthetic", f"--train.output_dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert "[scheduler] name: 'cosine' decays the learning rate" in result.stderr
    assert "Traceback" not in result.stderr


def test_forge_train_refuses_it_before_writing_anything(forge_cli, tmp_path):
    run_dir = tmp_path / "run"
    result = forge_cli("train", SF, "--data.name=synthetic", f"--train.output_dir={run_dir}")
    assert result.returncode == 2
    assert "decays the learning rate" in result.stderr
    assert not run_dir.exists()


def test_schedule_free_with_scheduler_none_trains(tiny_config, manager):
    manager.configure(tiny_config(SF, "--scheduler.name=none", "--train.max_steps=2"))
    assert train(tiny_config(SF, "--scheduler.name=none", "--train.max_steps=2"), manager).steps == 2
