"""``[train.batch_ramp]``: the schedule against Megatron-LM's rampup rule, the checks, and real runs."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from forge_lm.cli import main
from forge_lm.config import load_config
from forge_lm.errors import ConfigError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.train import train
from forge_lm.train.batch_ramp import BatchRamp, StepBatch

SEQ = 16


def megatron_batch(consumed: int, start: int, increment: int, ramp: int, full: int) -> int:
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator, in exact fractions: the batch
    after ``consumed`` (samples there; steps or tokens here) of a ramp of length ``ramp``."""
    increments = (full - start) // increment
    per_increment = Fraction(ramp, increments)
    return min(full, start + math.floor(consumed / per_increment) * increment)


def ramp_config(manager, *overrides: str):
    return load_config(None, [*TINY_MODEL, f"--train.seq_len={SEQ}", *overrides], manager.registry)


@pytest.mark.parametrize(
    ("batch_size", "accum", "ranks", "start", "increment", "ramp_steps"),
    [(2, 8, 1, 2, None, 10), (2, 8, 1, 4, 6, 7), (4, 6, 2, 16, 16, 100), (1, 5, 1, 1, 2, 3)],
)
def test_the_batch_of_every_step_is_megatrons_rampup_rule(
    manager, batch_size, accum, ranks, start, increment, ramp_steps
):
    options = [
        f"--train.batch_size={batch_size}",
        f"--train.grad_accum_steps={accum}",
        f"--train.batch_ramp.start_batch_size={start}",
        f"--train.batch_ramp.ramp_steps={ramp_steps}",
    ]
    if increment is not None:
        options.append(f"--train.batch_ramp.increment={increment}")
    config = ramp_config(manager, *options)
    ramp = BatchRamp.for_run(config, batch_size * SEQ * accum * ranks)
    full, step_of = batch_size * accum * ranks, increment or batch_size * ranks
    for steps in range(ramp_steps + 5):
        planned = ramp.at(steps, 0)
        assert planned.batch_size == megatron_batch(steps, start, step_of, ramp_steps, full)
        assert planned.micro_batches * batch_size * ranks == planned.batch_size  # flat memory: more micro-batches
        assert planned.tokens == planned.batch_size * SEQ
    assert ramp.at(0, 0).batch_size == start
    assert ramp.at(ramp_steps, 0).batch_size == full


def test_a_ramp_over_tokens_follows_the_tokens_trained(manager):
    config = ramp_config(
        manager,
        "--train.batch_size=2",
        "--train.grad_accum_steps=4",
        "--train.batch_ramp.start_batch_size=2",
        "--train.batch_ramp.ramp_tokens=1000",
    )
    ramp = BatchRamp.for_run(config, 2 * SEQ * 4)
    for tokens in range(0, 1200, 7):
        assert ramp.at(0, tokens).batch_size == megatron_batch(tokens, 2, 2, 1000, 8)


def test_without_a_ramp_every_step_has_the_configured_batch_and_logs_nothing_new(manager):
    config = ramp_config(manager, "--train.batch_size=2", "--train.grad_accum_steps=3")
    planned = BatchRamp.for_run(config, 2 * SEQ * 3 * 4).at(7, 10_000)
    assert planned == StepBatch(3, 2 * 3 * 4, 2 * 3 * 4 * SEQ)
    assert planned.logged() == {}
    assert planned.applied(0.5) == 0.5


