"""Resuming in-process: what may change, what may not, and a full disk at save time."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
import torch

from forge_lm import hookimpl
from forge_lm.config import load_config
from forge_lm.errors import ConfigError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.train import Run, train


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


def test_a_resume_that_fails_before_its_first_step_leaves_no_record_of_its_settings(tiny_config, manager, monkeypatch):
    """``config.resume-N.toml`` records the settings a resume changed; a resume that stops
    before training a step (here its first step crashes) did not happen, so the record goes,
    and the next resume is recorded as the first."""
    config = tiny_config("--train.max_steps=4")
    run_dir = train(config, manager).run_dir
    original = (run_dir / "config.toml").read_text()
    longer = load_config(run_dir / "config.toml", ["--train.max_steps=7"], manager.registry)

    def crash(*args, **kwargs):
        raise RuntimeError("the first step crashed")

    with monkeypatch.context() as patch:
        patch.setattr(Run, "step", crash)
        with pytest.raises(RuntimeError, match="the first step crashed"):
            train(longer, manager)
    assert not list(run_dir.glob("config.resume-*.toml"))
    assert (run_dir / "config.toml").read_text() == original
    assert train(longer, manager).steps == 7
    assert [p.name for p in run_dir.glob("config.resume-*.toml")] == ["config.resume-1.toml"]


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


def _failing_saves(monkeypatch, failing_steps):
    """DCP's save raises what it raises for a full disk (its own exception wrapping ENOSPC) at
    the given steps, after writing part of the checkpoint."""
    from torch.distributed.checkpoint.api import CheckpointException

    import forge_lm.checkpoint._local_store as io

    real_save = io.dcp.save

    def save(state, checkpoint_id, **kwargs):
        if int(checkpoint_id.rpartition("_")[2]) in failing_steps:
            Path(checkpoint_id).mkdir(parents=True)
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
            raise CheckpointException("save", {0: OSError(errno.ENOSPC, "No space left on device")})
        return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(io.dcp, "save", save)


def test_a_failed_save_is_a_warning_the_partial_directory_goes_and_the_next_interval_saves(
    tiny_config, manager, monkeypatch, capsys
):
    _failing_saves(monkeypatch, {4})
    config = tiny_config("--checkpoint.interval=2", "--train.max_steps=6")
    result = train(config, manager)
    assert result.status == "completed"
    checkpoints = Path(config.train.output_dir) / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_2", "step_6"]  # step_4's partial is gone
    assert (checkpoints / "latest").read_text().strip() == "step_6"
    warning = next(line for line in capsys.readouterr().err.splitlines() if "step_4" in line)
    assert re.fullmatch(
        re.escape(f"forge: warning: could not write checkpoint '{checkpoints}/step_4': No space left on device (")
        + r"[\d.e+]+ GB free on its disk"
        + re.escape(
            "). The previous checkpoint (step_2) is intact; free disk space or fix the permissions of the run "
            "directory. Training goes on and the next checkpoint interval tries again (1 of 3 failures in a row "
            "allowed)."
        ),
        warning,
    )


def test_repeated_failed_saves_stop_the_run_and_keep_the_last_checkpoint(tiny_config, manager, monkeypatch):
    from forge_lm.train.saving import CheckpointSaveFailed

    _failing_saves(monkeypatch, {4, 6})
    config = tiny_config("--checkpoint.interval=2", "--train.max_steps=10", "--checkpoint.max_failed_saves=2")
    with pytest.raises(CheckpointSaveFailed) as caught:
        train(config, manager)
    assert str(caught.value).endswith(
        "Stopping: 2 saves in a row failed (checkpoint.max_failed_saves = 2). Then run the same command to resume."
    )
    checkpoints = Path(config.train.output_dir) / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_2"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_2"]
    records = [r["step"] for r in read_metrics(Path(config.train.output_dir) / "metrics.jsonl") if "loss" in r]
    assert records == [1, 2, 3, 4, 5, 6]  # stopped right after the second failed save
    lines = (Path(config.train.output_dir) / "events.jsonl").read_text().splitlines()
    logged = [json.loads(line) for line in lines]
    assert [(e["type"], e["step"], e.get("checkpoint")) for e in logged if "checkpoint" in e["type"]] == [
        ("checkpoint_saved", 2, "step_2"),
        ("checkpoint_failed", 4, "step_4"),
        ("checkpoint_failed", 6, "step_6"),
    ]
    assert "No space left on device" in logged[-3]["reason"]
    assert [(e["type"], e["exit_code"]) for e in logged[-2:]] == [("error", 5), ("end", 5)]


def test_a_failed_final_save_stops_at_once(tiny_config, manager, monkeypatch):
    from forge_lm.train.saving import CheckpointSaveFailed

    _failing_saves(monkeypatch, {6})
    config = tiny_config("--checkpoint.interval=2", "--train.max_steps=6")
    with pytest.raises(CheckpointSaveFailed, match="Stopping: this was the final save, which cannot be retried"):
        train(config, manager)
    assert (Path(config.train.output_dir) / "checkpoints" / "latest").read_text().strip() == "step_4"


def test_a_mixture_of_different_kinds_of_source_resumes_with_the_losses_of_an_uninterrupted_run(manager, tmp_path):
    # The data position holds one state per source, of different shapes: each is checked against
    # its own source's live state, not against the first source's.
    mixture = tmp_path / "mixture.toml"
    mixture.write_text(
        "[data]\nname = 'mixture'\nweights = [1.0, 1.0]\n"
        "[[data.sources]]\nname = 'python_stdlib'\n[[data.sources]]\nname = 'synthetic'\n"
    )
    tiny = [*TINY_MODEL, "--train.batch_size=4", "--train.seq_len=16", '--metrics.backends=["jsonl"]']
    tiny += ["--metrics.log_interval=1", "--checkpoint.interval=2", "--eval.interval=0", "--scheduler.name=constant"]

    def config(steps: int, run_dir: Path):
        return load_config(
            mixture, [*tiny, f"--train.max_steps={steps}", f"--train.output_dir={run_dir}"], manager.registry
        )

    straight = train(config(6, tmp_path / "straight"), manager).run_dir
    interrupted = train(config(4, tmp_path / "interrupted"), manager).run_dir
    resumed = train(config(6, interrupted), manager)
    assert resumed.steps == 6
    losses = [[r["loss"] for r in read_metrics(d / "metrics.jsonl") if "loss" in r] for d in (straight, interrupted)]
    assert losses[1] == losses[0]  # bitwise: the resume drew the same samples from each source
