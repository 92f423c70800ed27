"""What of a checkpoint's optimizer state is restored: what evolves in training (learning rates),
checked; never its settings, which come from the run's config (a changed setting wins over the
checkpoint's). And a checkpoints directory that is a link is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from forge_lm.checkpoint import CheckpointManager, DamagedCheckpointError
from forge_lm.checkpoint._state import check_like, restore_param_groups
from forge_lm.cli._main import main
from forge_lm.errors import ForgeError
from forge_lm.testing import TINY_MODEL

TINY = (
    *TINY_MODEL,
    "--train.batch_size=2",
    "--train.seq_len=16",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--data.name=synthetic",
    "--checkpoint.interval=2",
)


def group(**values):
    return {"lr": 0.1, "initial_lr": 0.3, "betas": {"__tuple__": [0.9, 0.95]}, "eps": 1e-8, "weight_decay": 0.1,
            "maximize": False, "fused": None, "params": ["a", "b"], **values}  # fmt: skip


def test_settings_come_from_the_live_optimizer_and_learning_rates_from_the_checkpoint():
    saved = [group(lr=0.05, initial_lr=0.2, weight_decay=0.5, eps=1e-30, maximize=True, fused=True, params=["x"])]
    live = [group()]
    groups, replaced = restore_param_groups(saved, live)
    assert groups == [group(lr=0.05, initial_lr=0.2)]
    # the settings that differed; not the machine's (fused follows the kernels available)
    assert replaced == [f"optimizer.param_groups[0].{k}" for k in ("eps", "weight_decay", "maximize")]


def test_an_optimizers_declared_evolving_keys_are_restored():
    groups, _ = restore_param_groups([group(counter=7)], [group(counter=0)], evolving=("counter",))
    assert groups[0]["counter"] == 7


def test_a_scheduler_key_may_be_missing_on_either_side():
    no_scheduler = {k: v for k, v in group().items() if k != "initial_lr"}
    assert restore_param_groups([group()], [no_scheduler])[0] == [group()]
    assert restore_param_groups([no_scheduler], [group()])[0] == [group()]


@pytest.mark.parametrize(
    ("saved", "problem"),
    [
        ([group(), group()], "has 2 groups; this run's optimizer has 1"),
        ([], "has 0 groups"),
        ({"0": group()}, "is not a list"),
        ([group(weight_decay="x")], r"param_groups\[0\]\.weight_decay is not a finite number"),
        ([group(maximize=1)], r"param_groups\[0\]\.maximize is not a boolean"),
        ([group(lr=-1.0)], r"param_groups\[0\]\.lr is -1\.0"),
        ([group(initial_lr=float("nan"))], r"param_groups\[0\]\.initial_lr is not a finite number"),
        ([group(momentum=0.9)], r"param_groups\[0\] has keys"),
        ([group(betas={"__tuple__": [0.9]})], r"betas.__tuple__ has 1 entries, expected 2"),
        ([group(params="ab")], r"params is malformed"),
    ],
)
def test_a_saved_group_unlike_the_live_ones_is_damage(saved, problem):
    with pytest.raises(DamagedCheckpointError, match=problem):
        restore_param_groups(saved, [group()])


def test_check_like_with_equal_lengths_compares_item_by_item():
    check_like([0.1, None], [0.2, None], "s", equal_lengths=True)
    check_like([0.1], [0.2, 0.3], "s")  # lists of other lengths pass where lengths may vary
    with pytest.raises(DamagedCheckpointError, match=r"s has 1 entries, expected 2"):
        check_like([0.1], [0.2, 0.3], "s", equal_lengths=True)
    with pytest.raises(DamagedCheckpointError, match=r"s\[1\] is not a finite number"):
        check_like([0.1, "x"], [0.2, 0.3], "s", equal_lengths=True)


# -- through a resume -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("settings") / "run"
    assert main(["train", *TINY, "--train.max_steps=4", f"--train.output_dir={run}"]) == 0
    return run


def copy_run(trained: Path, target: Path) -> Path:
    """The trained run, copied, as one planned for 6 steps."""
    shutil.copytree(trained, target)
    config = target / "config.toml"
    text = config.read_text().replace(str(trained), str(target))
    config.write_text(text.replace("max_steps = 4\n", "max_steps = 6\n"))
    return target


def resume(run: Path, capsys, *overrides: str) -> str:
    """Resume ``run`` to step 6; returns its stderr."""
    capsys.readouterr()
    code = main(["train", *TINY, "--train.max_steps=6", f"--train.output_dir={run}", *overrides])
    err = capsys.readouterr().err
    assert code == 0, err
    return err


def groups_of(run: Path, step: int) -> list[dict]:
    return json.loads((run / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text())["optimizer"][
        "param_groups"
    ]


def test_a_weight_decay_changed_in_the_config_on_resume_wins_over_the_checkpoints(trained, tmp_path, capsys):
    assert [g["weight_decay"] for g in groups_of(trained, 4)] == [0.1, 0.0]
    run = copy_run(trained, tmp_path / "run")
    err = resume(run, capsys, "--optimizer.weight_decay=0.05")
    assert f"resumed from {run / 'checkpoints' / 'step_4'} (step 4)" in err
    assert "passed over" not in err
    assert [g["weight_decay"] for g in groups_of(run, 6)] == [0.05, 0.0]


def test_a_machine_setting_in_the_checkpoint_is_replaced_by_the_live_one_without_remark(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path / "run")
    live_fused = groups_of(trained, 4)[0]["fused"]
    path = run / "checkpoints" / "step_4" / "trainer_state.json"
    state = json.loads(path.read_text())
    for saved in state["optimizer"]["param_groups"]:
        saved["fused"] = None if live_fused else True  # as if saved where other kernels were available
    path.write_text(json.dumps(state))
    err = resume(run, capsys)
    assert f"resumed from {run / 'checkpoints' / 'step_4'} (step 4)" in err
    assert "passed over" not in err
    assert [g["fused"] for g in groups_of(run, 6)] == [live_fused, live_fused]


# -- a checkpoints directory that is a link ---------------------------------------------------


def test_a_checkpoints_directory_that_is_a_link_is_refused(trained, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(trained / "checkpoints", elsewhere)
    before = sorted(p.name for p in elsewhere.iterdir())
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(run, keep_last_n=1)
    with pytest.raises(ForgeError, match=r"checkpoints' is a link .*must be a plain directory"):
        manager.load(model, optimizer)
    with pytest.raises(ForgeError, match="is a link"):
        manager.save(8, model, optimizer, {"tokens_seen": 0})
    with pytest.raises(ForgeError, match="is a link"):
        manager._prune()
    assert sorted(p.name for p in elsewhere.iterdir()) == before