@pytest.mark.parametrize(("rule", "factor"), [("none", 1.0), ("linear", 0.25), ("sqrt", 0.5)])
def test_lr_scaling_applies_to_the_optimizer_step_only(manager, rule, factor):
    config = ramp_config(
        manager,
        "--train.batch_size=2",
        "--train.grad_accum_steps=4",
        "--train.batch_ramp.start_batch_size=2",
        "--train.batch_ramp.ramp_steps=10",
        f"--train.batch_ramp.lr_scaling={rule}",
    )
    planned = BatchRamp.for_run(config, 2 * SEQ * 4).at(0, 0)  # 1 of 4 micro-batches
    assert planned.lr_factor == factor
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    weight.grad = torch.ones(3)
    with planned.scaled_lr(optimizer):
        optimizer.step()
    assert torch.equal(weight.detach(), torch.full((3,), -0.1 * factor))
    assert optimizer.param_groups[0]["lr"] == 0.1  # the scheduler's rate, untouched afterwards


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--train.batch_ramp.start_batch_size=3"],
            "[train.batch_ramp] start_batch_size: 3 is not a multiple of [train] batch_size (2)",
        ),
        (
            ["--train.batch_ramp.start_batch_size=2", "--train.batch_ramp.increment=3"],
            "[train.batch_ramp] increment: 3 is not a multiple of [train] batch_size (2)",
        ),
        (
            ["--train.batch_ramp.start_batch_size=2", "--train.grad_accum_steps=1"],
            "[train.batch_ramp] start_batch_size: a ramp grows the batch through micro-batches per step, but [train] "
            "grad_accum_steps is 1",
        ),
        (
            ["--train.batch_ramp.start_batch_size=2", "--train.batch_ramp.ramp_steps=0"],
            "[train.batch_ramp] ramp_steps: set exactly one of ramp_steps and ramp_tokens (neither is set)",
        ),
        (
            ["--train.batch_ramp.start_batch_size=2", "--train.batch_ramp.ramp_tokens=9"],
            "[train.batch_ramp] ramp_steps: set exactly one of ramp_steps and ramp_tokens (both are set)",
        ),
        (
            ["--train.batch_ramp.start_batch_size=2", "--distributed.pp=2"],
            "[train.batch_ramp] start_batch_size: a batch ramp is not supported with pipeline parallelism",
        ),
    ],
)
def test_a_ramp_the_config_cannot_have_is_refused_naming_the_option(manager, overrides, message):
    base = ["--train.batch_size=2", "--train.grad_accum_steps=4", "--train.batch_ramp.ramp_steps=5"]
    with pytest.raises(ConfigError) as caught:
        ramp_config(manager, *base, *overrides)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("start", "increment", "message"),
    [
        (4, None, "start_batch_size = 4 is not a multiple of batch_size x data-parallel ranks = 4 x 2 = 8 sequences"),
        (8, 12, "increment = 12 is not a multiple of batch_size x data-parallel ranks = 4 x 2 = 8 sequences"),
        (32, None, "start_batch_size = 32 must be below the full global batch"),
        (8, 16, "increment = 16 does not divide the growth from start_batch_size to the full global batch (32 - 8"),
    ],
)
def test_a_ramp_that_does_not_fit_the_ranks_is_refused_before_training_and_by_validate(
    manager, tmp_path, start, increment, message
):
    options = [
        "--train.batch_size=4",
        "--train.grad_accum_steps=4",
        f"--train.batch_ramp.start_batch_size={start}",
        "--train.batch_ramp.ramp_steps=5",
    ]
    if increment is not None:
        options.append(f"--train.batch_ramp.increment={increment}")
    with pytest.raises(ConfigError, match=f"\\[train.batch_ramp\\] {message}".replace("(", "\\(")):
        BatchRamp.check(ramp_config(manager, *options), dp_size=2)
    assert main(["config", "validate", *options, "--world-size", "2"]) == 2


RUN = (
    *TINY_MODEL,
    f"--train.seq_len={SEQ}",
    "--train.batch_size=2",
    "--train.grad_accum_steps=4",
    "--train.max_steps=8",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--data.name=synthetic",
    "--scheduler.name=constant",
    "--scheduler.warmup_steps=3",
    "--optimizer.lr=3e-3",
)
RAMP = (
    "--train.batch_ramp.start_batch_size=2",
    "--train.batch_ramp.ramp_steps=6",
    "--train.batch_ramp.lr_scaling=sqrt",
)


@pytest.fixture(scope="module")
def ramped(tmp_path_factory) -> Path:
    """Eight steps ramping from 1 to 4 micro-batches of 2 over 6 steps, a checkpoint every 3."""
    manager = PluginManager(PluginSettings(autoload=False))
    run_dir = tmp_path_factory.mktemp("ramp") / "run"
    config = load_config(
        None, [*RUN, *RAMP, "--checkpoint.interval=3", f"--train.output_dir={run_dir}"], manager.registry
    )
    train(config, manager)
    return run_dir


