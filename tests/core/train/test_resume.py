"""Resuming in-process: what may change, what may not, and a full disk at save time."""

from __future__ import annotations

import errno

import pytest
import torch

from forge_lm import hookimpl
from forge_lm.config import load_config
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train import train


class _ExtraOptimizer:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    @hookimpl
    def forge_lm_register_optimizers(self, register):
        register("plain_sgd", lambda options, model: torch.optim.SGD(model.parameters(), lr=0.01), description="SGD")


def test_resuming_continues_the_step_count_and_appends_to_the_metrics(tiny_config, manager):
    config = tiny_config("--train.max_steps=4")
    run_dir = train(config, manager).run_dir
    longer = load_config(run_dir / "config.toml", ["--train.max_steps=7"], manager.registry)
    result = train(longer, manager)
    assert result.steps == 7
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6, 7]
    assert (run_dir / "config.resume-1.toml").exists()  # the changed config is recorded, the first kept


def test_resuming_a_run_whose_component_is_gone_is_refused_naming_it(tiny_config, manager):
    manager.add_plugin(_ExtraOptimizer(), "extra")
    run_dir = train(tiny_config("--train.max_steps=2", "--optimizer.name=plain_sgd"), manager).run_dir
    without = PluginManager(PluginSettings(autoload=False))
    config = load_config(None, [f"--train.output_dir={run_dir}"], without.registry)
    with pytest.raises(ConfigError) as caught:
        train(config, without)
    message = str(caught.value)
    assert message.startswith(f"cannot resume the run in '{run_dir}': its config.toml no longer loads:")
    assert "[optimizer] name = 'plain_sgd': unknown optimizer 'plain_sgd'" in message


def test_resuming_with_a_different_plugin_set_warns_naming_the_difference(tiny_config, manager, capsys):
    manager.add_plugin(_ExtraOptimizer(), "extra", distribution="forge-extra", version="1.0")
    run_dir = train(tiny_config("--train.max_steps=2"), manager).run_dir
    without = PluginManager(PluginSettings(autoload=False))
    capsys.readouterr()
    train(load_config(run_dir / "config.toml", ["--train.max_steps=3"], without.registry), without)
    err = capsys.readouterr().err
    assert f"forge: warning: resuming '{run_dir}': plugin 'extra' (forge-extra) is no longer loaded" in err


def test_a_full_disk_at_save_time_stops_with_a_clear_error_and_keeps_the_last_checkpoint(
    tiny_config, manager, monkeypatch
):
    import forge_lm.checkpoint._io as io

    real_save = io.dcp.save

    def save(state, checkpoint_id, **kwargs):
        if checkpoint_id.endswith("step_4"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(io.dcp, "save", save)
    config = tiny_config("--checkpoint.interval=2", "--train.max_steps=6")
    with pytest.raises(ForgeError) as caught:
        train(config, manager)
    run_dir = config.train.output_dir
    assert str(caught.value) == (
        f"could not write checkpoint '{run_dir}/checkpoints/step_4': No space left on device. The previous "
        "checkpoint (step_2) is intact; free disk space or fix the permissions of the run directory, then run "
        "the same command again to resume."
    )
    from pathlib import Path

    checkpoints = Path(run_dir) / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_2"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_2"]
