"""Parallel degrees: resolution of dp_shard = -1 and the rules that tie degrees to the model."""

from __future__ import annotations

import pytest

from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims
from forge_lm.errors import ConfigError


def _config(manager, *overrides: str):
    return load_config(None, list(overrides), manager.registry)


@pytest.mark.parametrize(
    ("overrides", "world", "expected"),
    [
        ((), 1, (1, 1, 1, 1, 1)),
        ((), 8, (1, 8, 1, 1, 1)),
        (("--distributed.tp=2",), 8, (1, 4, 2, 1, 1)),
        (("--distributed.dp_replicate=2", "--distributed.pp=2", "--model.tie_embeddings=false"), 8, (2, 2, 1, 2, 1)),
        (("--distributed.ep=2",), 4, (1, 4, 1, 1, 2)),
        (("--distributed.dp_shard=2", "--distributed.tp=2"), 4, (1, 2, 2, 1, 1)),
    ],
)
def test_dp_shard_fills_the_world(manager, overrides, world, expected) -> None:
    dims = ParallelDims.resolve(_config(manager, "--train.grad_accum_steps=2", *overrides), world)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.ep) == expected
    assert dims.world_size == world
    assert dims.dp_size == expected[0] * expected[1]


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (("--distributed.tp=3",), 8, "dp_replicate * tp * pp = 1 * 3 * 1 = 3 does not divide the world size 8"),
        (("--distributed.dp_shard=2",), 8, "= 2, but 8 processes were launched"),
        (
            ("--distributed.tp=2", "--model.n_heads=2", "--model.dim=64", "--model.n_kv_heads=1"),
            2,
            "key/value heads (1)",
        ),
        (("--distributed.tp=4", "--model.n_heads=2", "--model.dim=64"), 4, "tp = 4 must divide [model] n_heads = 2"),
        (("--distributed.tp=2", "--train.seq_len=15"), 2, "must divide [train] seq_len = 15"),
        (("--distributed.tp=2", "--model.qk_norm=true"), 2, "qk_norm is not supported with tensor parallelism"),
        (("--distributed.ep=2", "--distributed.dp_shard=3"), 3, "ep = 2 must divide dp_shard = 3"),
        (("--distributed.pp=8", "--train.grad_accum_steps=8"), 8, "pp = 8 stages need at least 8 layers"),
        (("--distributed.pp=2", "--model.tie_embeddings=false"), 2, "1f1b schedule needs at least pp = 2 microbatches"),
        (("--distributed.pp=2", "--train.grad_accum_steps=2"), 2, "set [model] tie_embeddings = false for pipeline"),
    ],
)
def test_bad_combinations_name_the_rule(manager, overrides, world, message) -> None:
    with pytest.raises(ConfigError) as caught:
        ParallelDims.resolve(_config(manager, *overrides), world)
    assert message in str(caught.value)
    assert str(caught.value).startswith("[distributed]")


def test_gpipe_needs_no_more_microbatches_than_one(manager) -> None:
    config = _config(manager, "--distributed.pp=2", "--distributed.pp_schedule=gpipe", "--model.tie_embeddings=false")
    assert ParallelDims.resolve(config, 2).pp == 2


@pytest.mark.parametrize("value", ["0", "-2"])
def test_dp_shard_must_be_positive_or_minus_one(manager, value) -> None:
    with pytest.raises(ConfigError) as caught:
        _config(manager, f"--distributed.dp_shard={value}")
    assert "dp_shard" in str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "world", "needed", "lower"),
    [
        (("--distributed.ep=2",), 1, 2, "--distributed.ep=1"),
        (("--distributed.ep=2", "--distributed.tp=2"), 2, 4, "--distributed.tp=1 --distributed.ep=1"),
        (("--distributed.tp=2",), 1, 2, "--distributed.tp=1"),
        (("--distributed.dp_shard=2",), 1, 2, "--distributed.dp_shard=-1"),
    ],
)
def test_a_layout_larger_than_the_launch_says_how_many_processes_and_both_fixes(
    manager, overrides, world, needed, lower
) -> None:
    """Issue 36: `ep = 2` on one process said only "ep = 2 must divide dp_shard = 1"."""
    with pytest.raises(ConfigError) as caught:
        ParallelDims.resolve(_config(manager, "--train.grad_accum_steps=2", *overrides), world)
    message = str(caught.value)
    assert f"torchrun --nproc_per_node={needed} -m forge_lm train" in message
    assert f"fit the layout to {world} process" in message
    assert lower in message
    assert "must divide dp_shard" not in message