def _trainer_state(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text())["trainer"]


def test_a_ramped_run_logs_each_steps_batch_and_counts_its_tokens_and_batches(ramped):
    records = [r for r in read_metrics(ramped / "metrics.jsonl") if "loss" in r]
    sizes = [megatron_batch(steps, 2, 2, 6, 8) for steps in range(8)]
    assert sizes == [2, 2, 4, 4, 6, 6, 8, 8]
    assert [r["batch_size"] for r in records] == sizes
    assert [r["tokens_per_step"] for r in records] == [size * SEQ for size in sizes]
    for record, size in zip(records, sizes, strict=True):
        scheduled = 3e-3 * min(1.0, record["step"] / 3)  # constant after 3 warm-up steps
        assert record["lr"] == pytest.approx(scheduled * math.sqrt(size / 8), rel=1e-12)
    final = _trainer_state(ramped, 8)
    assert final["tokens_seen"] == sum(sizes) * SEQ
    assert final["data"]["batches"] == sum(sizes) // 2  # micro-batches of 2 read: every one trained on
    changes = [json.loads(line) for line in (ramped / "events.jsonl").read_text().splitlines()]
    changes = [(e["step"], e["batch_size"], e["micro_batches"]) for e in changes if e["type"] == "batch_size"]
    assert changes == [(0, 2, 1), (2, 4, 2), (4, 6, 3), (6, 8, 4)]


def test_the_ramps_first_steps_are_a_one_micro_batch_run(ramped, tmp_path):
    """Before the first increase the ramp trains with one micro-batch: the same steps as a run
    configured with grad_accum_steps = 1 (lr scaled by sqrt(1/4) there, set here by hand)."""
    manager = PluginManager(PluginSettings(autoload=False))
    overrides = [*RUN, "--train.grad_accum_steps=1", "--train.max_steps=2", "--optimizer.lr=1.5e-3"]
    config = load_config(None, [*overrides, f"--train.output_dir={tmp_path / 'flat'}"], manager.registry)
    flat = [r["loss"] for r in read_metrics(train(config, manager).run_dir / "metrics.jsonl") if "loss" in r]
    assert flat == [r["loss"] for r in read_metrics(ramped / "metrics.jsonl") if "loss" in r][:2]


def test_a_run_stopped_mid_ramp_and_resumed_equals_the_straight_run_bit_for_bit(ramped, tmp_path):
    manager = PluginManager(PluginSettings(autoload=False))
    run_dir = tmp_path / "run"
    for steps in (3, 8):  # stops after step 3 (batch 4 of 8), resumes into the rest of the ramp
        config = load_config(
            None, [*RUN, *RAMP, f"--train.max_steps={steps}", f"--train.output_dir={run_dir}"], manager.registry
        )
        train(config, manager)

    def logged(run: Path) -> list[tuple[int, float, int]]:
        return [(r["step"], r["loss"], r["batch_size"]) for r in read_metrics(run / "metrics.jsonl") if "loss" in r]

    assert logged(run_dir) == logged(ramped)
    resumed, straight = _trainer_state(run_dir, 8), _trainer_state(ramped, 8)
    assert (resumed["tokens_seen"], resumed["data"], resumed["scheduler"]) == (
        straight["tokens_seen"],
        straight["data"],
        straight["scheduler"],
    )


def test_forge_train_refuses_a_ramp_that_does_not_fit_before_writing_anything(tmp_path):
    manager = PluginManager(PluginSettings(autoload=False))
    run_dir = tmp_path / "run"
    overrides = [*RUN, "--train.batch_ramp.start_batch_size=8", "--train.batch_ramp.ramp_steps=4"]
    config = load_config(None, [*overrides, f"--train.output_dir={run_dir}"], manager.registry)
    with pytest.raises(ConfigError, match=r"\[train.batch_ramp\] start_batch_size = 8 must be below the full global"):
        train(config, manager)
    assert ConfigError.exit_code == 2
    assert not run_dir.exists()
