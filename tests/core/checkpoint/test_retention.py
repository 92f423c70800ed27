"""The retention rule (:func:`steps_to_keep`) on schedules of saves, checked against the
steps a person works out by hand from the rules in the docstring of :mod:`._retention`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from forge_lm.checkpoint import CheckpointManager
from forge_lm.checkpoint._retention import steps_to_keep
from forge_lm.config import load_config
from forge_lm.config._dump import to_toml
from forge_lm.config._schema import KeepRange
from forge_lm.errors import ConfigError


def test_keep_last_n_zero_keeps_everything_whatever_the_other_rules():
    assert steps_to_keep(range(1, 11), keep_last_n=0, keep_every_n_steps=4, keep_best_n=1) == set(range(1, 11))


def test_every_n_steps_and_ranges_keep_their_steps_forever():
    # Saves every 500 steps up to 20,000; rules: every 1,000 up to 10,000, then every 5,000.
    steps = range(500, 20_001, 500)
    ranges = [KeepRange(every=1000, until_step=10_000), KeepRange(every=5000)]
    kept = steps_to_keep(steps, keep_last_n=2, ranges=ranges)
    assert kept == {*range(1000, 10_001, 1000), 15_000, 20_000, 19_500}
    # keep_every_n_steps adds its own multiples on top.
    assert steps_to_keep(steps, keep_last_n=1, ranges=ranges, keep_every_n_steps=7000) == {
        *range(1000, 10_001, 1000),
        14_000,
        15_000,
        20_000,
    }


def test_a_step_past_the_last_bounded_range_is_kept_by_no_range():
    kept = steps_to_keep(range(1, 13), keep_last_n=1, ranges=[KeepRange(every=3, until_step=6)])
    assert kept == {3, 6, 12}


def test_best_n_ranks_by_the_metric_ties_go_to_the_newer_step_and_missing_values_never_count():
    metric = {2: 3.0, 4: 1.0, 6: 2.0, 8: 1.0, 9: math.nan}  # 1, 3, 5, 7, 10: no evaluation at those steps
    steps = range(1, 11)
    assert steps_to_keep(steps, keep_last_n=1, keep_best_n=1, metric=metric) == {10, 8}  # 4 ties with 8: 8 is newer
    assert steps_to_keep(steps, keep_last_n=1, keep_best_n=3, metric=metric) == {10, 8, 4, 6}
    assert steps_to_keep(steps, keep_last_n=1, keep_best_n=2, best_mode="max", metric=metric) == {10, 2, 6}
    # Fewer scored steps than keep_best_n: those there are; a value for a step not saved is ignored.
    assert steps_to_keep(steps, keep_last_n=1, keep_best_n=9, metric={4: 1.0, 40: 0.0}) == {10, 4}


def test_the_protected_step_is_kept_even_when_no_rule_keeps_it():
    assert steps_to_keep(range(1, 6), keep_last_n=1, protected=[2]) == {5, 2}


@pytest.mark.parametrize(
    ("rules", "problem"),
    [
        ("[{every = 2}, {every = 3, until_step = 9}]", "only the last"),
        ("[{every = 2, until_step = 9}, {every = 3, until_step = 4}]", "must rise"),
        ("[{every = 0}]", "must be > 0"),
    ],
)
def test_range_rules_out_of_order_are_refused(tmp_path, manager, rules, problem):
    path = tmp_path / "run.toml"
    path.write_text(f"[checkpoint]\nkeep = {rules}\n")
    with pytest.raises(ConfigError, match=rf"\[checkpoint.*{problem}"):
        load_config(path, [], manager.registry)


def test_config_show_prints_the_rules(tmp_path, manager):
    path = tmp_path / "run.toml"
    path.write_text(
        "[checkpoint]\nkeep_last_n = 2\nkeep_every_n_steps = 3\nkeep_best_n = 1\nkeep_best_mode = 'max'\n"
        "keep_best_metric = 'eval/acc'\n"
        "[[checkpoint.keep]]\nuntil_step = 10\nevery = 2\n[[checkpoint.keep]]\nevery = 5\n"
    )
    config = load_config(path, [], manager.registry)
    shown = to_toml(config)  # what forge config show prints
    for line in (
        "keep_every_n_steps = 3",
        "keep_best_n = 1",
        'keep_best_mode = "max"',
        'keep_best_metric = "eval/acc"',
        "{ every = 2, until_step = 10 }",
        "{ every = 5 }",
    ):
        assert line in shown
    again = tmp_path / "again.toml"
    again.write_text(shown)
    assert load_config(again, [], manager.registry).checkpoint == config.checkpoint


def test_pruning_reads_the_saved_metric_and_never_trusts_a_bad_file(tmp_path, manager):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rules = load_config(None, ["--checkpoint.keep_last_n=1", "--checkpoint.keep_best_n=1"], manager.registry)
    checkpoints = CheckpointManager(tmp_path, keep_last_n=1, retention=rules.checkpoint)
    for step, loss in [(1, 2.0), (2, 0.5), (3, 1.0)]:
        checkpoints.note_metrics(step, {"eval/loss": loss, "eval/perplexity": math.exp(loss)})
        checkpoints.save(step, model, optimizer, {})
    assert sorted(p.name for p in checkpoints.root.glob("step_*")) == ["step_2", "step_3"]
    assert json.loads((checkpoints.root / "step_2" / "eval_metrics.json").read_text())["eval/loss"] == 0.5
    (checkpoints.root / "step_2" / "eval_metrics.json").write_text('{"eval/loss": "low"}')  # edited by hand
    checkpoints.save(4, model, optimizer, {})  # no evaluation at step 4: no metric saved, none counted
    assert sorted(p.name for p in checkpoints.root.glob("step_*")) == ["step_3", "step_4"]
    assert not (checkpoints.root / "step_4" / "eval_metrics.json").exists()
