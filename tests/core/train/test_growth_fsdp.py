"""``[checkpoint] init_from`` under FSDP2: 2 gloo ranks (``torchrun``) start from a one-process
run's checkpoint and log the first-step loss one process logs from it on the same global batch
(2 ranks x 2 sequences = 1 process x 4), plainly and grown by ``[checkpoint.growth]``, where
every rank gathers the new tensors' initial values and loads the grown weights sharded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge_lm.config import load_config
from forge_lm.testing.distributed import metrics_by_step, torchrun
from forge_lm.train import train

from .conftest import TINY

GROWN = ("--model.n_layers=3", "--checkpoint.growth.depth=zero")
GROWN += ("--model.ffn.hidden_multiplier=5", "--checkpoint.growth.width=preserve")


def _args(run_dir: Path, *extra: str) -> list[str]:
    return [*TINY, "--eval.interval=0", "--train.max_steps=1", f"--train.output_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """A 2-step source run (seed 1) and the first-step loss of one process started from it."""
    from forge_lm.plugins import PluginManager, PluginSettings

    manager = PluginManager(PluginSettings(autoload=False))
    root = tmp_path_factory.mktemp("fsdp_init_from")
    source = root / "source"
    config = load_config(None, _args(source, "--train.max_steps=2", "--train.seed=1"), manager.registry)
    assert train(config, manager).status == "completed"
    started = root / "one_process"
    config = load_config(None, _args(started, f"--checkpoint.init_from={source}"), manager.registry)
    assert train(config, manager).status == "completed"
    return source, metrics_by_step(started)[1]["loss"]


def _two_ranks(run_dir: Path, source: Path, *extra: str) -> dict[int, dict[str, float]]:
    args = _args(run_dir, "--train.batch_size=2", "--distributed.dp_shard=2", f"--checkpoint.init_from={source}")
    result = torchrun(["-m", "forge_lm", "train", "--no-plugin-autoload", *args, *extra], nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "model transforms: fsdp2" in result.stderr
    return metrics_by_step(run_dir)


def test_two_ranks_start_from_a_one_process_checkpoint_with_its_first_loss(one_process, tmp_path):
    source, expected = one_process
    assert _two_ranks(tmp_path / "run", source)[1]["loss"] == pytest.approx(expected, rel=1e-5)


def test_two_ranks_grow_the_source_and_keep_its_first_loss(one_process, tmp_path):
    source, expected = one_process
    run_dir = tmp_path / "run"
    assert _two_ranks(run_dir, source, *GROWN)[1]["loss"] == pytest.approx(expected, abs=1e-5)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (grown,) = [event for event in events if event["type"] == "init_from"]  # rank 0's, once
    how = {tensor["name"]: (tensor["how"], tensor["shape"]) for tensor in grown["tensors"]}
    assert how["layers.1.feed_forward.w2.weight"] == ("new", [32, 192])
    assert how["layers.2.feed_forward.w1.weight"] == ("grown", [192, 32])
